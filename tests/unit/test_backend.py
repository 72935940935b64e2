"""The array-module helpers on NumPy (CuPy variants run where a GPU exists)."""
from __future__ import annotations

import os

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


def test_cpu_threads_are_shared_among_the_ranks_of_a_node():
    import os
    import subprocess
    import sys

    code = ("from mpidl.backend import limit_cpu_threads\n"
            "from threadpoolctl import threadpool_info\n"
            "n = limit_cpu_threads(ranks_on_node=64)\n"
            "print(n, {i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas'})")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "{1}"]  # 64 ranks on this node: one thread each
    user_set = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**env, "OMP_NUM_THREADS": "2"}, timeout=60)
    assert user_set.stdout.startswith("None")  # the user's setting wins


def test_freed_memory_is_kept_where_the_c_library_is_glibc():
    import platform
    import subprocess
    import sys

    code = "from mpidl.backend import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    glibc = platform.libc_ver()[0] == "glibc"
    assert out.stdout.strip() == str(glibc)


@pytest.mark.parametrize("keep", [True, False])
def test_data_parallel_keeps_freed_memory_unless_told_not_to(keep):
    # Behaviour, not the return value: a 16 MiB array freed after DataParallel is built
    # stays in the process (kept for the next step) or goes back to the kernel.
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc" or not os.path.exists("/proc/self/statm"):
        pytest.skip("the policy is glibc's; RSS is read from Linux's /proc")
    code = (
        "import numpy, mpidl.comm, mpidl.models as models\n"
        "from mpidl.parallel import DataParallel\n"
        f"DataParallel(models.build('mlp', seed=0), mpidl.comm.world(), keep_freed_memory={keep})\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "before = rss()\n"
        "a = numpy.ones(16 << 20, numpy.uint8)\n"
        "del a\n"
        "print((rss() - before) >> 20)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    kept_mib = int(out.stdout.split()[-1])
    assert (kept_mib >= 15) if keep else (kept_mib <= 2), kept_mib


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_zeros_add_at_adds_repeats_and_sums_float16_in_float32(xp, dtype):
    # 4096 adds of 1/4096 into one element: float16 adds stall at 0.5 (its spacing
    # there is larger than the addend); accumulated in float32 the sum is exactly 1.
    index = xp.asarray(numpy.r_[numpy.zeros(4096, dtype=numpy.int64), [2]])
    values = xp.asarray(numpy.r_[numpy.full(4096, 1 / 4096), [3.0]].astype(dtype))
    out = backend.zeros_add_at(xp, (4,), index, values)
    assert out.dtype == numpy.dtype(dtype)
    assert backend.as_numpy(out).tolist() == [1.0, 0.0, 3.0, 0.0]


def test_as_numpy_copies_a_device_array_not_its_memory_pointer():
    # A CuPy array's own .data is a MemoryPointer; only Tensors are unwrapped by .data.
    from mpidl.testing.fakedevice import fake_cupy

    with fake_cupy() as cp:
        x = cp.asarray(numpy.arange(3))
        assert backend.get_array_module(x) is cp
        assert numpy.array_equal(backend.as_numpy(x), numpy.arange(3))
    assert numpy.array_equal(backend.as_numpy(Tensor(numpy.arange(2))), numpy.arange(2))
