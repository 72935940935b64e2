"""PowerSGD: each gradient matrix travels as a rank-r approximation, with error feedback.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (Algorithm 1 with the error feedback of
Algorithm 2); the options and defaults follow PyTorch's DDP communication hook
(:class:`~mpidl.parallel.compression_choice.PowerSGDOptions`). Per gradient bucket and
step, with M_k the rank's gradient of matrix k (reshaped to rows x the rest) plus its
error, and T_k the sum of M_k over the ranks (the global gradient)::

    P_k = M_k Q_k                 (n x r)   one allreduce of every P_k of the bucket,
                                            together with the bucket's uncompressed
                                            tensors (biases, norms, small matrices)
    P_k = orthonormal basis of sum P_k      (a reduced QR: robust where P is rank
                                            deficient, which Gram-Schmidt is not)
    Q_k = M_k^T P_k               (m x r)   one allreduce of every Q_k of the bucket
    T_k ~ P_k Q_k^T,   error_k = M_k - P_k Q_k^T / size

An n x m matrix sends (n + m) r numbers instead of n m. Every quantity after the first
allreduce depends on the ranks' M_k only through their sum, so the errors matter only
through their sum too, and that sum is exactly what the approximation lost: with r at
least min(n, m) (and a Q of full rank) the approximation is the sum itself, equal to
uncompressed data parallelism up to rounding. Warm start keeps the summed Q_k for the
next step (one power iteration per step then tracks the top singular vectors).

Order of collectives: a bucket's P allreduce starts from :meth:`iallreduce_` (during
backward, with overlap; ``test()`` drives its progress) and only ``wait()`` starts its
Q allreduce. ``test()`` never advances to Q: ranks whose P finished at different
moments would otherwise start the Qs and later buckets' Ps in different orders, which
MPI forbids. The launcher starts every bucket before it waits on the first, so every
rank issues P_0 .. P_b, then Q_0 .. Q_b.

State (checkpointed by :mod:`mpidl.parallel.powersgd_state`): the step count, the
warm-start Qs (the same on every rank) and each rank's error feedback.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy

from mpidl.backend import get_array_module, to_device
from mpidl.comm.base import Request
from mpidl.parallel.compression_choice import PowerSGDOptions
from mpidl.parallel.transport import Transport


@dataclasses.dataclass
class Matrix:
    """One compressed member of a bucket: ``flat[start:start + n*m]`` as an n x m matrix."""

    index: int  # the member's position in its bucket
    start: int
    n: int
    m: int
    rank: int  # min(r, n, m)
    q: Any = None  # (m, rank): the warm-start Q, the same on every rank


@dataclasses.dataclass
class BucketPlan:
    """How one bucket travels: its matrices, and the runs sent uncompressed."""

    size: int
    matrices: list[Matrix]
    plain: list[tuple[int, int]]  # (start, length) runs of flat, sent as they are

    @property
    def plain_size(self) -> int:
        return sum(n for _, n in self.plain)

    @property
    def p_size(self) -> int:
        return sum(k.n * k.rank for k in self.matrices)

    @property
    def q_size(self) -> int:
        return sum(k.m * k.rank for k in self.matrices)


def plan_bucket(shapes: Sequence[tuple[int, ...]], options: PowerSGDOptions) -> BucketPlan:
    """Which members of a bucket (their shapes, in bucket order) are compressed.

    A tensor of two or more dimensions is a matrix of its first dimension by the rest
    (a convolution's filters: out x in*kh*kw, as PyTorch's hook); it is compressed when
    its elements exceed ``min_compression_rate`` times the (n + m) r it would send.
    Everything else travels uncompressed, in one message with the bucket's Ps. Pure
    function of the shapes and options: the same on every rank.
    """
    r = int(options.matrix_approximation_rank)
    matrices, plain, start = [], [], 0
    for i, shape in enumerate(shapes):
        size = int(numpy.prod(shape, dtype=numpy.int64))
        n = int(shape[0]) if len(shape) >= 2 else 0
        m = size // n if n else 0
        rank = min(r, n, m)
        if len(shape) >= 2 and size and size > options.min_compression_rate * (n + m) * rank:
            matrices.append(Matrix(i, start, n, m, rank))
        elif size:
            if plain and plain[-1][0] + plain[-1][1] == start:
                plain[-1] = (plain[-1][0], plain[-1][1] + size)
            else:
                plain.append((start, size))
        start += size
    return BucketPlan(start, matrices, plain)


def wire_elements(shapes: Sequence[tuple[int, ...]], options: PowerSGDOptions) -> tuple[int, int]:
    """Elements one bucket of these shapes sends with PowerSGD: (first message: the
    uncompressed tensors and the Ps, second: the Qs). For the planner."""
    plan = plan_bucket(shapes, options)
    return plan.plain_size + plan.p_size, plan.q_size


class PowerSGDTransport(Transport):
    """Data parallelism's buckets summed as low-rank approximations (see the module).

    Reduce-scatter and allgather (ZeRO) stay plain MPI: PowerSGD needs whole matrices.

    Args:
        comm: the replicas.
        piece_bytes: the largest uncompressed message (as :class:`MpiTransport`).
        options: rank, warm start, error feedback, uncompressed steps first.
        shapes: per bucket (in the order :meth:`bind` gets them), its members' shapes.
    """

    def __init__(self, comm: Any, piece_bytes: int, options: PowerSGDOptions,
                 shapes: Sequence[Sequence[tuple[int, ...]]]) -> None:
        super().__init__(comm, piece_bytes)
        self.options = options
        self.name = f"mpi, {options} (PowerSGD)"
        self.plans = [plan_bucket(s, options) for s in shapes]
        self.steps = [0] * len(self.plans)  # per bucket: exchanges started
        self.errors: list[Any] = [None] * len(self.plans)  # per bucket, lazily
        self._index: dict[int, int] = {}
        self._flats: list[Any] = []

    def bind(self, flats: Sequence[Any], rows: Sequence[int | None] | None = None) -> list[Any]:
        if len(flats) != len(self.plans):
            raise ValueError(f"PowerSGDTransport got {len(flats)} buckets, planned "
                             f"{len(self.plans)}")
        self._flats = list(flats)
        self._index = {id(f): i for i, f in enumerate(flats)}
        return list(flats)

    @property
    def step(self) -> int:
        """Exchanges done: the largest count of any bucket. Between steps every bucket
        this transport sums has the same count; an embedding table's bucket, which
        travels apart (:class:`~mpidl.parallel.sparse.SparseTables`), keeps 0."""
        return max(self.steps) if self.steps else 0

    def compressing(self, step: int | None = None) -> bool:
        """Whether the exchange of ``step`` (default: the next) is compressed."""
        return (self.step if step is None else step) >= self.options.start_powerSGD_iter

    def allreduce_(self, flat: Any) -> None:
        self.iallreduce_(flat).wait()

    def iallreduce_(self, flat: Any) -> Request:
        i = self._index[id(flat)]
        step, plan = self.steps[i], self.plans[i]
        self.steps[i] += 1
        if step < self.options.start_powerSGD_iter or not plan.matrices:
            return self.comm.iallreduce_(flat)
        return _Exchange(self, i, flat, step)

    # -- the pieces of one exchange ----------------------------------------------------------
    def _q(self, i: int, k: Matrix, step: int, xp: Any, dtype: Any) -> Any:
        """The Q to multiply by: the warm one, or a fresh one from the seed."""
        if k.q is not None and self.options.warm_start:
            return k.q
        # The same on every rank; per step only without warm start.
        salt = 0 if self.options.warm_start else step
        rng = numpy.random.default_rng((self.options.random_seed, i, k.index, salt))
        return to_device(rng.standard_normal((k.m, k.rank)).astype(dtype), xp)

    def _error(self, i: int, flat: Any) -> Any:
        if self.errors[i] is None:
            self.errors[i] = get_array_module(flat).zeros_like(flat)
        return self.errors[i]

    # -- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What resuming bit for bit needs: ``{"step", "q": {(bucket, member): Q},
        "error": {(bucket, member): this rank's error}}`` (views, not copies)."""
        q, error = {}, {}
        for i, plan in enumerate(self.plans):
            for k in plan.matrices:
                if k.q is not None:
                    q[(i, k.index)] = k.q
                if self.errors[i] is not None:
                    error[(i, k.index)] = self.errors[i][k.start:k.start + k.n * k.m]
        return {"step": self.step, "q": q, "error": error}


