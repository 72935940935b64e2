"""The GPU path end to end, on a machine with CuPy and a CUDA GPU (skipped elsewhere).

    python -m pytest -m gpu tests/gpu                      # one process
    mpiexec -n 2 python -m pytest -m gpu tests/gpu         # through MPI as well

A tiny model's forward and backward on CuPy match NumPy's; its gradient goes through
the world communicator (CUDA-aware or host-staged, whichever mpidl.comm.device chose),
non-blocking too; forward and backward of a training step make no host
synchronisation; host labels are checked, float16 Adam stays finite, the step timer
reads events; and ``python -m hpc.gpu_check --require-gpu`` passes. The tests of
tests/unit that take the ``xp`` fixture run on CuPy here too (marked ``gpu``).
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


def test_cupy_iallreduce_through_the_world_communicator_is_staged_and_right():
    # Open MPI cannot take device pointers in non-blocking reductions; mpidl stages
    # them whatever the probe says (mpidl.comm.device).
    from mpidl.comm import world
    from mpidl.testing import assert_allclose_all_ranks

    cp = gpu.cupy_module()
    comm = world()
    gpu.bind(comm.local_rank)
    buckets = [cp.full(n, comm.rank + 1.0, dtype=cp.float32) for n in (1000, 3, 70000)]
    requests = [comm.iallreduce_(b) for b in buckets]
    for r in requests:
        r.wait()
    total = comm.size * (comm.size + 1) / 2
    for b in buckets:
        assert_allclose_all_ranks(comm, b, numpy.full(b.size, total, numpy.float32))


def test_forward_and_backward_of_a_training_step_wait_for_the_gpu_nowhere():
    # Embedding with padding, embedding bag, attention with a host mask, dropout,
    # cross-entropy with host labels: no host synchronisation without communication.
    from hpc.gpu_check import SyncCounter
    from mpidl.comm import world
    from mpidl.testing import assert_all_ranks
    from mpidl.testing.device_step import build

    cp = gpu.cupy_module()
    comm = world()
    gpu.bind(comm.local_rank)
    phases = build(cp, comm)
    for _ in range(2):
        phases["forward+backward"]()
    with SyncCounter(cp) as counter:
        for _ in range(3):
            phases["forward+backward"]()
    assert_all_ranks(comm, not counter.sites, counter.summary(3))
    phases["step"]()  # and the full step runs


def test_out_of_range_host_labels_raise_with_device_logits():
    from mpidl import functions as F
    from mpidl.autograd import Tensor

    cp = gpu.cupy_module()
    gpu.bind()
    with pytest.raises(ValueError, match="label 3 is out of range for 3 classes"):
        F.softmax_cross_entropy(Tensor(cp.zeros((2, 3))), numpy.array([0, 3]))


def test_the_device_clock_times_gpu_work_without_a_host_wait():
    from hpc.gpu_check import SyncCounter
    from mpidl.backend import device_clock
    from mpidl.train.metrics import StepTimer

    cp = gpu.cupy_module()
    gpu.bind()
    timer = StepTimer(clock=device_clock(cp))
    a = cp.ones((2048, 2048), dtype=cp.float32)
    with SyncCounter(cp) as counter:
        for _ in range(3):
            with timer.step():
                for _ in range(4):
                    a = a @ a / 2048.0
    assert not counter.sites, counter.summary(3)
    timer.flush()
    assert timer.steps == 3 and timer.last.total > 0


def test_float16_adam_on_cupy_equals_numpy():
    from mpidl.backend import as_numpy
    from mpidl.nn import Parameter
    from mpidl.optim import Adam

    cp = gpu.cupy_module()
    gpu.bind()
    grads = numpy.array([[0, 1e-3, 0, 1], [0.5, -2e-3, 0, 1]], dtype=numpy.float16)
    results = []
    for xp in (numpy, cp):
        p = Parameter(xp.ones(4, dtype=xp.float16))
        opt = Adam([p], lr=1e-3)
        for g in grads:
            p.grad = xp.asarray(g)
            opt.step()
        results.append(as_numpy(p.data))
    assert numpy.isfinite(results[1]).all()
    numpy.testing.assert_allclose(results[1], results[0], rtol=1e-3, atol=1e-3)
