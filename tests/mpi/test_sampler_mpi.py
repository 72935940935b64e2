"""The exact sampler on real ranks: the union of what the ranks see is the dataset, and
each step's global batch is the same as on one rank. Run at 1, 2 and 3 ranks::

    mpiexec -n 3 python -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_sampler_mpi.py
"""

from __future__ import annotations

import numpy
import pytest

from mpidl.data import DistributedSampler
from mpidl.testing import assert_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

CASES = [(1, 4, 2), (7, 4, 2), (101, 8, 3), (257, 16, 5), (1000, 64, 32), (50, 3, 1),
         (1001, 24, 2)]


@pytest.mark.parametrize("mode", ["block", "full", "none"])
@pytest.mark.parametrize("n,g,block", CASES)
def test_ranks_together_see_every_sample_once(comm, mode, n, g, block):
    # window 64: block mode's windows hold 32 blocks of 2 ids (only the last case has more)
    s = DistributedSampler(n, g, comm.rank, comm.size, seed=11, shuffle=mode, block_size=block,
                           window=64)
    s.set_epoch(3)
    steps = comm.allgather_obj(len(s))
    assert_all_ranks(comm, len(set(steps)) == 1, f"steps per rank differ: {steps}")
    mine = numpy.concatenate(list(s)) if len(s) else numpy.zeros(0, dtype=numpy.int64)
    everything = comm.allgatherv(mine.astype(numpy.int64))
    ok = numpy.array_equal(numpy.sort(everything), numpy.arange(n))
    assert_all_ranks(comm, ok, f"union of {len(everything)} ids is not exactly 0..{n - 1}")


@pytest.mark.parametrize("mode,window", [("block", 16384), ("full", 16384), ("block", 64)])
def test_global_batches_equal_the_single_rank_batches(comm, mode, window):
    n, g = 211, 12  # window 64: windows of 16 blocks of 4 ids, in chunks of one block
    s = DistributedSampler(n, g, comm.rank, comm.size, seed=2, shuffle=mode, block_size=4,
                           window=window)
    one = DistributedSampler(n, g, 0, 1, seed=2, shuffle=mode, block_size=4, window=window)
    bad = []
    for epoch in (0, 1):
        s.set_epoch(epoch)
        one.set_epoch(epoch)
        for step, ids in enumerate(s):
            batch = comm.allgatherv(ids)  # rank order: the ranks' slices concatenated
            if not numpy.array_equal(batch, one.indices(step)):
                bad.append((epoch, step))
    assert_all_ranks(comm, not bad, f"global batches differ from 1 rank at (epoch, step) {bad[:3]}")


def test_epochs_differ_and_resume_gives_the_remaining_samples(comm):
    n, g = 300, 20
    s = DistributedSampler(n, g, comm.rank, comm.size, seed=4)
    one = DistributedSampler(n, g, 0, 1, seed=4)
    one.set_epoch(1)
    e1 = list(one)
    one.set_epoch(2)
    assert_all_ranks(
        comm,
        not numpy.array_equal(numpy.concatenate(e1), numpy.concatenate(list(one))),
        "epochs 1 and 2 have the same order",
    )
    s.resume(1, 9)
    rest = [comm.allgatherv(ids) for ids in s]
    ok = len(rest) == len(e1) - 9 and all(numpy.array_equal(a, b) for a, b in zip(rest, e1[9:]))
    assert_all_ranks(comm, ok, "resuming at step 9 did not give exactly the remaining batches")