class _Exchange(Request):
    """One bucket's compressed sum: the P allreduce in flight; ``wait()`` does the rest."""

    def __init__(self, owner: PowerSGDTransport, i: int, flat: Any, step: int) -> None:
        self.owner, self.i, self.flat = owner, i, flat
        self.plan = plan = owner.plans[i]
        xp = self.xp = get_array_module(flat)
        opts = owner.options
        error = owner._error(i, flat) if opts.use_error_feedback else None
        # [uncompressed runs | P_0 | P_1 ...] in one message
        self.first = xp.empty(plan.plain_size + plan.p_size, dtype=flat.dtype)
        at = 0
        for start, n in plan.plain:
            self.first[at:at + n] = flat[start:start + n]
            at += n
        self.ms, self.ps = [], []
        for k in plan.matrices:
            m = flat[k.start:k.start + k.n * k.m].reshape(k.n, k.m)
            if error is not None:
                m += error[k.start:k.start + k.n * k.m].reshape(k.n, k.m)  # (n, m)
            q = owner._q(i, k, step, xp, flat.dtype)
            p = self.first[at:at + k.n * k.rank].reshape(k.n, k.rank)
            xp.matmul(m, q, out=p)  # (n, r)
            self.ms.append(m)
            self.ps.append(p)
            at += k.n * k.rank
        self.request = owner.comm.iallreduce_(self.first)
        self.done = False

    def test(self) -> bool:
        # Drives the P allreduce (Open MPI progresses it only inside MPI calls) but never
        # starts the Q allreduce (see the module: the order of collectives).
        if not self.done:
            self.request.test()
        return self.done

    def wait(self) -> Any:
        if self.done:
            return self.flat
        xp, plan, owner, flat = self.xp, self.plan, self.owner, self.flat
        self.request.wait()
        at = 0
        for start, n in plan.plain:
            flat[start:start + n] = self.first[at:at + n]
            at += n
        second = xp.empty(plan.q_size, dtype=flat.dtype)
        qs, at = [], 0
        for k, m, p in zip(plan.matrices, self.ms, self.ps):
            basis, _ = xp.linalg.qr(p)  # (n, r), orthonormal columns spanning sum P
            p[...] = basis
            q = second[at:at + k.m * k.rank].reshape(k.m, k.rank)
            xp.matmul(m.T, p, out=q)  # (m, r)
            qs.append(q)
            at += k.m * k.rank
        owner.comm.allreduce_(second)
        error = owner.errors[self.i] if owner.options.use_error_feedback else None
        size = owner.comm.size
        for k, m, p, q in zip(plan.matrices, self.ms, self.ps, qs):
            if error is not None:
                e = error[k.start:k.start + k.n * k.m].reshape(k.n, k.m)
                e[...] = m  # this rank's gradient and error, before ...
            xp.matmul(p, q.T, out=m)  # (n, m): the sum over the ranks, approximated
            if error is not None:
                e -= m / size  # ... minus its share of the approximation
            if owner.options.warm_start:
                k.q = q.copy()
        self.done = True
        return flat


__all__ = ["PowerSGDTransport", "plan_bucket", "wire_elements"]
