"""The modes' formulas (mpidl.modes) against numbers worked out by hand."""
from __future__ import annotations

import pytest

from hpc.costmodel import Link
from mpidl.modes import Shape, modes_for, state_bytes_per_param

# A link of 10 us and 1 GB/s; 1,000,000 parameters with AdamW (2 copies), 4 ranks; the
# gpt model's sizes: 2 layers of width 64, 4 heads, 128 tokens, global batch 8.
LINK = Link(alpha=1e-5, bandwidth=1e9)
SHAPE = Shape(params=1_000_000, copies=2, global_batch=8, layers=2, dim=64, tokens=128,
              heads=4)


def by_mode(rows):
    return {r.mode: r for r in rows}


def test_state_per_rank_per_mode():
    rows = by_mode(modes_for(SHAPE, 4, memory=64e6, time=LINK.time))
    # data: 4 + 4 + 8 bytes per parameter; ZeRO 1: 8 + 8/4; ZeRO 2: 4 + 12/4; ZeRO 3 and
    # tensor: 16/4; Ulysses and ring keep every parameter.
    expected = {"data": 16e6, "zero1": 10e6, "zero2": 7e6, "zero3": 4e6, "tensor": 4e6,
                "ulysses": 16e6, "ring": 16e6}
    assert {m: r.state_bytes for m, r in rows.items()} == pytest.approx(expected)
    # the largest model whose state fills 64 MB per rank: 64e6 / bytes per parameter
    assert rows["data"].largest_params == pytest.approx(4e6)
    assert rows["zero3"].largest_params == pytest.approx(16e6)
    assert rows["zero1"].largest_params == pytest.approx(6.4e6)


def test_communication_per_step_per_mode():
    rows = by_mode(modes_for(SHAPE, 4, memory=0, time=LINK.time))
    # data: a ring allreduce of 4e6 bytes over 4: 2*3*1e-5 + (2*3/4) * 4e6 / 1e9
    data = 6e-5 + 1.5 * 4e-3
    assert rows["data"].comm_s == pytest.approx(data)            # 6.06 ms
    # ZeRO 1 and 2: a reduce-scatter and an allgather, each 3*1e-5 + (3/4) * 4e-3
    assert rows["zero1"].comm_s == pytest.approx(2 * (3e-5 + 3e-3))
    assert rows["zero2"].comm_s == pytest.approx(data)
    # ZeRO 3: one more allgather
    assert rows["zero3"].comm_s == pytest.approx(3 * (3e-5 + 3e-3))   # 9.09 ms
    # tensor 4: per layer 4 allreduces of B T D = 8 * 128 * 64 values = 262,144 bytes:
    # each 6e-5 + 1.5 * 262144 / 1e9 = 453.216 us; 2 layers x 4 = 3.625728 ms
    assert rows["tensor"].comm_s == pytest.approx(8 * (6e-5 + 1.5 * 262144e-9))
    # Ulysses 4: per layer 4 all-to-alls of 2 B T D / s = 131,072 bytes, each
    # 3e-5 + 0.75 * 131072e-9; plus the gradient's allreduce over the 4 replicas
    assert rows["ulysses"].comm_s == pytest.approx(8 * (3e-5 + 0.75 * 131072e-9) + data)
    # ring 4: per layer 3*4 - 2 = 10 sendrecvs of 131,072 bytes, each 1e-5 + 131072e-9
    assert rows["ring"].comm_s == pytest.approx(20 * (1e-5 + 131072e-9) + data)


def test_split_modes_only_where_they_work():
    assert {r.mode for r in modes_for(SHAPE, 3, 0, LINK.time)} == {
        "data", "zero1", "zero2", "zero3", "tensor", "ring"}   # 4 heads: no Ulysses over 3
    assert "tensor" not in by_mode(modes_for(SHAPE, 8, 0, LINK.time))  # more ranks than heads
    plain = Shape(params=10, copies=1, global_batch=4)  # not the gpt model
    modes = set(by_mode(modes_for(plain, 2, 0, LINK.time)))
    assert modes == {"data", "zero1", "zero2", "zero3"}


def test_bytes_per_parameter_with_sgd():
    assert state_bytes_per_param("data", 2, 0) == 8        # parameters + gradients
    assert state_bytes_per_param("zero2", 2, 1) == 4 + 8 / 2
