"""A process grid: the world split into pipeline x data x sequence x tensor groups.

World rank ``w`` sits at coordinates ``(pipeline, data, sequence, tensor)`` with the
tensor axis fastest::

    w = ((pipeline * data_size + data) * sequence_size + sequence) * tensor_size + tensor

so a tensor group is ``tensor_size`` consecutive ranks: the axis that communicates on
every layer, in forward and backward, stays on one node when a node holds at least
that many ranks (Megatron-LM orders its groups the same way). The sequence axis comes
next, then the data axis (one gradient exchange per step); the pipeline axis (one
activation per microbatch to the next stage) is the outermost, so with nodes filled in
rank order neighbouring stages sit on different nodes and a stage's tensor group on
one.

    grid = ProcessGrid(mpidl.comm.world(), tensor=2, sequence=2)   # 8 ranks: data = 2
    model = ParallelGPT(GPT(...), grid)
    dp = DataParallel(model, grid.replicas)     # gradients over data x sequence

Every rank of a sequence group holds the same parameters and computes a share of the
same samples' gradient, so the gradient exchange of data parallelism runs over
:attr:`ProcessGrid.replicas` (data x sequence, within one pipeline stage); with
``sequence=1`` that is the data group. ZeRO shards over the same group.
"""
from __future__ import annotations

from mpidl.comm.base import Communicator
from mpidl.comm.single import SingleCommunicator


class ProcessGrid:
    """The ranks of ``comm`` as a pipeline x data x sequence x tensor grid, with a
    communicator per axis.

    Construction is collective over ``comm``: every rank must pass the same sizes (they
    are compared first, and a difference is a :class:`~mpidl.comm.DistributedError` on
    every rank naming them).

    Args:
        comm: the world of the job (``mpidl.comm.world()``); it is split, not kept busy.
        tensor: ranks per tensor-parallel group (layers' weights split across them).
        sequence: ranks per sequence-parallel group (the sequence split across them).
        pipeline: pipeline stages (the model's layers split across them,
            :mod:`mpidl.parallel.pipeline`).

    Attributes:
        world: ``comm``.
        pipeline_size, data_size, sequence_size, tensor_size: the axis sizes
            (``data_size = comm.size // (pipeline * tensor * sequence)``).
        pipeline_rank, data_rank, sequence_rank, tensor_rank: this rank's coordinates.
        pipeline, data, sequence, tensor: communicators of this rank's group along each
            axis (the ranks that differ from this one in that coordinate only).
        replicas: the ranks holding the same parameters as this one (the same tensor and
            pipeline coordinates): data x sequence, where gradients are averaged.

    :attr:`shape`, :attr:`coordinates` and :meth:`world_rank` speak of the
    ``(data, sequence, tensor)`` grid of one pipeline stage, so code that knows no
    pipeline reads them unchanged.

    Raises:
        ValueError: (on every rank) a size is not positive or
            ``pipeline * tensor * sequence`` does not divide ``comm.size``.
    """

    def __init__(self, comm: Communicator, tensor: int = 1, sequence: int = 1,
                 pipeline: int = 1) -> None:
        everyone = comm.allgather_obj((tensor, sequence, pipeline))
        comm.check(all(e == everyone[0] for e in everyone),
                   "ProcessGrid sizes differ between ranks: " + ", ".join(
                       f"rank {r} tensor={t} sequence={s} pipeline={p}"
                       for r, (t, s, p) in enumerate(everyone))
                   + ". Pass the same sizes on every rank.")
        for name, n in (("tensor", tensor), ("sequence", sequence), ("pipeline", pipeline)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"ProcessGrid: {name}={n!r} must be a positive int")
        inner = tensor * sequence * pipeline
        if comm.size % inner:
            what = f"tensor={tensor} x sequence={sequence}"
            if pipeline > 1:
                what += f" x pipeline={pipeline}"
            raise ValueError(
                f"ProcessGrid: {what} = {inner} does not divide the {comm.size} ranks; use "
                f"sizes whose product divides {comm.size} (the data axis gets the rest)")
        self.world = comm
        self.tensor_size, self.sequence_size = tensor, sequence
        self.pipeline_size = pipeline
        self.data_size = comm.size // inner
        w = comm.rank
        self.tensor_rank = w % tensor
        self.sequence_rank = (w // tensor) % sequence
        self.data_rank = (w // (tensor * sequence)) % self.data_size
        self.pipeline_rank = w // (tensor * sequence * self.data_size)
        p, d, s, t = self.pipeline_rank, self.data_rank, self.sequence_rank, self.tensor_rank
        D, S, T = self.data_size, sequence, tensor
        # Colours number the groups; keys order each group by its own coordinate.
        self.tensor = comm.split((p * D + d) * S + s, key=t)
        self.sequence = comm.split((p * D + d) * T + t, key=s)
        self.data = comm.split((p * S + s) * T + t, key=d)
        self.pipeline = comm.split((d * S + s) * T + t, key=p)
        self.replicas = comm.split(p * T + t, key=d * S + s)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(data_size, sequence_size, tensor_size)``: one pipeline stage's grid."""
        return self.data_size, self.sequence_size, self.tensor_size

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """This rank's ``(data_rank, sequence_rank, tensor_rank)`` in its stage."""
        return self.data_rank, self.sequence_rank, self.tensor_rank

    def world_rank(self, data: int, sequence: int, tensor: int,
                   pipeline: int | None = None) -> int:
        """The world rank at the given coordinates; ``pipeline`` None: this rank's
        stage (not collective)."""
        stage = self.pipeline_rank if pipeline is None else pipeline
        return (((stage * self.data_size + data) * self.sequence_size + sequence)
                * self.tensor_size + tensor)

    def free(self) -> None:
        """Free the axis communicators. Collective over the world."""
        for c in (self.tensor, self.sequence, self.data, self.pipeline, self.replicas):
            c.free()

    def __repr__(self) -> str:
        stages = f"pipeline={self.pipeline_size}, " if self.pipeline_size > 1 else ""
        here = f"stage {self.pipeline_rank}, " if self.pipeline_size > 1 else ""
        return (f"ProcessGrid({stages}data={self.data_size}, sequence={self.sequence_size}, "
                f"tensor={self.tensor_size}; this rank {here}{self.coordinates})")


def single_grid() -> ProcessGrid:
    """The 1 x 1 x 1 grid of a process alone (not collective)."""
    return ProcessGrid(SingleCommunicator())


__all__ = ["ProcessGrid", "single_grid"]
