"""The exact distributed sampler: every sample once per epoch, the same batches at any size.

An epoch is an ordering of the ``N`` sample ids, cut into global batches of
``global_batch`` consecutive positions; the last one is smaller when ``N`` is not a
multiple (or dropped with ``drop_last=True``). Global batch ``j`` of epoch ``e`` is a fixed
list of ids that depends on ``(seed, epoch, N, global_batch, shuffle, block_size)`` only,
never on the number of ranks. Rank ``r`` of ``size`` takes a contiguous slice of each
global batch, split as evenly as possible (the first ``n % size`` ranks get one more, a
rank may get none). So:

- every sample is seen exactly once per epoch, with no padding duplicates (PyTorch's
  ``DistributedSampler`` repeats samples to even out ranks; we do not);
- every rank runs the same number of steps, ``len(sampler)``;
- concatenating the ranks' slices of a step in rank order gives the same global batch at
  1, 2 or 1000 ranks; with a loss summed over the batch and divided by the global count
  (``global_count(step)``), training equals single-process training up to rounding;
- resuming at ``(epoch, step)`` continues exactly, even with a different number of ranks.

The ordering is a keyed bijection (a 4-round Feistel network with cycle-walking, keyed by
splitmix64 of ``(seed, epoch)``), not NumPy's RNG: it is the same on every machine and
NumPy version, a rank computes only the positions it needs, and ``seed + epoch`` does not
collide across runs (PyTorch's seed 0 epoch 1 equals seed 1 epoch 0; ours do not).

Shuffle modes (the trade-off between randomness and read speed):

- ``"block"`` (default): the ids are cut into blocks of ``block_size`` consecutive ids and
  the *blocks* are permuted. A rank's slice of a batch is then a few contiguous runs,
  read with one call each; the project's HDF5 study measured block reads 5-10x faster
  than random rows (HDF5's per-call cost, not the disk, limits row-level reads). The
  price is randomness: ids in the same block always share a batch, in every epoch. The
  writer shuffles rows once when it writes the shards (``mpidl shard`` does by default),
  so blocks are random groups; keep ``block_size`` well under the batch (a global batch
  of 256 with the default 64 is 4 random blocks). The default is the lower end of the
  64-1024 the project's HDF5 study recommends: each block is one copy with a fixed
  Python cost, and at 64 a 128-sample batch per rank takes two of them
  (benchmarks/README.md "Data": 1.0x a raw sequential read at 64, 0.95x at 32).
  The blocks are permuted within *windows* of ``window`` samples (default 16384): a
  window takes 16 chunks of ``window / 16`` consecutive samples at random from the whole
  split and orders their blocks at random
  (:class:`~mpidl.data.permutation.WindowedPermutation`). So a few steps read a few
  contiguous regions, which the loader fetches from disk whole and in file order; past
  the page cache that is the difference between random 200 KB reads and the disk's
  sequential speed (benchmarks/README.md "Out of cache"). A split of at most ``window``
  samples is one window: its order is a plain permutation of all blocks (as before
  windows existed); ``window=0`` gives that order at any size.
- ``"full"``: a permutation of all ids: most random, one read per sample.
- ``"none"``: ids in order (evaluation).
"""

from __future__ import annotations

from typing import Iterator

import numpy

from mpidl.data.permutation import (  # noqa: F401 - FeistelPermutation, splitmix64: API
    FeistelPermutation,
    WindowedPermutation,
    splitmix64,
)

DEFAULT_BLOCK_SIZE = 64
SHUFFLE_MODES = ("block", "full", "none")

_M64 = (1 << 64) - 1
# Samples per window of the block order (see the module docstring): 256 blocks of 64,
# drawn from 16 random chunks of 1024 consecutive samples (3.2 MB of MNIST-like rows).
DEFAULT_WINDOW = 1 << 14
_CHUNKS_PER_WINDOW = 16


