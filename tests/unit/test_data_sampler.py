"""The exact sampler, with every rank simulated in one process (the MPI version is in
tests/mpi/test_sampler_mpi.py): coverage, no duplicates, rank-count independence, resume."""

from __future__ import annotations

import itertools

import numpy
import pytest

from mpidl.comm import split_counts
from mpidl.data.permutation import WindowedPermutation
from mpidl.data.sampler import (
    DEFAULT_WINDOW,
    DistributedSampler,
    FeistelPermutation,
    coalesce_runs,
)

MODES = ("block", "full", "none")


def epoch_batches(n, g, size, epoch=0, seed=0, **kw):
    """Global batches of one epoch, rebuilt from every rank's slices in rank order."""
    samplers = [DistributedSampler(n, g, r, size, seed=seed, **kw) for r in range(size)]
    for s in samplers:
        s.set_epoch(epoch)
    assert len({len(s) for s in samplers}) == 1, "ranks disagree on the number of steps"
    return [
        numpy.concatenate([s.indices(step) for s in samplers]) for step in range(len(samplers[0]))
    ]


@pytest.mark.parametrize("n", [1, 2, 5, 17, 100, 1000, 4097])
def test_feistel_is_a_bijection_with_an_inverse(n):
    perm = FeistelPermutation(n, key=987654321)
    ids = perm(numpy.arange(n))
    assert sorted(ids.tolist()) == list(range(n))
    numpy.testing.assert_array_equal(perm.inverse(ids), numpy.arange(n))


