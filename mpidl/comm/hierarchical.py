"""Hierarchical allreduce: reduce inside each node, allreduce among node leaders, broadcast.

On a cluster, ranks on one node share memory that is far faster than the network. A
flat allreduce over all ranks sends every rank's data across the network; the
hierarchical one sends one message per *node*: node-local reduce to the node's leader
(local rank 0), an allreduce among the leaders only, and a node-local broadcast of the
result (Horovod's ``--hierarchical-allreduce``, ChainerMN's ``hierarchical``
communicator). With one node it is a reduce plus a broadcast: no gain, only a check.
The leaders' stage can be replaced (``between_nodes``): data parallelism compresses
gradients to 16 bits there only, keeping the node-local sums in full precision.
"""
from __future__ import annotations

from typing import Any, Callable

from mpidl.comm.base import Communicator, CompletedRequest, Request


class HierarchicalCommunicator:
    """Allreduce over ``comm`` in three stages (node, leaders, node).

    Args:
        comm: the group to reduce over (an MPI communicator of mpidl). Collective.
        ranks_per_node: group consecutive ranks into "nodes" of this many ranks instead
            of the real nodes (``comm.node_comm``: MPI's shared-memory split, or the
            node names where the two disagree, :func:`hpc.env.group_nodes`): to test or
            tune the scheme on one machine, or where the launcher's node notion is not
            the one wanted.
    """

    def __init__(self, comm: Communicator, ranks_per_node: int | None = None) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        if ranks_per_node is None:
            # The real node: ranks that share memory with this one.
            from mpidl.comm.mpi import MpiCommunicator

            self.node = MpiCommunicator(comm.node_comm, cuda_aware=comm.stager.cuda_aware)
        else:
            if ranks_per_node < 1:
                raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1")
            self.node = comm.split(comm.rank // ranks_per_node)
        self.is_leader = self.node.rank == 0
        self.leaders = comm.split(0 if self.is_leader else 1)

    def allreduce_(
        self,
        x: Any,
        op: str = "sum",
        between_nodes: Callable[[Communicator, Any], None] | None = None,
    ) -> Any:
        """In-place allreduce of ``x`` over ``comm`` in three stages; returns ``x``.

        Collective over ``comm``: the contract of :meth:`Communicator.allreduce_`.

        Args:
            between_nodes: how the leaders combine their node sums, called on the leaders
                only as ``between_nodes(leaders, x)`` and expected to leave the global
                result in ``x`` (default: ``leaders.allreduce_(x, op)``). Data
                parallelism passes a 16-bit wire allreduce here, so gradients are
                compressed only where they cross the network.
        """
        self.node.reduce_(x, root=0, op=op)
        if self.is_leader:
            if between_nodes is None:
                self.leaders.allreduce_(x, op)
            else:
                between_nodes(self.leaders, x)
        self.node.bcast_(x, root=0)
        return x

    def iallreduce_(self, x: Any, op: str = "sum") -> Request:
        """The three stages run now (blocking); returns a completed request.

        Chaining three non-blocking stages would need MPI progress between them, which
        only a progress thread could give; the bucketed caller still overlaps buckets
        that become ready later in backward.
        """
        return CompletedRequest(self.allreduce_(x, op))

    def free(self) -> None:
        self.node.free()
        self.leaders.free()
