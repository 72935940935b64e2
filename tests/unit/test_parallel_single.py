"""Tensor and sequence parallelism on one process: the same numbers as the plain model,
and the helpers that the MPI tests and benchmarks lean on (no MPI needed)."""
from __future__ import annotations

import numpy
import pytest

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.comm import SingleCommunicator
from mpidl.models import gpt
from mpidl.parallel import parallel_gpt
from mpidl.parallel.grid import ProcessGrid, single_grid
from mpidl.parallel.tensor import Shard
from mpidl.parallel.vocab import vocab_parallel_cross_entropy
from mpidl.testing import allclose
from mpidl.testing.counting import CountingCommunicator
from mpidl.testing.memory import peak_bytes


def test_a_grid_of_one_rank_builds_exactly_the_single_rank_gpt():
    kw = dict(vocab=11, seq_len=8, dim=8, layers=1, heads=2, seed=4, dtype="float64")
    ids = numpy.random.default_rng(0).integers(0, 11, (2, 8))
    reference, model = gpt(**kw), parallel_gpt(single_grid(), **kw)
    reference.loss(ids).backward()
    model.loss(ids).backward()
    for (name, p), (other, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert name == other and numpy.array_equal(p.data, q.data)
        assert allclose(p.grad, q.grad), name


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, 2])
def test_vocab_parallel_cross_entropy_of_one_shard_is_softmax_cross_entropy(
        reduction, ignore_index):
    rng = numpy.random.default_rng(1)
    logits, labels = rng.standard_normal((3, 4, 7)), rng.integers(0, 7, (3, 4))
    a, b = Tensor(logits, requires_grad=True), Tensor(logits, requires_grad=True)
    got = vocab_parallel_cross_entropy(a, labels, SingleCommunicator(), 0, 7,
                                       ignore_index=ignore_index, reduction=reduction)
    want = F.softmax_cross_entropy(b, labels, ignore_index=ignore_index, reduction=reduction)
    F.sum(got).backward()
    F.sum(want).backward()
    assert allclose(got.data, want.data) and allclose(a.grad, b.grad)


def test_vocab_parallel_cross_entropy_names_a_label_out_of_range():
    with pytest.raises(ValueError, match="label 9 is out of range for 7 classes"):
        vocab_parallel_cross_entropy(numpy.zeros((1, 7)), numpy.array([9]),
                                     SingleCommunicator(), 0, 7)


def test_a_shard_takes_its_piece_of_every_group():
    full = numpy.arange(2 * 9 * 2).reshape(18, 2)  # 2 groups of 9 rows, split 3 / 3 / 3

    class Rank:
        rank, size = 1, 3

    piece = Shard(0, (3, 3, 3), Rank(), groups=2).take(full)
    numpy.testing.assert_array_equal(piece, full[[3, 4, 5, 12, 13, 14]])
    one = Shard(1, (18,), SingleCommunicator())
    numpy.testing.assert_array_equal(one.gather(one.take(full.T)), full.T)


def test_grid_sizes_must_divide_the_world():
    with pytest.raises(ValueError, match="does not divide the 1 ranks"):
        ProcessGrid(SingleCommunicator(), tensor=2)
    with pytest.raises(ValueError, match="positive int"):
        ProcessGrid(SingleCommunicator(), sequence=0)


def test_the_counting_communicator_counts_calls_and_bytes_per_operation():
    comm = CountingCommunicator(SingleCommunicator())
    x = numpy.zeros(10)
    comm.allreduce_(x)
    comm.allreduce(x)
    comm.isendrecv(x, 0, 0).wait()
    sub = comm.split(0)
    sub.alltoall(x[None])
    assert (comm.counts["allreduce_"].calls, comm.counts["allreduce_"].nbytes) == (2, 160)
    assert comm.total().nbytes == 240 and "alltoall" not in comm.counts
    assert sub.counts["alltoall"].nbytes == 80


def test_peak_bytes_sees_numpy_arrays():
    _, peak = peak_bytes(lambda: numpy.ones(1 << 20).sum())
    assert peak >= 8 << 20
