"""The array-module helpers on NumPy (CuPy variants run where a GPU exists)."""
from __future__ import annotations

import numpy
import pytest

from mpidl import backend
from mpidl.autograd import Tensor


def test_get_array_module_is_numpy_for_numpy_scalars_tensors_and_none():
    assert backend.get_array_module(numpy.zeros(2), 3.0, None, Tensor(numpy.ones(1))) is numpy


def test_as_numpy_and_to_device_round_trip(xp):
    x = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    on_device = backend.to_device(x, xp)
    assert backend.get_array_module(on_device) is xp
    back = backend.as_numpy(on_device)
    assert isinstance(back, numpy.ndarray) and numpy.array_equal(back, x)


def test_synchronize_is_a_no_op_for_numpy():
    backend.synchronize(numpy.zeros(3))
    backend.synchronize()


def test_get_xp_names_the_extra_when_cupy_is_missing():
    if backend.cupy_module() is not None:
        pytest.skip("CuPy is installed here")
    with pytest.raises(RuntimeError, match=r"mpidl\[gpu\]"):
        backend.get_xp("cupy")
    assert backend.get_xp("numpy") is numpy


def test_get_xp_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown array backend 'tpu'"):
        backend.get_xp("tpu")


def test_select_device_without_gpu_returns_none():
    if backend.cupy_module() is not None:
        pytest.skip("CuPy is installed here")
    assert backend.select_device(0) is None
