"""The loader: rows match the sampler's ids, prefetch errors surface, resume, exact counts."""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy
import pytest

from mpidl.backend import as_numpy
from mpidl.data import loader as loader_module
from mpidl.data import (
    DataError,
    DataLoader,
    DistributedSampler,
    ExactAccuracy,
    ShardedDataset,
    evaluate_counts,
    write_split,
)

N = 157


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    """x[i] = (i, 2i) so every row names its sample; uneven shards of 50, 50, 50, 7."""
    d = tmp_path_factory.mktemp("loader") / "train"
    ids = numpy.arange(N)
    write_split(
        str(d),
        {
            "x": numpy.stack([ids, 2 * ids], axis=1).astype(numpy.float32),
            "y": (ids % 4).astype(numpy.int64),
        },
        rows_per_shard=50,
        labels="y",
        num_classes=4,
    )
    return str(d)


@pytest.mark.parametrize("mode", ["block", "full", "none"])
@pytest.mark.parametrize("prefetch,cache_bytes", [(0, 0), (2, 0), (2, 1 << 20)])
def test_batches_hold_exactly_the_sampler_ids_and_cover_the_dataset(
    dataset_dir, mode, prefetch, cache_bytes, monkeypatch
):
    monkeypatch.setattr(loader_module, "_PROBE_STEPS", 0)  # with prefetch, the thread reads
    seen = []
    for rank in range(3):
        ds = ShardedDataset(dataset_dir, cache_bytes=cache_bytes)  # 0: every feature read from disk
        sampler = DistributedSampler(len(ds), 20, rank, 3, seed=5, shuffle=mode, block_size=7)
        loader = DataLoader(ds, sampler, prefetch=prefetch)
        loader.set_epoch(2)
        batches = list(loader)
        assert len(batches) == len(loader) == 8 and loader.prefetching == (prefetch > 0)
        for step, b in enumerate(batches):
            ids = sampler.indices(step)
            numpy.testing.assert_array_equal(b.x[:, 0], ids)
            numpy.testing.assert_array_equal(b.y, ids % 4)
            assert b.global_count == (20 if step < 7 else N - 7 * 20)
            seen.extend(b.x[:, 0].astype(int).tolist())
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_rank_with_no_samples_in_the_last_step_gets_empty_arrays(dataset_dir, prefetch):
    ds = ShardedDataset(dataset_dir)  # y small enough to be cached in memory, x read
    sampler = DistributedSampler(N, N - 1, 2, 3, seed=1)  # last global batch: 1 sample
    batches = list(DataLoader(ds, sampler, features=("x", "y"), prefetch=prefetch))
    x, y, count = batches[-1]
    assert count == 1 and x.shape == (0, 2) and y.shape == (0,)
    assert x.dtype == numpy.float32 and y.dtype == numpy.int64
    assert [a.shape for a in ds.read_batch(("y", "x"), [])] == [(0,), (0, 2)]


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_batches_spanning_more_shards_than_may_stay_open_read_the_right_rows(
    tmp_path, cache_bytes
):
    """Full shuffle over 12 shards with at most 2 open: every batch touches more shards
    than may stay open at once (and cached labels open every shard first)."""
    d = str(tmp_path / "train")
    ids = numpy.arange(60)
    write_split(d, {"x": numpy.stack([ids, -ids], 1).astype(numpy.float32), "y": ids % 3},
                rows_per_shard=5)
    ds = ShardedDataset(d, max_open=2, cache_bytes=cache_bytes)
    sampler = DistributedSampler(60, 20, 0, 1, seed=3, shuffle="full")
    for y, x, _ in DataLoader(ds, sampler, features=("y", "x"), prefetch=0):
        numpy.testing.assert_array_equal(-x[:, 1], x[:, 0])
        numpy.testing.assert_array_equal(y, x[:, 0].astype(int) % 3)
    rows = ds.read_batch(("y", "x"), [[10, 12], [55, 57], [0, 2], [31, 33]])[1][:, 0]
    numpy.testing.assert_array_equal(rows, [10, 11, 55, 56, 0, 1, 31, 32])


def test_yields_arrays_of_the_requested_module(dataset_dir, xp):
    ds = ShardedDataset(dataset_dir)
    loader = DataLoader(ds, DistributedSampler(len(ds), 64, 0, 1), features=("y", "x"), xp=xp)
    y, x, n = next(iter(loader))
    assert type(x) is type(xp.zeros(1)) and x.shape == (64, 2) and x.dtype == numpy.float32
    numpy.testing.assert_array_equal(as_numpy(y), as_numpy(x)[:, 0].astype(int) % 4)


