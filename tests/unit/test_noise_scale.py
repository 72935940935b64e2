"""The gradient noise scale estimator (McCandlish et al. 2018, A.1) on synthetic
per-sample gradients of known mean and covariance, and the local norms it reads."""
from __future__ import annotations

import numpy
import pytest

from mpidl.autograd import Tensor
from mpidl.train.noise import LocalGradients, NoiseScale


def steps(mean, scale, shares, rng, count):
    """``count`` data-parallel steps of per-sample gradients ``mean + scale * z``: the
    estimator's inputs per step (ranks' mean |G_b|^2, mean 1/b, |G_B|^2, B)."""
    z = mean + scale * rng.standard_normal((count, sum(shares), mean.size))
    edges = numpy.cumsum([0] + list(shares))
    small = numpy.stack([z[:, a:b].mean(axis=1) for a, b in zip(edges, edges[1:])])
    big = z.mean(axis=1)
    small_sq = (small ** 2).sum(axis=2).mean(axis=0)
    inv = float(numpy.mean([1.0 / b for b in shares]))
    return [(float(s), inv, float(g @ g), sum(shares)) for s, g in zip(small_sq, big)]


@pytest.mark.parametrize("shares", [[16, 16], [16, 16, 16], [10, 17, 23]])
def test_the_estimate_finds_a_known_noise_scale(shares):
    rng = numpy.random.default_rng(0)
    dim, scale = 20, 0.5
    mean = rng.standard_normal(dim) * 0.2
    expected = dim * scale ** 2 / float(mean @ mean)  # tr(Sigma) / |G|^2
    est = NoiseScale(decay=0.99)
    for inputs in steps(mean, scale, shares, rng, 1500):
        value = est.update(*inputs)
    assert value == pytest.approx(expected, rel=0.1)
    assert est.signal == pytest.approx(float(mean @ mean), rel=0.1)


def test_one_rank_gives_no_estimate_and_a_checkpoint_keeps_the_averages():
    est = NoiseScale()
    assert est.update(1.0, 1 / 8, 1.0, 8) is None and est.value is None
    assert est.update(2.0, 1 / 8, 1.5, 16) == pytest.approx(8.0)  # tr 8, |G|^2 1
    again = NoiseScale()
    again.load_state_dict(est.state_dict())
    assert again.value == est.value is not None
    with pytest.raises(ValueError, match="decay"):
        NoiseScale(decay=1.0)


def test_local_gradients_sum_each_parameters_squares_once_per_backward():
    a = Tensor(numpy.array([1.0, 2.0]), requires_grad=True)
    b = Tensor(numpy.array([[3.0]]), requires_grad=True)
    local = LocalGradients([a, b])
    ((a * a).sum() + (b * 2.0).sum()).backward()   # grads (2, 4) and (2,)
    assert local.take() == pytest.approx(4 + 16 + 4)
    assert local.take() == 0.0
    local.remove()
    (a * a).sum().backward()
    assert local.take() == 0.0
