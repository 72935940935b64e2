"""A process grid: the world split into data x sequence x tensor groups.

World rank ``w`` sits at coordinates ``(data, sequence, tensor)`` with the tensor axis
fastest::

    w = (data * sequence_size + sequence) * tensor_size + tensor

so a tensor group is ``tensor_size`` consecutive ranks: the axis that communicates on
every layer, in forward and backward, stays on one node when a node holds at least
that many ranks (Megatron-LM orders its groups the same way). The sequence axis comes
next, the data axis (one gradient exchange per step) is the outermost.

    grid = ProcessGrid(mpidl.comm.world(), tensor=2, sequence=2)   # 8 ranks: data = 2
    model = ParallelGPT(GPT(...), grid)
    dp = DataParallel(model, grid.replicas)     # gradients over data x sequence

Every rank of a sequence group holds the same parameters and computes a share of the
same samples' gradient, so the gradient exchange of data parallelism runs over
:attr:`ProcessGrid.replicas` (data x sequence); with ``sequence=1`` that is the data
group. ZeRO shards over the same group.
"""
from __future__ import annotations

from mpidl.comm.base import Communicator


class ProcessGrid:
    """The ranks of ``comm`` as a data x sequence x tensor grid, with a communicator per axis.

    Construction is collective over ``comm``: every rank must pass the same sizes (they
    are compared first, and a difference is a :class:`~mpidl.comm.DistributedError` on
    every rank naming them).

    Args:
        comm: the world of the job (``mpidl.comm.world()``); it is split, not kept busy.
        tensor: ranks per tensor-parallel group (layers' weights split across them).
        sequence: ranks per sequence-parallel group (the sequence split across them).

    Attributes:
        world: ``comm``.
        data_size, sequence_size, tensor_size: the axis sizes
            (``data_size = comm.size // (tensor * sequence)``).
        data_rank, sequence_rank, tensor_rank: this rank's coordinates.
        data, sequence, tensor: communicators of this rank's group along each axis
            (the ranks that differ from this one in that coordinate only).
        replicas: the ranks holding the same parameters as this one (the same tensor
            coordinate): data x sequence, where gradients are averaged.

    Raises:
        ValueError: (on every rank) a size is not positive or ``tensor * sequence`` does
            not divide ``comm.size``.
    """

    def __init__(self, comm: Communicator, tensor: int = 1, sequence: int = 1) -> None:
        everyone = comm.allgather_obj((tensor, sequence))
        comm.check(all(e == everyone[0] for e in everyone),
                   "ProcessGrid sizes differ between ranks: " + ", ".join(
                       f"rank {r} tensor={t} sequence={s}" for r, (t, s) in enumerate(everyone))
                   + ". Pass the same sizes on every rank.")
        for name, n in (("tensor", tensor), ("sequence", sequence)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"ProcessGrid: {name}={n!r} must be a positive int")
        if comm.size % (tensor * sequence):
            raise ValueError(
                f"ProcessGrid: tensor={tensor} x sequence={sequence} = {tensor * sequence} "
                f"does not divide the {comm.size} ranks; use sizes whose product divides "
                f"{comm.size} (the data axis gets the rest)")
        self.world = comm
        self.tensor_size, self.sequence_size = tensor, sequence
        self.data_size = comm.size // (tensor * sequence)
        w = comm.rank
        self.tensor_rank = w % tensor
        self.sequence_rank = (w // tensor) % sequence
        self.data_rank = w // (tensor * sequence)
        d, s, t = self.data_rank, self.sequence_rank, self.tensor_rank
        # Colours number the groups; keys order each group by its own coordinate.
        self.tensor = comm.split(d * sequence + s, key=t)
        self.sequence = comm.split(d * tensor + t, key=s)
        self.data = comm.split(s * tensor + t, key=d)
        self.replicas = comm.split(t, key=d * sequence + s)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(data_size, sequence_size, tensor_size)``."""
        return self.data_size, self.sequence_size, self.tensor_size

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """This rank's ``(data_rank, sequence_rank, tensor_rank)``."""
        return self.data_rank, self.sequence_rank, self.tensor_rank

    def world_rank(self, data: int, sequence: int, tensor: int) -> int:
        """The world rank at the given coordinates (not collective)."""
        return (data * self.sequence_size + sequence) * self.tensor_size + tensor

    def free(self) -> None:
        """Free the axis communicators. Collective over the world."""
        for c in (self.tensor, self.sequence, self.data, self.replicas):
            c.free()

    def __repr__(self) -> str:
        return (f"ProcessGrid(data={self.data_size}, sequence={self.sequence_size}, "
                f"tensor={self.tensor_size}; this rank {self.coordinates})")


def single_grid() -> ProcessGrid:
    """The 1 x 1 x 1 grid of a process alone (not collective)."""
    from mpidl.comm.single import SingleCommunicator

    return ProcessGrid(SingleCommunicator())


__all__ = ["ProcessGrid", "single_grid"]
