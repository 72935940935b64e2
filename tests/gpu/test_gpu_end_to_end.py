"""The GPU path end to end, on a machine with CuPy and a CUDA GPU (skipped elsewhere).

    python -m pytest -m gpu tests/gpu                      # one process
    mpiexec -n 2 python -m pytest -m gpu tests/gpu         # through MPI as well

A tiny model's forward and backward on CuPy match NumPy's; its gradient goes through
the world communicator (CUDA-aware or host-staged, whichever the probe chose); and
``python -m hpc.gpu_check --require-gpu`` passes.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy
import pytest

from hpc import gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(gpu.cupy_module() is None or not gpu.device_count(),
                       reason="needs CuPy and a CUDA GPU"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _loss_and_grads(xp, x, labels):
    from mpidl import functions as F
    from mpidl.nn.linear import Linear

    layer = Linear(8, 3, seed=0, dtype="float64").to(xp)
    loss = F.softmax_cross_entropy(layer(xp.asarray(x)), xp.asarray(labels))
    loss.backward()
    return loss, [p.grad for p in layer.parameters()]


def test_forward_and_backward_on_cupy_match_numpy():
    from mpidl.backend import as_numpy
    from mpidl.testing import tolerance

    cp = gpu.cupy_module()
    gpu.bind()
    rng = numpy.random.default_rng(0)
    x, labels = rng.standard_normal((5, 8)), rng.integers(0, 3, 5)
    loss_np, grads_np = _loss_and_grads(numpy, x, labels)
    loss_cp, grads_cp = _loss_and_grads(cp, x, labels)
    assert all(type(g).__module__.startswith("cupy") for g in grads_cp)
    rtol, atol = tolerance(numpy.float64)
    numpy.testing.assert_allclose(as_numpy(loss_cp.data), loss_np.data, rtol=rtol, atol=atol)
    for g_cp, g_np in zip(grads_cp, grads_np):
        numpy.testing.assert_allclose(as_numpy(g_cp), g_np, rtol=rtol, atol=atol)


def test_cupy_gradient_allreduce_through_the_world_communicator():
    from mpidl.comm import world
    from mpidl.testing import assert_allclose_all_ranks

    cp = gpu.cupy_module()
    comm = world()
    gpu.bind(comm.local_rank)
    g = cp.full(1000, comm.rank + 1.0, dtype=cp.float32)
    comm.allreduce_(g)
    expected = numpy.full(1000, comm.size * (comm.size + 1) / 2, dtype=numpy.float32)
    assert_allclose_all_ranks(comm, g, expected, what="cupy allreduce_")


def test_gpu_check_script_passes_on_this_machine():
    from hpc.cuda_aware import singleton_environ

    env = dict(singleton_environ(), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "hpc.gpu_check", "--require-gpu"],
                         capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout
