"""16-bit gradient compression: bfloat16 rounding against a reference built from
distances (not from the shift-and-add trick), every NaN and infinity bit pattern, and
the custom sum that MPI runs between ranks.

A NaN gradient must arrive as a NaN: the non-finite-gradient policy can only act on
what it sees, and a NaN that the wire turned into 0.0 trains on silently.
"""
from __future__ import annotations

import numpy
import pytest

from mpidl.parallel import compression
from mpidl.parallel.compression import (
    HOST_BLOCK,
    bfloat16_to_float32,
    compress,
    decompress,
    float32_to_bfloat16,
)

SIGN = numpy.uint32(0x80000000)


def as_float32(bits):
    return numpy.asarray(bits, dtype=numpy.uint32).view(numpy.float32)


def bf16_values(patterns):
    """bfloat16 patterns as float64, with an infinity standing for 2**128 (the next
    step after the largest finite value, as round-to-nearest treats it)."""
    patterns = numpy.asarray(patterns, dtype=numpy.uint16)
    values = bfloat16_to_float32(patterns).astype(numpy.float64)
    inf = numpy.isinf(values)
    values[inf] = numpy.copysign(2.0 ** 128, values[inf])
    return values


def nearest_even(bits):
    """Round-to-nearest-even bfloat16 of finite float32 ``bits``, chosen by distance:
    of the two bfloat16 neighbours (truncation and the next one away from zero), the
    closer, and on a tie the one with an even last bit."""
    bits = numpy.asarray(bits, dtype=numpy.uint32)
    x = as_float32(bits).astype(numpy.float64)
    toward = (bits >> 16).astype(numpy.uint16)
    away = toward + numpy.uint16(1)  # the sign is the top bit: +1 goes away from zero
    d_toward = numpy.abs(x - bf16_values(toward))
    d_away = numpy.abs(bf16_values(away) - x)
    tie_goes_away = (d_toward == d_away) & (toward % 2 == 1)
    return numpy.where((d_away < d_toward) | tie_goes_away, away, toward)


def both_signs(bits):
    bits = numpy.asarray(bits, dtype=numpy.uint32)
    return numpy.concatenate([bits, bits | SIGN])


def exponent_all_ones():
    """Every float32 bit pattern with exponent 0xFF: the 2 infinities and 2**24 - 2 NaNs
    (quiet and signalling, both signs)."""
    return both_signs(numpy.arange(0x7F800000, 0x80000000, dtype=numpy.uint64))


def test_every_nan_pattern_stays_a_nan_of_its_sign_and_infinities_stay_infinite():
    bits = exponent_all_ones()
    out = float32_to_bfloat16(as_float32(bits))
    nan = (bits & 0x7FFFFFFF) != 0x7F800000
    result_nan = numpy.isnan(bfloat16_to_float32(out))
    assert result_nan[nan].all(), (
        f"{int((~result_nan[nan]).sum())} NaN patterns lost, e.g. "
        f"{hex(int(bits[nan][~result_nan[nan]][0]))} -> {hex(int(out[nan][~result_nan[nan]][0]))}")
    # The sign and the upper payload are kept, the quiet bit set (a hardware conversion).
    assert numpy.array_equal(out[nan], (bits[nan] >> 16).astype(numpy.uint16) | 0x0040)
    assert out[~nan].tolist() == [0x7F80, 0xFF80]


@pytest.mark.parametrize("region", ["near-largest-finite", "smallest", "ties", "random"])
def test_finite_values_round_to_nearest_even(region):
    rng = numpy.random.default_rng(5)
    if region == "near-largest-finite":  # the last 4 bfloat16 steps, and the overflow to inf
        bits = numpy.arange(0x7F7C0000, 0x7F800000, dtype=numpy.uint32)
    elif region == "smallest":  # zero and subnormals: up to the first few bfloat16 ones
        bits = numpy.arange(0, 0x00040000, dtype=numpy.uint32)
    elif region == "ties":  # exactly halfway, one below and one above, odd and even
        upper = rng.integers(0, 0x7F80, size=20000, dtype=numpy.uint32) << 16
        bits = numpy.concatenate([upper | low for low in (0x7FFF, 0x8000, 0x8001)])
    else:  # any finite pattern
        bits = rng.integers(0, 0x7F800000, size=1 << 20, dtype=numpy.uint32)
    bits = both_signs(bits)
    out = float32_to_bfloat16(as_float32(bits))
    expected = nearest_even(bits)
    bad = numpy.flatnonzero(out != expected)
    assert not bad.size, (f"{bad.size} of {bits.size} differ, e.g. {hex(int(bits[bad[0]]))} "
                          f"-> {hex(int(out[bad[0]]))}, expected {hex(int(expected[bad[0]]))}")


