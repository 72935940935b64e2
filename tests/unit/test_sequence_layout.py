"""SequenceLayout: which tokens each rank of a sequence group holds (no MPI needed)."""
from __future__ import annotations

import numpy
import pytest

from mpidl.parallel.sequence import SequenceLayout, zigzag_split, zigzag_unsplit


def test_zigzag_gives_rank_r_chunks_r_and_2s_minus_1_minus_r():
    layout = SequenceLayout(12, 3, zigzag=True)  # 6 chunks of 2
    assert [layout.positions(r).tolist() for r in range(3)] == [
        [0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]


@pytest.mark.parametrize("length, size, zigzag", [(12, 3, True), (7, 2, True), (7, 3, False),
                                                  (1, 4, True), (5, 1, False)])
def test_split_then_unsplit_is_the_identity_and_pads_at_the_end(length, size, zigzag):
    x = numpy.arange(2 * length).reshape(2, length) + 1
    layout = SequenceLayout(length, size, zigzag=zigzag)
    parts = [layout.split(x, fill=-1, rank=r) for r in range(size)]
    assert all(p.shape == (2, layout.shard_length) for p in parts)
    assert layout.padded % (2 * size if zigzag else size) == 0 and layout.padded >= length
    numpy.testing.assert_array_equal(layout.unsplit(parts), x)
    joined = numpy.concatenate(parts, axis=1)
    assert (joined == -1).sum() == 2 * (layout.padded - length)
    valid = numpy.concatenate([layout.valid(r) for r in range(size)])
    assert (joined[:, ~valid] == -1).all() and (joined[:, valid] > 0).all()


def test_zigzag_split_and_unsplit_functions_round_trip():
    x = numpy.random.default_rng(0).standard_normal((2, 3, 10, 4))
    parts = [zigzag_split(x, 2, r, axis=2) for r in range(2)]
    numpy.testing.assert_array_equal(zigzag_unsplit(parts, 10, axis=2), x)


def test_a_layout_needs_a_token_and_a_rank_in_the_group():
    with pytest.raises(ValueError, match="length >= 1"):
        SequenceLayout(0, 2)
    with pytest.raises(ValueError, match="rank < size"):
        SequenceLayout(4, 2, rank=2)


def test_ulysses_heads_fit_when_every_tensor_ranks_share_divides_over_the_sequence_group():
    from mpidl.parallel.sequence import ulysses_heads_fit

    assert ulysses_heads_fit(6, tensor=2, sequence=3)        # 3 + 3 heads, 1 per sequence rank
    assert not ulysses_heads_fit(5, tensor=2, sequence=2)    # 3 + 2: the 3 do not split in 2
    assert ulysses_heads_fit(4, sequence=4) and not ulysses_heads_fit(4, sequence=3)
    assert ulysses_heads_fit(7)                               # no split at all
