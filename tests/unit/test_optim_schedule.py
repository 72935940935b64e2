"""Learning-rate schedules and gradient clipping."""
import math

import numpy
import pytest

from mpidl.nn import Parameter
from mpidl.optim import clip_grad_norm_, linear_scaling_rule, warmup_cosine, warmup_linear
from mpidl.testing import allclose


def test_warmup_cosine_rises_then_decays_to_min_lr():
    lrs = [warmup_cosine(s, 110, 10, base_lr=1.0, min_lr=0.1) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0)
    # Halfway through the decay the cosine is at its midpoint.
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5)
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_warmup_linear_decays_linearly():
    assert warmup_linear(0, 100, 0, base_lr=2.0) == 2.0
    assert warmup_linear(50, 100, 0, base_lr=2.0) == pytest.approx(1.0)
    assert warmup_linear(100, 100, 0, base_lr=2.0) == 0.0
    assert warmup_linear(4, 100, 5, base_lr=2.0) == pytest.approx(2.0)


def test_schedule_errors_name_the_value():
    with pytest.raises(ValueError, match="warmup_steps.*200"):
        warmup_cosine(0, 100, 200, 1.0)
    with pytest.raises(ValueError, match="-1"):
        warmup_linear(-1, 100, 0, 1.0)


def test_linear_scaling_rule_scales_with_global_batch():
    assert linear_scaling_rule(0.1, 1024) == pytest.approx(0.4)
    assert linear_scaling_rule(0.1, 8 * 32, base_batch=32) == pytest.approx(0.8)


def grads_of(*arrays):
    ps = []
    for a in arrays:
        p = Parameter(numpy.zeros_like(a))
        p.grad = a.copy()
        ps.append(p)
    return ps


def test_clip_grad_norm_scales_to_max_norm_and_returns_the_norm():
    ps = grads_of(numpy.array([3.0, 0.0]), numpy.array([[4.0]]))
    views = [p.grad for p in ps]
    norm = clip_grad_norm_(ps, max_norm=1.0)
    assert float(norm) == pytest.approx(5.0)
    assert allclose(ps[0].grad, numpy.array([0.6, 0.0]), scale=1e4)
    assert allclose(ps[1].grad, numpy.array([[0.8]]), scale=1e4)
    assert all(p.grad is v for p, v in zip(ps, views)), "gradients must be scaled in place"


def test_clip_grad_norm_leaves_small_gradients_alone():
    ps = grads_of(numpy.array([0.3, 0.4], dtype=numpy.float32))
    norm = clip_grad_norm_(ps, max_norm=1.0)
    assert float(norm) == pytest.approx(0.5) and norm.dtype == numpy.float32
    numpy.testing.assert_array_equal(ps[0].grad, numpy.array([0.3, 0.4], dtype=numpy.float32))


@pytest.mark.extra("torch")
def test_clip_grad_norm_matches_torch():
    torch = pytest.importorskip("torch")
    rng = numpy.random.default_rng(1)
    arrays = [rng.standard_normal(s).astype(numpy.float32) for s in [(5, 3), (3,), (2, 2, 2)]]
    ps = grads_of(*arrays)
    tps = [torch.nn.Parameter(torch.zeros(a.shape)) for a in arrays]
    for t, a in zip(tps, arrays):
        t.grad = torch.from_numpy(a.copy())
    norm = clip_grad_norm_(ps, 0.5)
    tnorm = torch.nn.utils.clip_grad_norm_(tps, 0.5)
    assert math.isclose(float(norm), float(tnorm), rel_tol=1e-5)
    for p, t in zip(ps, tps):
        assert allclose(p.grad, t.grad.numpy())
