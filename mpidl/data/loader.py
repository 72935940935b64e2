"""``DataLoader``: this rank's batches, read in runs by a background thread.

The training loop (data parallel: sum the loss, let the engine divide by the global
count so a ragged last step equals single-process training)::

    ds = ShardedDataset("data/reviews/train", comm=comm)
    sampler = DistributedSampler(len(ds), global_batch=256, rank=comm.rank, size=comm.size, seed=1)
    loader = DataLoader(ds, sampler, features=("x", "y"), xp=xp)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y, n in loader:          # a Batch(x, y, global_count)
            loss = softmax_cross_entropy(dp(x), y, reduction="sum")
            dp.backward(loss, global_count=n)

Each item is a ``Batch`` named tuple: one array per feature (this rank's rows, possibly
zero rows in the last step) followed by ``global_count``, the number of samples in the
step's global batch over all ranks. Arrays are ``xp`` arrays (NumPy, or CuPy: the
host-to-device copy happens in the consuming thread).

Why a thread and not worker processes: h5py handles must not cross a ``fork``, forking
after ``MPI_Init`` is unsafe on several interconnects, and one reader suffices because
the copies out of a shard's memory map (and ``H5Dread``) release the GIL, so reading
overlaps the step. The
thread reads up to ``prefetch`` batches ahead and then naps (half the loop's
step time) rather than being woken by the loop: with every core busy (one rank per
core), a wake-up from the loop was measured to cost the loop a scheduler time slice,
about 5 ms per step. An exception in the thread is re-raised in the loop (never
swallowed), and leaving the loop early stops the thread.

The thread starts only when it pays. Each epoch reads its first batches in the loop
and compares the loop's own work between batches with the read time; the thread takes
over when the loop works at least as long as it reads (training: a step of
milliseconds against a read of ~0.1 ms). A loop that does next to nothing with its
batches (a pass over the data, a benchmark, a tiny model) keeps reading itself: there
is nothing to overlap, and the hand-offs would cost more than the reads (warm 400 KB
batches: 3.0 GB/s through the thread, 6.4 GB/s in the loop, on 2 vCPUs).
``prefetching`` says which way the current epoch went. The runs of the sampler are
planned for a window of steps at once (:meth:`DistributedSampler.runs_between`).

``wait_s`` (time the loop waited for input: for the thread, or for its own reads) and
``read_s`` (time spent reading) tell whether input stalls a run; ``prefetch=0`` always
reads in the loop.

Errors: opening and checking the shards is collective when ``ShardedDataset`` gets a
``comm`` (every rank raises the same ``DataError`` or none), and so is the range check
of labels and token ids small enough to cache (typically the labels). A read that fails
later (a bad token id in a large feature, a shard changed under the job), in one rank's
thread, raises on that rank only: run under ``mpidl run``/``mpidl train``, whose
exception hook aborts every rank instead of leaving the others in a collective.

Checkpoints: ``state_dict()`` is ``{"epoch", "step", "seed", "block_size"}``, the next
step to produce; ``load_state_dict`` (or ``resume(epoch, step)``) continues there, with
any number of ranks.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from types import ModuleType
from typing import Any, Iterator, Sequence

import numpy

from mpidl.data.hdf5 import ShardedDataset
from mpidl.data.sampler import DistributedSampler, coalesce_runs

_NAP_MIN_S, _NAP_MAX_S = 1e-4, 0.05  # bounds of the reader's nap while the queue is full
# Batches an epoch reads in the loop before deciding whether the thread pays. It pays
# when the loop has work to overlap with the reads; when the loop does next to nothing
# between batches, the hand-offs (thread wake-ups, the GIL passing back and forth around
# every read) cost more than they hide: measured on 2 vCPUs with warm 400 KB batches,
# 3.0 GB/s through the thread against 6.4 GB/s read in the loop.
_PROBE_STEPS = 16
# Steps whose runs are planned together: up to _PLAN_STEPS, and about _PLAN_RUNS runs
# (Python lists of ~130 bytes a run) whatever the batch and block sizes.
_PLAN_STEPS, _PLAN_RUNS = 256, 1 << 14
# Read-ahead past the page cache (``readahead``), by default only for a split larger
# than half the machine's memory. The kernel is kept fetching the runs of the next one
# to two groups of steps, each group's runs merged and sorted into file order
# (``posix_fadvise``/``madvise`` WILLNEED). A group covers at least one of the sampler's
# windows (with windows, 16 random chunks of consecutive samples: the advice is then a
# few long sequential reads) and at most _READAHEAD_BYTES of this rank's batches.
# Measured on a 51.9 GB split (2.1x this machine's 24 GiB; 1 rank, block shuffle, 2 GB
# of cold batches each): copied out of the map without advice, 0.037 GB/s, the disk
# reading 22.8x the bytes used (each page fault of a random 200 KB run reads a large
# window around it, evicted before use); each step's runs advised 16 steps ahead, 0.50
# GB/s and no extra bytes; `dd` 0.68. The mlp's input stall: 5.8% of the step without
# advice, 0.22% with. With windows and advice by groups (cold, quiet): 0.97-1.22x
# `dd` at 1 and 2 ranks, stall 0.14-0.17% (benchmarks/README.md "Out of cache with
# windows"). On data in the page cache the advice costs (the kernel walks the cached
# pages): loader/raw 0.46-0.70 with it, 0.78-1.0 without (3 runs each, load 6), hence
# only for data that cannot stay cached.
_READAHEAD_MIN_STEPS = 16
_READAHEAD_BYTES = 128 << 20


def merge_in_file_order(runs: list[list[int]]) -> list[list[int]]:
    """``[start, stop)`` runs sorted by start, touching ones merged (one read each)."""
    if not runs:
        return []
    a = numpy.asarray(runs, dtype=numpy.int64)
    a = a[numpy.argsort(a[:, 0], kind="stable")]
    return coalesce_runs(a[:, 0], a[:, 1]).tolist()


def _default_readahead(dataset: ShardedDataset, sampler: DistributedSampler,
                       features: Sequence[str]) -> int:
    """Steps per read-ahead group: one of the sampler's windows (at least
    _READAHEAD_MIN_STEPS), at most _READAHEAD_BYTES of this rank's batches."""
    row = sum(dataset.features[f].row_bytes for f in features)
    share = max(1, -(-sampler.global_batch // sampler.size))
    cover = -(-max(sampler.window, 1) // sampler.global_batch)
    return max(1, min(max(_READAHEAD_MIN_STEPS, cover), _READAHEAD_BYTES // max(1, row * share)))


def _larger_than_memory(dataset: ShardedDataset) -> bool:
    """Whether the split's shards exceed half the machine's memory: the page cache cannot
    keep them, so every epoch reads them from the disk."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return sum(s.bytes for s in dataset.manifest.shards) > memory // 2


class DataLoader:
    """Batches of ``features`` for the steps of ``sampler``, prefetched in a thread.

    Args:
        dataset: the split to read.
        sampler: decides this rank's samples per step (its ``num_samples`` must equal
            ``len(dataset)``).
        features: the features to read, in the order they appear in each ``Batch``.
        xp: the array module of the yielded arrays (default NumPy).
        prefetch: batches read ahead by the background thread, once the loop has shown
            work to overlap with (see above); 0 always reads in the loop itself.
        readahead: steps per group of read-ahead advice: the kernel is asked to fetch
            the samples of the next one to two groups of steps into the page cache
            (``WILLNEED``, one call per merged run, in file order) while earlier batches
            are read; 0 never. Default (None), for a split larger than half the
            machine's memory: enough steps to cover one of the sampler's windows (at
            least 16), at most 128 MiB of this rank's batches; else 0 (on cached data
            the advice costs a third of the read speed).

    Attributes:
        wait_s: seconds the loop spent waiting for input, for the thread or for its own
            reads (cumulative): the input stall that prefetching should keep near zero.
        read_s: seconds the reader spent reading (cumulative).
        prefetching: whether the thread reads the current (or last) epoch.
    """

    def __init__(
        self,
        dataset: ShardedDataset,
        sampler: DistributedSampler,
        features: Sequence[str] = ("x", "y"),
        xp: ModuleType | None = None,
        prefetch: int = 2,
        readahead: int | None = None,
    ):
        if sampler.num_samples != len(dataset):
            raise ValueError(
                f"sampler covers {sampler.num_samples} samples but {dataset.path} has "
                f"{len(dataset)}: build the sampler with num_samples=len(dataset)"
            )
        features = tuple(features)
        missing = [f for f in features if f not in dataset.features]
        if missing or not features:
            raise ValueError(
                f"features {missing or '()'} not in {dataset.path}; it has {list(dataset.features)}"
            )
        if prefetch < 0:
            raise ValueError(f"prefetch {prefetch} must be >= 0")
        self.dataset, self.sampler, self.features = dataset, sampler, features
        self.xp = numpy if xp is None else xp
        self.prefetch = int(prefetch)
        if readahead is None:
            readahead = _default_readahead(dataset, sampler, features) \
                if _larger_than_memory(dataset) else 0
        if readahead < 0:
            raise ValueError(f"readahead {readahead} must be >= 0")
        self.readahead = int(readahead)
        # One named tuple type per loader: fields are the features, then global_count.
        self.Batch = collections.namedtuple("Batch", [*features, "global_count"])  # type: ignore
        self._step = sampler.start_step
        self._resumed = False
        self.wait_s = 0.0
        self.read_s = 0.0
        self._nap_s = 1e-3  # the reader's nap while ahead; set from the loop's step time
        self.prefetching = False  # whether the thread reads this (or the last) epoch
        if sampler.shuffle == "block":  # runs_between is vectorised for block mode only
            per_step = sampler.global_batch // (sampler.size * sampler.block_size) + 2
            self._window = max(1, min(_PLAN_STEPS, _PLAN_RUNS // per_step))
        else:
            self._window = 1
        self._plan: tuple[int, int, list[list[list[int]]]] = (-1, 0, [])
        self._advised = (-1, 0)  # (epoch, the first step not advised yet)

    def __len__(self) -> int:
        """Steps per epoch (the same on every rank)."""
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    # -- position -----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first step, unless ``resume`` just set a later step of it.

        So a resumed run can keep the usual loop: ``loader.resume(3, 17)`` then
        ``for epoch in range(3, E): loader.set_epoch(epoch); for b in loader: ...``
        continues epoch 3 at step 17.
        """
        if self._resumed and epoch == self.sampler.epoch:
            return
        self.resume(epoch, 0)
        self._resumed = False

    def resume(self, epoch: int, step: int) -> None:
        """Make the next iteration produce steps ``step ..`` of ``epoch``."""
        self.sampler.resume(epoch, step)
        self._step = step
        self._resumed = True

    # What decides the order of an epoch's samples: a checkpoint's must be this run's.
    _ORDER_KEYS = ("seed", "block_size", "num_samples", "global_batch", "shuffle", "drop_last")

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "step"}`` of the next step to produce (after the last step of an
        epoch: step 0 of the next epoch), and the sampler settings that fix the order
        (seed, block size, sample count, global batch, shuffle, drop_last)."""
        epoch, step = self.sampler.epoch, self._step
        if step >= len(self):
            epoch, step = epoch + 1, 0
        return {"epoch": epoch, "step": step,
                **{key: getattr(self.sampler, key) for key in self._ORDER_KEYS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``; the settings that fix the order must be the
        sampler's (any of them changes the order or the steps, so the rest of the epoch
        would repeat some samples and skip others). Settings a state lacks (older
        checkpoints) are not checked."""
        for key in self._ORDER_KEYS:
            mine = getattr(self.sampler, key)
            if key in state and type(mine)(state[key]) != mine:
                raise ValueError(
                    f"the checkpoint was written with {key}={state[key]!r}, this run has "
                    f"{key}={mine!r}: the rest of the epoch would skip some samples and "
                    f"repeat others. Resume with {key}={state[key]!r}, or start a new run")
        self.resume(int(state["epoch"]), int(state["step"]))

    # -- reading ------------------------------------------------------------------------
    def _runs(self, step: int) -> list[list[int]]:
        """``sampler.runs(step)``, planned for a window of steps at a time."""
        epoch, first, plan = self._plan
        if epoch != self.sampler.epoch or not first <= step < first + len(plan):
            epoch, first = self.sampler.epoch, step  # the epoch planned, read before planning
            plan = self.sampler.runs_between(step, min(step + self._window, len(self.sampler)))
            self._plan = (epoch, first, plan)
        return plan[step - first]

    def _advise(self, step: int) -> None:
        """Keep the runs of the next one to two groups of ``readahead`` steps advised:
        a group at a time, its runs merged and sorted into file order."""
        group, end = self.readahead, len(self.sampler)
        epoch, upto = self._advised
        if epoch != self.sampler.epoch or not step <= upto <= step + 2 * group:
            epoch, upto = self.sampler.epoch, step  # a new epoch, or a jump (resume)
        while upto < end and upto <= step + group:
            stop = min(upto + group, end)
            runs = [r for rs in self.sampler.runs_between(upto, stop) for r in rs]
            self.dataset.will_read(self.features, merge_in_file_order(runs))
            upto = stop
        self._advised = (epoch, upto)

    def _read(self, step: int) -> tuple[list[numpy.ndarray], int]:
        t0 = time.perf_counter()
        runs = self._runs(step)
        if self.readahead:
            self._advise(step)
        arrays = self.dataset.read_batch(self.features, runs)
        self.read_s += time.perf_counter() - t0
        return arrays, self.sampler.global_count(step)

    def _produce(self, steps: range, out: queue.SimpleQueue, stop: threading.Event) -> None:
        try:
            for step in steps:
                # Read ahead at most `prefetch` batches. The reader naps instead of being
                # woken by the loop: a wake-up from the loop was measured to cost the loop a
                # scheduler time slice (~5 ms) per step when every core is busy.
                while out.qsize() >= self.prefetch:
                    if stop.is_set():
                        return
                    time.sleep(self._nap_s)
                if stop.is_set():
                    return
                out.put((step, *self._read(step)))
        except BaseException as e:  # handed to the loop, which re-raises it
            out.put((None, e, 0))
            return
        out.put((None, None, 0))  # end of epoch

    def __iter__(self) -> Iterator[Any]:
        self._resumed = False
        epoch, end = self.sampler.epoch, len(self.sampler)
        self.prefetching = False
        # Read in the loop first. After the first batch (whose read also opens shards),
        # _PROBE_STEPS batches compare the loop's own work between batches with the read
        # time; the thread takes over when there is at least as much work as reading.
        first, busy, read0 = self._step, 0.0, 0.0
        for step in range(first, end):
            if step == first + 1:
                busy, read0 = 0.0, self.read_s
            if step == first + 1 + _PROBE_STEPS and self.prefetch and busy >= self.read_s - read0:
                self.prefetching = True
                yield from self._prefetched(epoch, range(step, end))
                return
            t0 = time.perf_counter()
            arrays, count = self._read(step)
            t1 = time.perf_counter()
            self.wait_s += t1 - t0
            yield self._emit(epoch, step, arrays, count)
            busy += time.perf_counter() - t1

    def _prefetched(self, epoch: int, steps: range) -> Iterator[Any]:
        out: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()
        name = f"mpidl-loader-epoch{epoch}"
        thread = threading.Thread(
            target=self._produce, args=(steps, out, stop), daemon=True, name=name
        )
        thread.start()
        last = time.perf_counter()
        try:
            while True:
                t0 = time.perf_counter()
                step, arrays, count = out.get()
                t1 = time.perf_counter()
                self.wait_s += t1 - t0
                # The reader naps half a step: it refills well before the queue runs dry,
                # with one or two wake-ups per step.
                self._nap_s = min(max(0.5 * (t1 - last), _NAP_MIN_S), _NAP_MAX_S)
                last = t1
                if step is None:
                    if arrays is not None:
                        raise arrays
                    return
                yield self._emit(epoch, step, arrays, count)
        finally:
            stop.set()
            thread.join()

    def _emit(self, epoch: int, step: int, arrays: list[numpy.ndarray], count: int) -> Any:
        if self.sampler.epoch != epoch:
            raise RuntimeError(
                f"set_epoch({self.sampler.epoch}) was called during epoch {epoch}'s "
                "iteration; call it before iterating"
            )
        self._step = step + 1
        if self.xp is not numpy:
            arrays = [self.xp.asarray(a) for a in arrays]
        return self.Batch(*arrays, count)