@pytest.fixture
def thread_from_step_1(monkeypatch):
    """The thread takes over after the first batch, whatever the loop does."""
    monkeypatch.setattr(loader_module, "_PROBE_STEPS", 0)


def test_breaking_out_early_stops_the_reader_thread(dataset_dir, thread_from_step_1):
    ds = ShardedDataset(dataset_dir)
    loader = DataLoader(ds, DistributedSampler(len(ds), 4, 0, 1), prefetch=1)
    before = threading.active_count()
    for i, _ in enumerate(loader):
        if i == 2:
            assert loader.prefetching and threading.active_count() == before + 1
            break
    assert threading.active_count() == before
    assert loader.state_dict()["step"] == 3


def batches_of(loader, work_s=0.0, stop_after=None):
    """(step ids, labels) of each batch, the loop spending ``work_s`` on each."""
    got = []
    for b in loader:
        got.append((b.x[:, 0].astype(int).tolist(), b.y.tolist(), b.global_count))
        if work_s:
            time.sleep(work_s)
        if stop_after is not None and len(got) == stop_after:
            break
    return got


def test_a_loop_with_no_work_reads_without_the_thread(dataset_dir):
    """The loop does nothing between batches: no thread is started, the loop reads; the
    batches are exactly those read with ``prefetch=0``."""
    ds = ShardedDataset(dataset_dir, cache_bytes=0)
    sampler = DistributedSampler(len(ds), 3, 1, 2, seed=4)  # 53 steps: past the probe
    before = threading.active_count()
    loader = DataLoader(ds, sampler, prefetch=2)
    loader.set_epoch(1)
    got = batches_of(loader)
    assert not loader.prefetching and threading.active_count() == before
    reference = DataLoader(ds, DistributedSampler(len(ds), 3, 1, 2, seed=4), prefetch=0)
    reference.set_epoch(1)
    assert got == batches_of(reference)
    assert len(got) == len(loader) == 53
    # Leaving early after the switch, then resuming, continues exactly.
    loader.set_epoch(1)
    head = batches_of(loader, stop_after=40)
    state = {"epoch": 1, "step": 40, "seed": 4, "block_size": 64}
    assert not loader.prefetching and state.items() <= loader.state_dict().items()
    assert head + batches_of(loader) == got


def test_a_busy_loop_keeps_the_reader_thread(dataset_dir):
    ds = ShardedDataset(dataset_dir)
    loader = DataLoader(ds, DistributedSampler(len(ds), 8, 0, 1, seed=2), prefetch=2)
    busy = batches_of(loader, work_s=0.01)  # 20 steps of 10 ms: far more than a read
    assert loader.prefetching
    reference = DataLoader(ds, DistributedSampler(len(ds), 8, 0, 1, seed=2), prefetch=0)
    assert busy == batches_of(reference)


def test_a_read_error_in_the_thread_is_raised_in_the_loop(tmp_path, thread_from_step_1):
    d = str(tmp_path / "train")
    write_split(d, {"x": numpy.zeros((30, 2), numpy.float32)}, rows_per_shard=10)
    ds = ShardedDataset(d, cache_bytes=0)  # checked and closed; shards reopen lazily in the thread
    os.remove(os.path.join(d, "shard-00002.h5"))
    loader = DataLoader(ds, DistributedSampler(30, 10, 0, 1, shuffle="none"), features=("x",))
    got = []
    with pytest.raises(DataError, match="shard-00002.h5: shard file is missing"):
        for x, n in loader:
            got.append(x)
    assert len(got) == 2 and loader.prefetching


def test_resume_and_state_dict_continue_exactly(dataset_dir):
    ds = ShardedDataset(dataset_dir)

    def run(loader, epochs):
        out = []
        for epoch in epochs:
            loader.set_epoch(epoch)
            out += [b.x[:, 0].copy() for b in loader]
        return out

    full = run(DataLoader(ds, DistributedSampler(N, 16, 0, 1, seed=3)), [0, 1])
    first = DataLoader(ds, DistributedSampler(N, 16, 0, 1, seed=3))
    first.set_epoch(0)
    it = iter(first)
    head = [next(it).x[:, 0].copy() for _ in range(4)]
    state = first.state_dict()
    it.close()
    assert state == {"epoch": 0, "step": 4, "seed": 3, "block_size": 64, "num_samples": N,
                     "global_batch": 16, "shuffle": "block", "drop_last": False}
    again = DataLoader(ds, DistributedSampler(N, 16, 0, 1, seed=3))
    again.load_state_dict(state)
    rest = run(again, [0, 1])  # set_epoch(0) keeps the resumed step
    assert len(head) + len(rest) == len(full)
    assert all(numpy.array_equal(a, b) for a, b in zip(full, head + rest))
    assert again.state_dict() == dict(state, epoch=2, step=0)
    with pytest.raises(ValueError, match="seed"):
        again.load_state_dict({"epoch": 0, "step": 0, "seed": 4})
    with pytest.raises(ValueError, match="block_size=32"):  # another order: not exact
        again.load_state_dict({"epoch": 0, "step": 1, "seed": 3, "block_size": 32})
    # Another global batch or shuffle also changes which samples the rest reads.
    for key, value in (("global_batch", 32), ("shuffle", "full"), ("num_samples", N + 1),
                       ("drop_last", True)):
        with pytest.raises(ValueError, match=f"written with {key}={value!r}, this run has"):
            again.load_state_dict(dict(state, **{key: value}))
    again.load_state_dict({"epoch": 0, "step": 1, "seed": 3})  # older states: no block_size
    assert again.state_dict()["step"] == 1