@pytest.mark.parametrize(
    "n,window,chunk", [(10, 4, 2), (1000, 64, 4), (1001, 64, 4), (1023, 66, 4), (4099, 256, 16)]
)
def test_windowed_permutation_is_a_bijection_whose_windows_read_few_chunks(n, window, chunk):
    perm = WindowedPermutation(n, 987654321, window, chunk)
    ids = perm(numpy.arange(n))
    assert sorted(ids.tolist()) == list(range(n))
    numpy.testing.assert_array_equal(perm.inverse(ids), numpy.arange(n))
    numpy.testing.assert_array_equal(perm.take(3, n), ids[3:])
    w = window - window % chunk
    for a in range(0, n - w, w):  # every window but the last: window / chunk whole chunks
        assert len(numpy.unique(ids[a : a + w] // chunk)) == w // chunk
    single = WindowedPermutation(n, 5, n + 3, 2)  # one window: the plain Feistel order
    numpy.testing.assert_array_equal(single(numpy.arange(n)), FeistelPermutation(n, 5)(
        numpy.arange(n)))


def test_windowed_block_order_reads_whole_chunks_in_a_window_of_steps():
    def chunks(**kw):  # the 1024-sample regions that steps 256-383 (window 2) read
        s = DistributedSampler(100_000, 128, 0, 1, seed=3, **kw)  # block 64
        starts = [a for rs in s.runs_between(256, 384) for a, _ in rs]
        return len(numpy.unique(numpy.array(starts) // 1024))

    assert chunks() == 16  # the default window of 16384: 16 whole chunks of 1024
    assert chunks(window=0) > 90  # 256 random blocks of the 98 regions


# every mode, and block mode without windows and with windows of 32 blocks of 2 ids
MODE_WINDOWS = [(m, DEFAULT_WINDOW) for m in MODES] + [("block", 0), ("block", 64)]


@pytest.mark.parametrize("mode,window", MODE_WINDOWS)
@pytest.mark.parametrize(
    "n,g,block", [(0, 4, 3), (1, 4, 3), (10, 3, 1), (101, 8, 3), (257, 16, 5), (1000, 64, 32),
                  (1001, 24, 2)]
)
def test_every_sample_once_per_epoch_at_1_2_3_ranks(mode, n, g, block, window):
    reference = None
    for size in (1, 2, 3):
        batches = epoch_batches(n, g, size, epoch=1, seed=4, shuffle=mode, block_size=block,
                                window=window)
        seen = numpy.concatenate(batches) if batches else numpy.zeros(0, dtype=numpy.int64)
        assert sorted(seen.tolist()) == list(range(n)), f"size {size}: not exactly the dataset"
        assert [len(b) for b in batches] == [min(g, n - j * g) for j in range(-(-n // g))]
        if reference is None:
            reference = batches
        else:  # the same global batches, in the same order, at any number of ranks
            assert all(numpy.array_equal(a, b) for a, b in zip(reference, batches))


def test_last_batch_is_split_as_evenly_as_possible_and_steps_agree():
    n, g, size = 103, 10, 4  # last batch has 3 samples: ranks get 1, 1, 1, 0
    samplers = [DistributedSampler(n, g, r, size) for r in range(size)]
    assert {len(s) for s in samplers} == {11}
    assert [len(s.indices(10)) for s in samplers] == [1, 1, 1, 0]
    assert [len(s.indices(0)) for s in samplers] == [3, 3, 2, 2]
    assert all(s.global_count(10) == 3 and s.global_count(0) == 10 for s in samplers)


@pytest.mark.parametrize("mode", ("block", "full"))
def test_epochs_and_seeds_give_different_orders(mode):
    e0 = numpy.concatenate(epoch_batches(500, 50, 1, epoch=0, shuffle=mode, block_size=4))
    e1 = numpy.concatenate(epoch_batches(500, 50, 1, epoch=1, shuffle=mode, block_size=4))
    s1 = numpy.concatenate(epoch_batches(500, 50, 1, epoch=0, seed=1, shuffle=mode, block_size=4))
    assert not numpy.array_equal(e0, e1) and not numpy.array_equal(e0, s1)
    # seed + epoch must not collide (PyTorch's seed 0 epoch 1 == seed 1 epoch 0)
    assert not numpy.array_equal(e1, s1)
    again = numpy.concatenate(epoch_batches(500, 50, 1, epoch=1, shuffle=mode, block_size=4))
    numpy.testing.assert_array_equal(e1, again)


def test_block_mode_reads_few_contiguous_runs():
    s = DistributedSampler(100_000, 256, 1, 2, seed=3, block_size=32)
    for step in (0, 7, len(s) - 1):
        runs = s.runs(step)
        assert len(runs) <= 128 // 32 + 1  # 128 samples of this rank: at most 5 runs
        numpy.testing.assert_array_equal(
            numpy.concatenate([numpy.arange(a, b) for a, b in runs]), s.indices(step)
        )


def test_block_mode_batches_mix_blocks_from_the_whole_dataset():
    s = DistributedSampler(10_000, 256, 0, 1, seed=0, block_size=32)
    first = s.indices(0)
    assert first.max() - first.min() > 2000  # 8 random blocks, not one region


@pytest.mark.parametrize("mode", MODES)
def test_resume_mid_epoch_gives_exactly_the_remaining_samples(mode):
    n, g = 211, 16
    for size, stop in itertools.product((1, 2, 3), (0, 5, 13, 14)):
        full = epoch_batches(n, g, size, epoch=2, seed=9, shuffle=mode, block_size=3)
        resumed = [
            DistributedSampler(n, g, r, size, seed=9, shuffle=mode, block_size=3)
            for r in range(size)
        ]
        for s in resumed:
            s.resume(2, stop)
        rest = [numpy.concatenate(b) for b in zip(*(list(s) for s in resumed))]
        assert len(rest) == len(full) - stop
        assert all(numpy.array_equal(a, b) for a, b in zip(full[stop:], rest))


def test_resume_with_a_different_number_of_ranks():
    first = epoch_batches(300, 20, 2, epoch=5, seed=1)
    later = [DistributedSampler(300, 20, r, 3, seed=1) for r in range(3)]
    for s in later:
        s.resume(5, 6)
    rest = [numpy.concatenate(b) for b in zip(*(list(s) for s in later))]
    assert all(numpy.array_equal(a, b) for a, b in zip(first[6:], rest))


def test_drop_last_leaves_out_the_partial_batch():
    s = DistributedSampler(105, 10, 0, 1, seed=0, drop_last=True)
    assert len(s) == 10
    seen = numpy.concatenate(list(s))
    assert len(seen) == 100 and len(set(seen.tolist())) == 100


def test_set_epoch_restarts_and_state_dict_reports_position():
    s = DistributedSampler(50, 8, 0, 1, seed=2)
    s.resume(3, 4)
    assert s.state_dict() == {"epoch": 3, "step": 4, "seed": 2}
    assert len(list(s)) == len(s) - 4
    s.set_epoch(4)
    assert len(list(s)) == len(s)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_samples=-1, global_batch=4, rank=0, size=1), "num_samples"),
        (dict(num_samples=10, global_batch=0, rank=0, size=1), "global_batch"),
        (dict(num_samples=10, global_batch=4, rank=2, size=2), "rank 2 of size 2"),
        (dict(num_samples=10, global_batch=4, rank=0, size=1, shuffle="random"), "shuffle"),
        (dict(num_samples=10, global_batch=4, rank=0, size=1, block_size=0), "block_size"),
        (dict(num_samples=10, global_batch=4, rank=0, size=1, window=-1), "window -1"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedSampler(**kwargs)


def test_resume_outside_the_epoch_is_an_error():
    s = DistributedSampler(10, 4, 0, 1)
    with pytest.raises(ValueError, match="step 4 is outside"):
        s.resume(0, 4)


def test_coalesce_runs_merges_adjacent_runs_only():
    ids = numpy.array([5, 6, 7, 1, 2, 9])
    numpy.testing.assert_array_equal(coalesce_runs(ids, ids + 1), [[5, 8], [1, 3], [9, 10]])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "n,g,size,block", [(1, 1, 1, 1), (100, 7, 3, 4), (1000, 64, 5, 32), (4099, 128, 2, 100),
                       (1001, 24, 3, 2)]
)
def test_runs_between_equals_runs_step_by_step(mode, n, g, size, block):
    for rank, drop_last in itertools.product(range(size), (False, True)):
        s = DistributedSampler(
            n, g, rank, size, seed=3, shuffle=mode, block_size=block, drop_last=drop_last,
            window=64,
        )
        s.set_epoch(rank + 1)
        steps = len(s)
        for first, stop in ((0, steps), (steps // 3, steps), (0, min(2, steps)), (steps, steps)):
            want = [s.runs(step).tolist() for step in range(first, stop)]
            assert s.runs_between(first, stop) == want, (rank, drop_last, first, stop)


def test_runs_between_rejects_steps_outside_the_epoch():
    s = DistributedSampler(100, 10, 0, 2)
    with pytest.raises(IndexError, match="step 10 out of range"):
        s.runs_between(5, 11)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_rank_range_and_runs_between_split_each_batch_as_split_counts_does(size):
    # The sampler has two copies of mpidl's one splitting rule (split_counts): per step in
    # rank_range, vectorised over steps in runs_between. Both must follow it for every
    # batch length (full batches and every remainder), rank count and rank, empty shares
    # included: rank r takes positions [a + sum(counts[:r]), + counts[r]) of batch [a, b).
    for g in range(1, 11):
        for n in [*range(1, g), *range(2 * g, 3 * g)]:  # a lone partial batch; any remainder
            whole = DistributedSampler(n, g, 0, 1, seed=5, block_size=3)
            for rank in range(size):
                s = DistributedSampler(n, g, rank, size, seed=5, block_size=3)
                planned = s.runs_between(0, len(s))
                for step in range(len(s)):
                    a, b = whole.global_range(step)
                    counts = split_counts(b - a, size)
                    lo = a + sum(counts[:rank])
                    where = f"n={n} global_batch={g} rank {rank} of {size}, step {step}"
                    assert s.rank_range(step) == (lo, lo + counts[rank]), where
                    ids = [i for start, stop in planned[step] for i in range(start, stop)]
                    share = whole.indices(step)[lo - a:lo - a + counts[rank]]
                    assert ids == share.tolist(), where
