"""Shape and indexing ops: forward against NumPy, backward against finite differences."""
from __future__ import annotations

import numpy
import pytest

import mpidl.functions as F
from mpidl.autograd import Tensor
from mpidl.backend import as_numpy
from mpidl.testing import allclose
from mpidl.testing.gradcheck import gradcheck


def _randn(xp, *shape, seed=0):
    return xp.asarray(numpy.random.default_rng(seed).standard_normal(shape))


def test_reshape(xp):
    a = _randn(xp, 2, 3, 4)
    assert F.reshape(Tensor(a), (4, -1)).shape == (4, 6)
    assert Tensor(a).reshape(6, 4).shape == (6, 4)
    assert gradcheck(lambda t: F.reshape(t, (3, 8)), [a])


@pytest.mark.parametrize("axes", [None, (2, 0, 1), (0, 2, 1), (-1, 0, 1)])
def test_transpose(xp, axes):
    a = _randn(xp, 2, 3, 4, seed=1)
    assert allclose(F.transpose(Tensor(a), axes).data, numpy.transpose(as_numpy(a), axes))
    assert gradcheck(lambda t: F.transpose(t, axes), [a])


def test_tensor_T_and_transpose_methods(xp):
    a = _randn(xp, 2, 3, seed=2)
    assert Tensor(a).T.shape == (3, 2)
    assert Tensor(a).transpose(1, 0).shape == (3, 2)


BASIC = [
    1,
    (slice(1, None), slice(None, None, 2)),
    (Ellipsis, 0),
    (None, slice(0, 2)),
    (-1, slice(None), 2),
]


@pytest.mark.parametrize("index", BASIC, ids=str)
def test_getitem_basic(xp, index):
    a = _randn(xp, 3, 4, 5, seed=3)
    assert allclose(F.getitem(Tensor(a), index).data, as_numpy(a)[index])
    assert gradcheck(lambda t: t[index], [a])


def test_getitem_integer_array_with_repeats_adds_gradients(xp):
    a = _randn(xp, 4, 3, seed=4)
    idx = xp.asarray([0, 2, 0, 0, 3])
    y = F.getitem(Tensor(a), idx)
    assert allclose(y.data, as_numpy(a)[as_numpy(idx)])
    x = Tensor(a, requires_grad=True)
    F.sum(x[idx]).backward()
    assert allclose(x.grad[:, 0], numpy.array([3.0, 0.0, 1.0, 1.0]))
    assert gradcheck(lambda t: t[idx], [a])


def test_getitem_takes_a_host_index_on_any_device(xp):
    # Labels and ids come from the loader as NumPy arrays, also for a CuPy model.
    a = _randn(xp, 4, 3, seed=4)
    idx = numpy.array([0, 2, 0, 3])
    t = Tensor(a, requires_grad=True)
    y = F.getitem(t, (idx, numpy.array([1, 1, 2, 0])))
    assert allclose(y.data, as_numpy(a)[idx, [1, 1, 2, 0]])
    F.sum(y).backward()
    expected = numpy.zeros((4, 3))
    numpy.add.at(expected, (idx, [1, 1, 2, 0]), 1.0)
    assert allclose(t.grad, expected)


def test_getitem_mixed_integer_arrays_and_slices(xp):
    a = _randn(xp, 4, 3, 2, seed=5)
    rows, cols = xp.asarray([0, 2, 0]), xp.asarray([1, 1, 1])
    assert allclose(F.getitem(Tensor(a), (rows, cols)).data,
                    as_numpy(a)[as_numpy(rows), as_numpy(cols)])
    assert gradcheck(lambda t: t[rows, cols], [a])
    assert gradcheck(lambda t: t[:, xp.asarray([2, 2, 0])], [a])


def test_getitem_boolean_mask(xp):
    a = _randn(xp, 4, 3, seed=6)
    mask = xp.asarray([True, False, True, True])
    assert allclose(F.getitem(Tensor(a), mask).data, as_numpy(a)[as_numpy(mask)])
    assert gradcheck(lambda t: t[mask], [a])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(xp, axis):
    shapes = {0: [(1, 3), (2, 3), (3, 3)], 1: [(2, 1), (2, 2), (2, 4)],
              -1: [(2, 1), (2, 2), (2, 4)]}
    arrays = [_randn(xp, *s, seed=i) for i, s in enumerate(shapes[axis])]
    y = F.concat([Tensor(a) for a in arrays], axis=axis)
    assert allclose(y.data, numpy.concatenate([as_numpy(a) for a in arrays], axis=axis))
    assert gradcheck(lambda *ts: F.concat(ts, axis=axis), arrays)


def test_concat_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        F.concat([])


def test_stack_and_broadcast_to(xp):
    a, b = _randn(xp, 2, 3, seed=7), _randn(xp, 2, 3, seed=8)
    assert allclose(F.stack([Tensor(a), Tensor(b)], axis=1).data,
                    numpy.stack([as_numpy(a), as_numpy(b)], axis=1))
    assert gradcheck(lambda s, t: F.stack([s, t], axis=1), [a, b])
    c = _randn(xp, 3, 1, seed=9)
    assert F.broadcast_to(Tensor(c), (2, 3, 4)).shape == (2, 3, 4)
    assert gradcheck(lambda t: F.broadcast_to(t, (2, 3, 4)), [c])
