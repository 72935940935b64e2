"""A soak: 300 data-parallel steps with random per-rank delays and random bucket sizes.

Ranks that arrive at their collectives at different moments, with gradients cut into
many small buckets in flight at once (overlapped or not), must still end with
bit-identical replicas and the parameters of an undisturbed single-process run of the
same global batches (float64, so "the same" is a tight statement).
"""
from __future__ import annotations

import random
import time
import zlib

import numpy
import pytest

from mpidl.comm import split_counts
from mpidl.functions import softmax_cross_entropy
from mpidl.models import mlp
from mpidl.optim import AdamW
from mpidl.parallel import DataParallel
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS, BATCH = 300, 13  # 13: uneven shares at 2 and 3 ranks, an empty one at 14+


def _model():
    return mlp(sizes=(12, 24, 24, 3), seed=3, dtype="float64")


def _batches():
    rng = numpy.random.default_rng(11)
    for _ in range(STEPS):
        yield rng.standard_normal((BATCH, 12)), rng.integers(0, 3, size=BATCH)


def _digest(model):
    d = 0
    for p in model.parameters():
        d = zlib.crc32(numpy.ascontiguousarray(p.data), d)
    return d


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_300_disturbed_steps_end_with_identical_replicas_and_the_undisturbed_parameters(
        comm, overlap):
    choice = random.Random(2024 + int(overlap))            # the same on every rank
    bucket_mb = choice.choice([0.0005, 0.001, 0.002, 0.004])  # 6-60 buckets of this model
    delays = random.Random(1000 + comm.rank)               # different on every rank
    model = _model()
    dp = DataParallel(model, comm, bucket_mb=bucket_mb, overlap=overlap)
    opt = AdamW(model.parameters(), lr=1e-2)
    counts = split_counts(BATCH, comm.size)
    start = sum(counts[:comm.rank])
    try:
        for x, y in _batches():
            time.sleep(delays.uniform(0, 0.002))           # arrive late, by a random amount
            mine = slice(start, start + counts[comm.rank])
            loss = softmax_cross_entropy(dp(x[mine]), y[mine], reduction="sum")
            if delays.random() < 0.2:
                time.sleep(delays.uniform(0, 0.002))       # ... or late into the exchange
            dp.backward(loss, global_count=BATCH)
            opt.step()
            opt.zero_grad()
    finally:
        dp.close()

    digests = comm.allgather_obj(_digest(model))
    assert_all_ranks(comm, len(set(digests)) == 1,
                     f"replicas differ after {STEPS} steps (bucket_mb={bucket_mb}): {digests}")
    reference = _model()
    ref_opt = AdamW(reference.parameters(), lr=1e-2)
    for x, y in _batches():
        loss = softmax_cross_entropy(reference(x), y, reduction="mean")
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_allclose_all_ranks(comm, p.data, q.data, scale=100.0,
                                  what=f"{name} after {STEPS} disturbed steps")
