"""The host fast paths of the embedding functions against a dense ``add.at`` reference:
ids with one token, the rounds for ids with a few (chunked), frequent ids
(count-matrix GEMM and per-id sums), the chunked bag forward, and padding."""
from __future__ import annotations

import importlib

import numpy
import pytest

import mpidl.functions as F
from mpidl.autograd import Tensor

embedding_module = importlib.import_module("mpidl.functions.embedding")


@pytest.fixture
def small_chunks(monkeypatch):
    # Several chunks per round and per forward, with a short last chunk.
    monkeypatch.setattr(embedding_module, "_ROUND_CHUNK", 3)
    monkeypatch.setattr(embedding_module, "_GATHER_BLOCK", 50)


def touched(w):
    """The sorted ids of the rows ``w.grad_row_mask`` marks as touched."""
    return numpy.flatnonzero(w.grad_row_mask).tolist()


def _ids(kind, shape, vocab, seed):
    rng = numpy.random.default_rng(seed)
    if kind == "uniform":  # every id at most a few times: rounds only
        return rng.integers(0, vocab, size=shape)
    # zipf: a few ids far more often than _PASSES, most rare
    return numpy.minimum(rng.zipf(1.4, size=shape) - 1, vocab - 1).astype(numpy.int64)


@pytest.mark.parametrize("kind", ["uniform", "zipf"])
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
def test_embedding_bag_forward_and_backward_match_reference(small_chunks, kind, dtype):
    vocab, dim, bags, length = 40, 4, 13, 7
    rng = numpy.random.default_rng(1)
    w = Tensor(rng.standard_normal((vocab, dim)).astype(dtype), requires_grad=True)
    ids = _ids(kind, (bags, length), vocab, seed=2)
    g = rng.standard_normal((bags, dim)).astype(dtype)
    y = F.embedding_bag(ids, w)
    numpy.testing.assert_allclose(y.data, w.data[ids].mean(axis=1), rtol=1e-5, atol=1e-6)
    y.backward(g)
    ref = numpy.zeros((vocab, dim), dtype)
    numpy.add.at(ref, ids.reshape(-1), numpy.repeat(g / length, length, axis=0))
    numpy.testing.assert_allclose(w.grad, ref, rtol=1e-5, atol=1e-6)
    assert w.grad.dtype == dtype
    assert touched(w) == numpy.unique(ids).tolist()


@pytest.mark.parametrize("kind", ["uniform", "zipf"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_backward_matches_reference(small_chunks, kind, padding_idx):
    vocab, dim = 30, 3
    rng = numpy.random.default_rng(3)
    w = Tensor(rng.standard_normal((vocab, dim)), requires_grad=True)
    ids = _ids(kind, (6, 20), vocab, seed=4)
    g = rng.standard_normal((6, 20, dim))
    F.embedding(ids, w, padding_idx=padding_idx).backward(g)
    flat, rows = ids.reshape(-1), g.reshape(-1, dim)
    keep = numpy.ones(flat.size, bool) if padding_idx is None else flat != padding_idx
    ref = numpy.zeros((vocab, dim))
    numpy.add.at(ref, flat[keep], rows[keep])
    numpy.testing.assert_allclose(w.grad, ref, rtol=1e-12, atol=1e-12)
    assert touched(w) == numpy.unique(flat[keep]).tolist()


def test_frequent_ids_without_the_count_matrix(monkeypatch):
    # Many frequent ids and many distinct rows: the per-id BLAS sums, not the GEMM.
    monkeypatch.setattr(embedding_module, "_PASSES", 1)
    vocab, dim = 40, 2  # about 40 frequent ids x 200 rows > 16 x 200 tokens
    rng = numpy.random.default_rng(5)
    ids = rng.integers(0, vocab, size=200)
    rows = rng.standard_normal((200, dim))
    grad, mask = embedding_module.segment_sum(numpy, ids, rows, None, vocab)
    ref = numpy.zeros((vocab, dim))
    numpy.add.at(ref, ids, rows)
    numpy.testing.assert_allclose(grad, ref, rtol=1e-12, atol=1e-12)
    assert numpy.flatnonzero(mask).tolist() == numpy.unique(ids).tolist()


def test_table_gradient_is_adopted_then_accumulated_in_place():
    # Function.owned_grads: the fresh table gradient becomes .grad without a copy;
    # a second use in the same pass adds into it.
    w = Tensor(numpy.ones((5, 2)), requires_grad=True)
    y = F.embedding_bag(numpy.array([[1, 2]]), w) + F.embedding(numpy.array([2]), w)
    F.sum(y).backward()
    numpy.testing.assert_allclose(w.grad, [[0, 0], [0.5, 0.5], [1.5, 1.5], [0, 0], [0, 0]])


@pytest.mark.parametrize("bag", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_the_device_forms_give_the_host_gradients_without_size_dependent_ops(
        monkeypatch, bag, padding_idx):
    # On CuPy, unique/flatnonzero and boolean-mask writes read a size back to the host
    # (a sync per step). The device forms run here on NumPy (is_cupy patched), with
    # those functions forbidden, and must give the host path's numbers and rows.
    vocab, dim = 20, 3
    rng = numpy.random.default_rng(7)
    ids = rng.integers(0, vocab, size=(5, 6))
    ids[:, -2:] = 0  # padding tokens when padding_idx=0
    g = rng.standard_normal((5, dim) if bag else (5, 6, dim))
    table = rng.standard_normal((vocab, dim))
    lookup = F.embedding_bag if bag else F.embedding

    def run():
        w = Tensor(table.copy(), requires_grad=True)
        y = lookup(ids, w, padding_idx=padding_idx)
        y.backward(g)
        return y.data, w.grad, w.grad_row_mask

    host = run()

    def forbidden(*a, **k):
        raise AssertionError("a size-dependent op in a device form")

    monkeypatch.setattr(embedding_module, "is_cupy", lambda xp: True)
    for name in ("unique", "flatnonzero", "nonzero"):
        monkeypatch.setattr(numpy, name, forbidden)
    device = run()
    monkeypatch.undo()
    numpy.testing.assert_allclose(device[0], host[0], rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(device[1], host[1], rtol=1e-12, atol=1e-12)
    numpy.testing.assert_array_equal(device[2], host[2])
    assert padding_idx is None or not host[2][padding_idx]


def test_row_ids_are_compacted_on_the_device_from_the_count(monkeypatch):
    from mpidl.parallel import sparse

    mask = numpy.zeros(30, dtype=bool)
    mask[[0, 3, 4, 17, 29]] = True
    assert sparse.row_ids(mask, 5).tolist() == [0, 3, 4, 17, 29]
    monkeypatch.setattr(sparse, "is_cupy", lambda xp: True)
    assert sparse.row_ids(mask, 5).tolist() == [0, 3, 4, 17, 29]
    assert sparse.row_ids(numpy.zeros(4, dtype=bool), 0).tolist() == []