def test_loader_rejects_mismatched_sampler_and_unknown_features(dataset_dir):
    ds = ShardedDataset(dataset_dir)
    with pytest.raises(ValueError, match="num_samples=len"):
        DataLoader(ds, DistributedSampler(N + 1, 8, 0, 1))
    with pytest.raises(ValueError, match="'z'"):
        DataLoader(ds, DistributedSampler(N, 8, 0, 1), features=("x", "z"))


def test_dataset_pickles_without_open_handles(dataset_dir):
    ds = ShardedDataset(dataset_dir)
    ds.read("x", [3, 100])
    clone = pickle.loads(pickle.dumps(ds))
    numpy.testing.assert_array_equal(clone.read("x", [100, 3, 3])[:, 0], [100, 3, 3])


def test_exact_accuracy_counts(comm):
    acc = ExactAccuracy()
    acc.update(numpy.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), numpy.array([1, 1, 1]))
    acc.update(numpy.array([0, 1]), numpy.array([0, 0]))
    assert acc.counts() == (3, 5)
    assert evaluate_counts(None, 2, 9) == (2, 9)
    c, t = acc.counts(comm)
    assert (c, t) == (3 * comm.size, 5 * comm.size)
    assert acc.compute(comm) == pytest.approx(0.6)
    acc.reset()
    assert numpy.isnan(acc.compute())