class DistributedSampler:
    """Which global sample ids this rank reads, step by step (see the module docstring).

    Iterating yields, for each step of the current epoch, an int64 NumPy array of this
    rank's sample ids (possibly empty in the last step).

    Args:
        num_samples: ``N``, the number of samples in the dataset.
        global_batch: samples per step over all ranks.
        rank, size: this rank and the number of ranks (of the data-parallel group).
        seed: the run's shuffle seed; the ordering is a function of ``(seed, epoch)``.
        shuffle: ``"block"`` (default), ``"full"`` or ``"none"``.
        block_size: ids per block in ``"block"`` mode.
        drop_last: leave out the final smaller batch (fewer than ``global_batch`` samples,
            different ones every epoch); off by default, and never for evaluation.
        window: samples per window of the block order (block mode; see the module
            docstring); 0 permutes all blocks at once.

    Example::

        sampler = DistributedSampler(len(ds), 256, comm.rank, comm.size, seed=1)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for ids in sampler: ...
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        rank: int,
        size: int,
        seed: int = 0,
        *,
        shuffle: str = "block",
        block_size: int = DEFAULT_BLOCK_SIZE,
        drop_last: bool = False,
        window: int = DEFAULT_WINDOW,
    ):
        if int(num_samples) != num_samples or num_samples < 0:
            raise ValueError(f"num_samples {num_samples!r} must be an integer >= 0")
        if int(global_batch) != global_batch or global_batch < 1:
            raise ValueError(f"global_batch {global_batch!r} must be an integer >= 1")
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of size {size}: need size >= 1 and 0 <= rank < size")
        if shuffle not in SHUFFLE_MODES:
            raise ValueError(f"shuffle {shuffle!r} is not one of {SHUFFLE_MODES}")
        if int(block_size) != block_size or block_size < 1:
            raise ValueError(f"block_size {block_size!r} must be an integer >= 1")
        if int(window) != window or window < 0:
            raise ValueError(f"window {window!r} must be an integer >= 0 (0: no windows)")
        self.num_samples, self.global_batch = int(num_samples), int(global_batch)
        self.rank, self.size, self.seed = int(rank), int(size), int(seed)
        self.shuffle, self.block_size, self.drop_last = shuffle, int(block_size), bool(drop_last)
        self.window = int(window)
        n, g = self.num_samples, self.global_batch
        self._steps = n // g if drop_last else -(-n // g)
        self.epoch, self.start_step = 0, 0
        self._set_order()

    # -- epoch and position -------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first step (call before each epoch)."""
        self.resume(epoch, 0)

    def resume(self, epoch: int, step: int) -> None:
        """Make the next iteration yield steps ``step .. len(self) - 1`` of ``epoch``."""
        if not 0 <= step <= self._steps:
            raise ValueError(
                f"step {step} is outside epoch of {self._steps} steps (0..{self._steps})"
            )
        if epoch < 0:
            raise ValueError(f"epoch {epoch} must be >= 0")
        if epoch != self.epoch or not hasattr(self, "_perm"):
            self.epoch = int(epoch)
            self._set_order()
        self.start_step = int(step)

    def _set_order(self) -> None:
        key = splitmix64(splitmix64(self.seed & _M64) ^ (self.epoch & _M64))
        n, b = self.num_samples, self.block_size
        self._perm = None
        if n == 0 or self.shuffle == "none":
            return
        if self.shuffle == "full":
            self._perm = FeistelPermutation(n, key)
            return
        nb = -(-n // b)
        blocks = self.window // b  # blocks per window
        if blocks < _CHUNKS_PER_WINDOW:  # windows off, or too small to hold chunks
            self._perm = FeistelPermutation(nb, key)
        else:
            self._perm = WindowedPermutation(nb, key, blocks, blocks // _CHUNKS_PER_WINDOW)
        self._last = n - (nb - 1) * b  # size of the (only) partial block, nb - 1
        self._last_slot = int(self._perm.inverse(numpy.array([nb - 1]))[0])

    def __len__(self) -> int:
        """Steps per epoch: the same on every rank."""
        return self._steps

    # -- one step -----------------------------------------------------------------------
    def global_range(self, step: int) -> tuple[int, int]:
        """Positions ``[a, b)`` of global batch ``step`` in the epoch's ordering."""
        if not 0 <= step < self._steps:
            raise IndexError(f"step {step} out of range for an epoch of {self._steps} steps")
        a = step * self.global_batch
        return a, min(a + self.global_batch, self.num_samples)

    def global_count(self, step: int) -> int:
        """The number of samples in global batch ``step`` over all ranks."""
        a, b = self.global_range(step)
        return b - a

    def rank_range(self, step: int) -> tuple[int, int]:
        """This rank's positions: its contiguous, as-even-as-possible slice of the batch."""
        a, b = self.global_range(step)
        base, extra = divmod(b - a, self.size)
        lo = a + self.rank * base + min(self.rank, extra)
        return lo, lo + base + (self.rank < extra)

    def runs(self, step: int) -> numpy.ndarray:
        """This rank's ids of ``step`` as runs of consecutive ids, in batch order.

        Returns:
            An int64 array of shape ``(k, 2)``: rows ``[start, stop)``. Concatenating
            ``arange(start, stop)`` over the rows gives :meth:`indices`.
        """
        a, b = self.rank_range(step)
        if a == b:
            return numpy.zeros((0, 2), dtype=numpy.int64)
        if self._perm is None:
            return numpy.array([[a, b]], dtype=numpy.int64)
        if self.shuffle == "full":
            ids = self._perm.take(a, b)
            return coalesce_runs(ids, ids + 1)
        bs, last, kl = self.block_size, self._last, self._last_slot
        # Slots (positions of blocks in the ordering) before the partial block hold bs
        # positions each; the partial block holds `last`; later slots are shifted back.
        shift = bs - last

        def slot_of(p: int) -> int:
            return p // bs if p < kl * bs + last else (p + shift) // bs

        s0, s1 = slot_of(a), slot_of(b - 1)
        # A few slots per step: plain Python ints are faster here than NumPy calls.
        out: list[list[int]] = []
        for k, block in zip(range(s0, s1 + 1), self._perm.take(s0, s1 + 1).tolist()):
            start = k * bs - (shift if k > kl else 0)
            lo, hi = max(start, a), min(start + (last if k == kl else bs), b)
            first = block * bs + (lo - start)
            if out and out[-1][1] == first:
                out[-1][1] = first + hi - lo
            else:
                out.append([first, first + hi - lo])
        return numpy.array(out, dtype=numpy.int64)

    def runs_between(self, first: int, stop: int) -> list[list[list[int]]]:
        """:meth:`runs` of steps ``first .. stop - 1`` as lists of ``[start, stop]`` pairs.

        The same runs, computed for many steps in a few NumPy passes (block mode): the
        loader plans a window of steps at once, because per step the Python of
        :meth:`runs` costs as much as copying a 400 KB batch from the page cache.
        """
        if self.shuffle != "block" or self._perm is None or stop <= first:
            return [self.runs(s).tolist() for s in range(first, stop)]
        for s in (first, stop - 1):
            self.global_range(s)  # the IndexError of an out-of-range step
        g, bs, last, kl = self.global_batch, self.block_size, self._last, self._last_slot
        shift = bs - last
        a = numpy.arange(first, stop, dtype=numpy.int64) * g
        base, extra = numpy.divmod(numpy.minimum(a + g, self.num_samples) - a, self.size)
        lo = a + self.rank * base + numpy.minimum(self.rank, extra)
        hi = lo + base + (self.rank < extra)

        def slot_of(p: numpy.ndarray) -> numpy.ndarray:
            return numpy.where(p < kl * bs + last, p // bs, (p + shift) // bs)

        s_lo = slot_of(lo)
        count = numpy.where(hi > lo, slot_of(hi - 1) - s_lo + 1, 0)
        step_of = numpy.repeat(numpy.arange(count.size), count)
        heads = numpy.cumsum(count) - count
        slot = numpy.repeat(s_lo - heads, count) + numpy.arange(step_of.size)
        if slot.size == 0:
            return [[] for _ in range(first, stop)]
        s_min, s_max = int(slot[0]), int(slot[-1])  # slots increase with the step
        if s_max - s_min < 4 * slot.size:  # few ranks: the cached chunks cover the range
            block = self._perm.take(s_min, s_max + 1)[slot - s_min]
        else:  # many ranks: the range is mostly theirs; evaluate this rank's slots only
            block = self._perm(slot)
        start = slot * bs - numpy.where(slot > kl, shift, 0)
        run_lo = numpy.maximum(start, lo[step_of])
        run_hi = numpy.minimum(start + numpy.where(slot == kl, last, bs), hi[step_of])
        begin = block * bs + (run_lo - start)
        end = begin + (run_hi - run_lo)
        # Merge a run into the previous one of the same step when it continues it.
        new = numpy.ones(begin.size, dtype=bool)
        new[1:] = (begin[1:] != end[:-1]) | (step_of[1:] != step_of[:-1])
        keep = numpy.flatnonzero(new)
        tails = numpy.append(keep[1:], begin.size) - 1
        pairs = numpy.stack([begin[keep], end[tails]], axis=1).tolist()
        bounds = numpy.searchsorted(step_of[keep], numpy.arange(count.size + 1)).tolist()
        return [pairs[bounds[i] : bounds[i + 1]] for i in range(count.size)]

    def indices(self, step: int) -> numpy.ndarray:
        """This rank's sample ids of ``step`` (int64, in batch order; may be empty)."""
        r = self.runs(step)
        if len(r) == 1:
            return numpy.arange(r[0, 0], r[0, 1], dtype=numpy.int64)
        return numpy.concatenate(
            [numpy.arange(s, e, dtype=numpy.int64) for s, e in r]
            or [numpy.zeros(0, dtype=numpy.int64)]
        )

    def __iter__(self) -> Iterator[numpy.ndarray]:
        for step in range(self.start_step, self._steps):
            yield self.indices(step)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "step", "seed"}``: where the next iteration starts."""
        return {"epoch": self.epoch, "step": self.start_step, "seed": self.seed}

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(num_samples={self.num_samples}, global_batch={self.global_batch}, "
            f"rank={self.rank}, size={self.size}, seed={self.seed}, shuffle={self.shuffle!r}, "
            f"block_size={self.block_size}, drop_last={self.drop_last}, window={self.window})"
        )


def coalesce_runs(starts: numpy.ndarray, stops: numpy.ndarray) -> numpy.ndarray:
    """Runs ``[start, stop)`` as a ``(k, 2)`` int64 array, merging a run into the previous one
    when it starts exactly where that one stops (``coalesce_runs(ids, ids + 1)`` turns ids
    into runs, keeping their order)."""
    if starts.size <= 1:
        return numpy.stack([starts, stops], axis=1).astype(numpy.int64)
    new = numpy.ones(starts.size, dtype=bool)
    new[1:] = starts[1:] != stops[:-1]
    heads = numpy.flatnonzero(new)
    tails = numpy.append(heads[1:], starts.size) - 1
    return numpy.stack([starts[heads], stops[tails]], axis=1).astype(numpy.int64)
