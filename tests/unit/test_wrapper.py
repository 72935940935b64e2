"""The one wrapper interface: every wrapper says it, and counts its memory one way."""
from __future__ import annotations

import numpy
import pytest

from mpidl.functions import softmax_cross_entropy
from mpidl.models import mlp
from mpidl.optim import AdamW
from mpidl.parallel import DataParallel, ShardedDataParallel
from mpidl.parallel.wrapper import HeldBytes, Wrapper
from mpidl.testing import run_ranks


def _wrap(comm, kind):
    model = mlp(sizes=(7, 11, 5), seed=4, dtype="float64")
    if kind == "dp":
        return DataParallel(model, comm, shared_memory=False)
    return ShardedDataParallel(model, comm, stage=int(kind[-1]))


@pytest.mark.parametrize("kind", ["dp", "zero1", "zero2", "zero3"])
def test_every_wrapper_implements_the_interface_and_counts_what_it_holds(kind):
    def body(comm):
        wrapper = _wrap(comm, kind)
        opt = AdamW(wrapper.parameters(), lr=1e-3)
        x = numpy.random.default_rng(comm.rank).standard_normal((3, 7))
        wrapper.backward(softmax_cross_entropy(wrapper(x), numpy.array([0, 1, 2]),
                                               reduction="sum"), global_count=3 * comm.size)
        opt.step()
        held = wrapper.state_bytes(opt)
        wrapper.close()
        return isinstance(wrapper, Wrapper), held

    full = 8 * (7 * 11 + 11 + 11 * 5 + 5)  # float64 parameters of the mlp
    for implements, held in run_ranks(2, body):
        assert implements
        if kind == "dp":  # whole parameters, one bucket set of gradients, two moments
            assert held == {"parameters": full, "gradients": full, "optimizer": 2 * full}
        else:  # shards: about half of everything (ZeRO-3's parameters too)
            assert held["optimizer"] <= full + 8 * 2 * 2  # two moments of a half, padded


def test_held_bytes_counts_a_buffer_once_through_all_its_views():
    flat = numpy.zeros(10)
    held = HeldBytes()
    assert held(flat[:5], flat[5:], flat) == 80
    assert held(flat) == 0  # already counted
    assert held(numpy.zeros(3, dtype=numpy.float32), None) == 12