def test_readahead_advises_every_row_it_reads_and_changes_no_batch(dataset_dir, monkeypatch):
    from mpidl.data import shard as shard_module

    advised = []
    real = shard_module._madvise

    def record(m, start, length):
        advised.append((id(m), start, length))
        return real(m, start, length)

    monkeypatch.setattr(shard_module, "_madvise", record)
    ds = ShardedDataset(dataset_dir, cache_bytes=0)
    batches = {}
    assert DataLoader(ds, DistributedSampler(len(ds), 12, 0, 1)).readahead == 0  # fits memory
    with monkeypatch.context() as m:  # a machine of 100 bytes: the split cannot stay cached
        m.setattr(os, "sysconf", lambda name: 1 if name == "SC_PAGE_SIZE" else 100)
        # groups cover one of the sampler's windows: 16384 samples in 12-sample steps
        assert DataLoader(ds, DistributedSampler(len(ds), 12, 0, 1)).readahead == 1366
        # and hold at most 128 MiB of this rank's batches (x and y: 16 bytes a sample)
        big = DistributedSampler(len(ds), 1 << 20, 0, 1, window=0)
        assert DataLoader(ds, big).readahead == 8
        assert DataLoader(ds, DistributedSampler(len(ds), 12, 0, 1, window=0)).readahead == 16
    for readahead in (0, 3):
        sampler = DistributedSampler(len(ds), 12, 0, 1, seed=2, shuffle="block", block_size=4)
        loader = DataLoader(ds, sampler, prefetch=0, readahead=readahead)
        loader.set_epoch(1)
        batches[readahead] = [b.x.copy() for b in loader]
        if readahead == 0:
            assert advised == []
    for a, b in zip(batches[0], batches[3]):
        numpy.testing.assert_array_equal(a, b)
    # the advised byte ranges of x, as sample ids: every sample of the epoch (a range
    # starts at its page's start; a row is advised if all of its bytes are)
    shards = {id(h._map): (i, h.offsets["x"]) for i, h in ds._open.items()}
    ids = set()
    for key, offset, length in advised:
        shard, start = shards[key]
        rows = ds.manifest.shards[shard].rows
        end = offset + length
        if end <= start or offset >= start + 8 * rows:
            continue  # y's bytes, which follow x's
        first = max(0, -(-(offset - start) // 8))
        last = min(rows, (end - start) // 8)
        ids.update(range(int(ds.offsets[shard]) + first, int(ds.offsets[shard]) + last))
    assert ids == set(range(N))
    ds.close()


def test_readahead_advises_each_step_once_a_group_at_a_time_in_file_order(dataset_dir):
    ds = ShardedDataset(dataset_dir, cache_bytes=0)
    sampler = DistributedSampler(len(ds), 6, 1, 2, seed=4, block_size=2)
    loader = DataLoader(ds, sampler, prefetch=0, readahead=3)
    calls, reads = [], []
    real_read = ds.read_batch
    ds.will_read = lambda features, runs: calls.append((len(reads), runs))
    ds.read_batch = lambda features, runs: reads.append(runs) or real_read(features, runs)
    loader.set_epoch(1)
    list(loader)
    advised = [i for _, runs in calls for a, b in runs for i in range(a, b)]
    assert sorted(advised) == sorted(i for s in range(len(sampler)) for i in sampler.indices(s))
    for _, runs in calls:  # file order, touching runs merged
        assert all(b0 < a1 for (_, b0), (a1, _) in zip(runs, runs[1:])), runs
    # two groups (steps 0-5) before the first read, then one per 3 steps, ahead of use
    assert [at for at, _ in calls] == list(range(0, len(sampler) - 3, 3))[:1] * 2 + \
        list(range(3, len(sampler) - 3, 3))


def test_every_shard_stays_open_by_default_within_the_descriptor_limit(tmp_path, monkeypatch):
    import resource

    write_split(str(tmp_path / "d"), {"x": numpy.zeros((150, 1), numpy.float32)},
                rows_per_shard=1)  # 150 shards: more than the old default of 128
    monkeypatch.setattr(resource, "getrlimit", lambda what: (20000, 20000))
    assert ShardedDataset(str(tmp_path / "d")).max_open == 150
    monkeypatch.setattr(resource, "getrlimit", lambda what: (200, 200))
    assert ShardedDataset(str(tmp_path / "d")).max_open == 128  # half of 200, or 128
    monkeypatch.setattr(resource, "getrlimit", lambda what: (260, 260))
    assert ShardedDataset(str(tmp_path / "d")).max_open == 130  # half of 260
    assert ShardedDataset(str(tmp_path / "d"), max_open=2).max_open == 2


def test_an_open_shard_holds_one_descriptor_and_reopens_without_hdf5(tmp_path, monkeypatch):
    import shutil

    import h5py

    def descriptors():
        return len(os.listdir("/proc/self/fd"))

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    ids = numpy.arange(40)
    write_split(str(tmp_path / "a"), {"x": numpy.stack([ids, -ids], 1).astype(numpy.float32)},
                rows_per_shard=10)
    ds = ShardedDataset(str(tmp_path / "a"), cache_bytes=0, verify="none")
    before = descriptors()
    ds.read("x", [0, 10, 20, 30])  # opens all 4 shards (through HDF5: none was checked)
    assert descriptors() - before == 4  # the map's own; HDF5's file and ours are closed
    ds.close()
    assert descriptors() == before

    opened = []
    real = h5py.File
    monkeypatch.setattr(h5py, "File", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    ds = ShardedDataset(str(tmp_path / "a"), cache_bytes=0, max_open=1, verify="none")
    for _ in range(3):  # every read reopens a shard: HDF5 only the first time per shard
        numpy.testing.assert_array_equal(ds.read("x", [5, 15, 25, 35, 6])[:, 0],
                                         [5, 15, 25, 35, 6])
    assert sorted(os.path.basename(p) for p in opened) == [f"shard-0000{i}.h5" for i in range(4)]
    # a shard replaced by another file is checked again, and found wrong
    write_split(str(tmp_path / "b"), {"x": numpy.zeros((40, 2), numpy.float32)}, rows_per_shard=10)
    shutil.copy(tmp_path / "b" / "shard-00001.h5", tmp_path / "a" / "shard-00001.h5")
    with pytest.raises(DataError, match="shard-00001.h5: belongs to dataset"):
        ds.read("x", [15])
    ds.close()


def test_raise_open_file_limit_stays_within_the_hard_limit():
    import resource

    from mpidl.data import raise_open_file_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < 200:
        pytest.skip("needs a finite hard limit and a soft one of at least 200")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 100, hard))
        assert raise_open_file_limit(soft - 150) == soft - 100  # already allows it
        assert raise_open_file_limit(soft) == soft
        assert raise_open_file_limit(hard + 1000) == hard  # never past the hard limit
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