def test_blocks_cover_any_size_and_keep_the_shape():
    rng = numpy.random.default_rng(1)
    for n in (0, 1, HOST_BLOCK - 1, HOST_BLOCK, 2 * HOST_BLOCK + 3):
        x = rng.standard_normal(n).astype(numpy.float32)
        out = float32_to_bfloat16(x)
        assert out.shape == (n,) and numpy.array_equal(out, nearest_even(x.view(numpy.uint32)))
    x = rng.standard_normal((3, 5)).astype(numpy.float32)
    assert float32_to_bfloat16(x).shape == (3, 5)
    wire = numpy.empty(15, dtype=numpy.uint16)
    assert compress(x, "bfloat16", out=wire) is wire
    assert numpy.array_equal(wire, float32_to_bfloat16(x).reshape(-1))
    with pytest.raises(ValueError, match="contiguous array of 15 elements"):
        float32_to_bfloat16(x, out=numpy.empty(30, dtype=numpy.uint16)[::2])


def bf16(values):
    return float32_to_bfloat16(numpy.asarray(values, dtype=numpy.float32))


def wire_sum(a, b):
    """What the MPI op leaves in the receiving buffer ``b`` after adding ``a``."""
    b = numpy.array(b, dtype=numpy.uint16)
    compression._sum_bfloat16(numpy.asarray(a, dtype=numpy.uint16), b, None)
    return b


def test_the_wire_sum_keeps_nan_and_infinity():
    # Every bfloat16 NaN pattern, against zero, numbers, infinities and NaNs.
    nans = numpy.concatenate([numpy.arange(0x7F81, 0x8000), numpy.arange(0xFF81, 0x10000)])
    others = bf16([0.0, -0.0, 1.0, -3.5, 3e38, numpy.inf, -numpy.inf, numpy.nan])
    a = numpy.repeat(nans, others.size).astype(numpy.uint16)
    b = numpy.tile(others, nans.size)
    for x, y in ((a, b), (b, a)):
        assert numpy.isnan(bfloat16_to_float32(wire_sum(x, y))).all()
    specials = {  # (a, b): the sum
        (numpy.inf, 1.0): numpy.inf, (-numpy.inf, -1e38): -numpy.inf,
        (3e38, 3e38): numpy.inf,     # overflow of finite values
        (numpy.inf, -numpy.inf): numpy.nan,
        (1.0, 2.0 ** -8): 1.0,       # a tie goes to the even neighbour
        (1.0, 3 * 2.0 ** -9): 1.0 + 2.0 ** -7,
    }
    a, b = (bf16([k[i] for k in specials]) for i in (0, 1))
    got = bfloat16_to_float32(wire_sum(a, b))
    assert numpy.array_equal(got, numpy.array(list(specials.values()), numpy.float32),
                             equal_nan=True), got


def test_the_wire_sum_rounds_each_block_like_the_whole():
    rng = numpy.random.default_rng(2)
    n = 2 * HOST_BLOCK + 5
    a, b = (bf16(rng.standard_normal(n)) for _ in range(2))
    expected = nearest_even((bfloat16_to_float32(a) + bfloat16_to_float32(b)).view(numpy.uint32))
    assert numpy.array_equal(wire_sum(a, b), expected)


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_a_round_trip_keeps_nan_and_infinity_in_place(wire_dtype):
    flat = numpy.array([1.0, numpy.nan, -numpy.inf, numpy.inf, -2.0], dtype=numpy.float32)
    flat[1:2].view(numpy.uint32)[0] = 0xFFFFFFFF  # the NaN that used to wrap to 0.0
    back = numpy.empty_like(flat)
    decompress(compress(flat, wire_dtype), wire_dtype, back)
    assert numpy.array_equal(back, flat, equal_nan=True), back
