"""embedding / embedding_bag: lookups, sparse-aware backward (against a dense add.at
reference, including rows repeated more often than the vectorised passes handle),
padding, and the ``weight.grad_row_mask`` hook."""
from __future__ import annotations

import numpy
import pytest

import mpidl.functions as F
from mpidl.autograd import Tensor
from mpidl.backend import as_numpy
from mpidl.testing import allclose
from mpidl.testing.gradcheck import gradcheck


def touched(w):
    """The sorted ids of the rows ``w.grad_row_mask`` marks as touched."""
    return numpy.flatnonzero(as_numpy(w.grad_row_mask)).tolist()


def _randn(xp, *shape, seed=0, dtype=numpy.float64):
    return xp.asarray(numpy.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _ids(xp, shape, vocab, seed=0):
    rng = numpy.random.default_rng(seed)
    # A skewed distribution: a few ids repeat far more than 8 times, most are rare.
    ids = numpy.minimum(rng.zipf(1.5, size=shape) - 1, vocab - 1)
    return xp.asarray(ids.astype(numpy.int64))


def test_embedding_forward_and_gradient(xp):
    w = _randn(xp, 6, 3, seed=1)
    ids = xp.asarray([[1, 2, 1], [0, 1, 5]])
    assert allclose(F.embedding(ids, Tensor(w)).data, as_numpy(w)[as_numpy(ids)])
    assert gradcheck(lambda t: F.embedding(ids, t), [w])


def test_embedding_backward_matches_dense_scatter_add(xp):
    vocab, dim = 50, 4
    w = Tensor(_randn(xp, vocab, dim, seed=2, dtype=numpy.float32), requires_grad=True)
    ids = _ids(xp, (8, 40), vocab, seed=3)
    g = _randn(xp, 8, 40, dim, seed=4, dtype=numpy.float32)
    F.embedding(ids, w).backward(g)
    ref = numpy.zeros((vocab, dim), numpy.float32)
    numpy.add.at(ref, as_numpy(ids).reshape(-1), as_numpy(g).reshape(-1, dim))
    assert w.grad.dtype == numpy.float32
    assert allclose(w.grad, ref, scale=10)
    assert numpy.bincount(as_numpy(ids).reshape(-1)).max() > 8  # the reduceat path ran


def test_embedding_grad_rows_lists_touched_rows_per_pass(xp):
    w = Tensor(_randn(xp, 10, 2, seed=5), requires_grad=True)
    F.sum(F.embedding(xp.asarray([3, 1, 3]), w)).backward()
    assert touched(w) == [1, 3]
    # Two lookups in one pass: the union.
    y = F.embedding(xp.asarray([7]), w) + F.embedding(xp.asarray([[2]]), w)[0]
    F.sum(y).backward()
    assert touched(w) == [2, 7]
    # A new pass replaces them.
    F.sum(F.embedding_bag(xp.asarray([[4, 4]]), w)).backward()
    assert touched(w) == [4]
    untouched = numpy.setdiff1d(numpy.arange(10), [1, 2, 3, 4, 7])
    assert numpy.all(as_numpy(w.grad)[untouched] == 0)


def test_embedding_padding_idx_outputs_zeros_and_gets_no_gradient(xp):
    w = _randn(xp, 5, 3, seed=6)
    ids = xp.asarray([[0, 2, 0], [1, 0, 4]])
    y = F.embedding(ids, Tensor(w), padding_idx=0)
    ref = as_numpy(w)[as_numpy(ids)]
    ref[as_numpy(ids) == 0] = 0
    assert allclose(y.data, ref)
    assert gradcheck(lambda t: F.embedding(ids, t, padding_idx=0), [w])
    x = Tensor(w, requires_grad=True)
    F.sum(F.embedding(ids, x, padding_idx=0)).backward()
    assert numpy.all(as_numpy(x.grad)[0] == 0)
    assert 0 not in touched(x)


def test_embedding_bag_is_the_mean_over_the_last_axis(xp):
    w = _randn(xp, 7, 3, seed=7)
    ids = xp.asarray([[[1, 2, 1, 1], [0, 6, 4, 5]], [[3, 3, 3, 3], [2, 1, 0, 6]]])
    assert allclose(F.embedding_bag(ids, Tensor(w)).data, as_numpy(w)[as_numpy(ids)].mean(axis=-2))
    assert gradcheck(lambda t: F.embedding_bag(ids, t), [w])


def test_embedding_bag_backward_matches_dense_scatter_add(xp):
    vocab, dim, bags, length = 300, 5, 16, 64
    w = Tensor(_randn(xp, vocab, dim, seed=8, dtype=numpy.float32), requires_grad=True)
    ids = _ids(xp, (bags, length), vocab, seed=9)
    g = _randn(xp, bags, dim, seed=10, dtype=numpy.float32)
    y = F.embedding_bag(ids, w)
    assert y.dtype == numpy.float32
    y.backward(g)
    ref = numpy.zeros((vocab, dim), numpy.float32)
    per_token = numpy.repeat(as_numpy(g) / length, length, axis=0)
    numpy.add.at(ref, as_numpy(ids).reshape(-1), per_token)
    assert allclose(w.grad, ref, scale=10)
    assert touched(w) == numpy.unique(as_numpy(ids)).tolist()


def test_embedding_bag_padding_idx_is_left_out_of_the_mean(xp):
    w = _randn(xp, 6, 3, seed=11)
    ids = xp.asarray([[1, 2, 0, 0], [0, 0, 0, 0], [5, 0, 3, 3]])
    n, wn = as_numpy(ids), as_numpy(w)
    ref = numpy.stack([wn[row[row != 0]].mean(axis=0) if (row != 0).any() else numpy.zeros(3)
                       for row in n])
    assert allclose(F.embedding_bag(ids, Tensor(w), padding_idx=0).data, ref)
    assert gradcheck(lambda t: F.embedding_bag(ids, t, padding_idx=0), [w])


def test_embedding_rejects_bad_ids(xp):
    # Host ids are checked before they move to the table's device (no device sync).
    w = Tensor(xp.zeros((4, 2)))
    with pytest.raises(IndexError, match="out of range"):
        F.embedding(numpy.array([0, 4]), w)
    with pytest.raises(IndexError, match="out of range"):
        F.embedding_bag(numpy.array([[-1, 0]]), w)
    with pytest.raises(TypeError, match="integers"):
        F.embedding(numpy.array([0.0, 1.0]), w)
    with pytest.raises(IndexError, match="id 9 is out of range for a table of 4 rows"):
        F.embedding([[0, 9]], w)  # a list
    assert F.embedding([[0, 3]], w).shape == (1, 2, 2)


def test_embedding_ids_may_be_tensors(xp):
    w = Tensor(_randn(xp, 4, 2, seed=12), requires_grad=True)
    ids = Tensor(xp.asarray([1, 3]))
    F.sum(F.embedding(ids, w)).backward()
    assert allclose(w.grad, numpy.array([[0, 0], [1, 1], [0, 0], [1, 1]], dtype=numpy.float64))


def test_embedding_bag_backward_with_many_small_bags_and_padding(xp):
    # Many bags of two tokens over a large vocabulary: the per-token path, not the
    # (ids x bags) count matrix.
    vocab, dim, bags = 1000, 3, 200
    w = Tensor(_randn(xp, vocab, dim, seed=13), requires_grad=True)
    ids = _ids(xp, (bags, 2), vocab, seed=14)
    g = _randn(xp, bags, dim, seed=15)
    F.embedding_bag(ids, w, padding_idx=0).backward(g)
    n = as_numpy(ids)
    ref = numpy.zeros((vocab, dim))
    for b in range(bags):
        real = n[b][n[b] != 0]
        for i in real:
            ref[i] += as_numpy(g)[b] / len(real)
    assert allclose(w.grad, ref)


def test_a_table_reached_outside_embedding_lookups_is_marked_dense_for_the_pass(xp):
    from mpidl.autograd import current_backward_pass

    w = Tensor(_randn(xp, 5, 3, seed=13), requires_grad=True)
    ids = xp.asarray([[1, 2], [2, 4]])
    F.sum(F.embedding_bag(ids, w)).backward()  # lookups only: row-sparse
    assert w.dense_grad_pass != current_backward_pass()
    assert touched(w) == [1, 2, 4]
    h = F.embedding(ids, w)
    F.sum(F.matmul(h, F.transpose(w, (1, 0)))).backward()  # tied: a dense gradient too
    assert w.dense_grad_pass == current_backward_pass()


@pytest.mark.parametrize("n_ids", [0, 1, 40], ids=["no-ids", "one", "repeated"])
def test_segment_sum_writes_the_table_gradient_into_the_given_buffer(n_ids):
    # Data parallelism hands the table's gradient buffer to backward: the sum must land
    # there (no fresh 10 MB array, no copy), every row written, equal to a fresh one.
    from mpidl.functions.embedding import segment_sum

    rng = numpy.random.default_rng(0)
    vocab, dim = 30, 4
    ids = rng.integers(0, 6, size=n_ids)  # few ids, many tokens each
    rows = rng.standard_normal((n_ids, dim))
    fresh, touched = segment_sum(numpy, ids, rows, None, vocab)
    out = numpy.full((vocab, dim), numpy.nan)
    got, touched_out = segment_sum(numpy, ids, rows, None, vocab, out=out)
    assert got is out
    assert numpy.array_equal(out, fresh) and numpy.array_equal(touched_out, touched)
