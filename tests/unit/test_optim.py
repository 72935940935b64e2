"""Optimizers against hand-computed reference values (and torch.optim when installed)."""
import math

import numpy
import pytest

from mpidl.nn import Parameter
from mpidl.optim import SGD, Adam, AdamW
from mpidl.testing import allclose

# A fixed sequence of gradients for a 3-element parameter, applied over 4 steps.
P0 = [1.0, -2.0, 0.5]
GRADS = [[0.5, -1.0, 0.25], [0.1, 0.3, -0.2], [-0.4, 0.2, 0.05], [0.0, -0.7, 0.6]]


def run(make_opt, dtype=numpy.float64, steps=len(GRADS)):
    p = Parameter(numpy.array(P0, dtype=dtype))
    opt = make_opt([p])
    data_id = id(p.data)
    for g in GRADS[:steps]:
        p.grad = numpy.array(g, dtype=dtype)
        opt.step()
    assert id(p.data) == data_id, "the optimizer replaced p.data instead of updating it"
    return p.data, opt


def sgd_reference(lr, momentum=0.0, nesterov=False, weight_decay=0.0):
    """Scalar loops over the formulas of torch.optim.SGD's documentation."""
    out = []
    for j, p in enumerate(P0):
        buf = None
        for g_all in GRADS:
            g = g_all[j] + weight_decay * p
            if momentum:
                buf = g if buf is None else momentum * buf + g
                g = g + momentum * buf if nesterov else buf
            p = p - lr * g
        out.append(p)
    return numpy.array(out)


def adam_reference(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False):
    out = []
    for j, p in enumerate(P0):
        m = v = 0.0
        for t, g_all in enumerate(GRADS, start=1):
            g = g_all[j]
            if decoupled:
                p = p * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * p
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat = m / (1 - b1 ** t)
            v_hat = v / (1 - b2 ** t)
            p = p - lr * m_hat / (math.sqrt(v_hat) + eps)
        out.append(p)
    return numpy.array(out)


@pytest.mark.parametrize("kwargs", [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True},
    {"weight_decay": 0.1},
    {"momentum": 0.8, "weight_decay": 0.05, "nesterov": True},
])
def test_sgd_matches_reference_formulas(kwargs):
    got, _ = run(lambda ps: SGD(ps, lr=0.1, **kwargs))
    assert allclose(got, sgd_reference(0.1, **kwargs))


def test_sgd_first_step_by_hand():
    # p - lr * g: 1 - 0.1 * 0.5, -2 + 0.1, 0.5 - 0.025
    got, _ = run(lambda ps: SGD(ps, lr=0.1), steps=1)
    assert allclose(got, numpy.array([0.95, -1.9, 0.475]))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_reference_formulas(weight_decay):
    got, _ = run(lambda ps: Adam(ps, lr=0.01, weight_decay=weight_decay))
    assert allclose(got, adam_reference(0.01, weight_decay=weight_decay))


def test_adamw_decays_decoupled_from_the_gradient():
    got, _ = run(lambda ps: AdamW(ps, lr=0.01, weight_decay=0.1))
    assert allclose(got, adam_reference(0.01, weight_decay=0.1, decoupled=True))
    assert not allclose(got, adam_reference(0.01, weight_decay=0.1, decoupled=False))


def test_adam_first_step_moves_each_weight_by_lr():
    # After one step m_hat = g and v_hat = g^2, so the update is lr * g / |g| (eps = 0).
    got, _ = run(lambda ps: Adam(ps, lr=0.1, eps=0.0), steps=1)
    assert allclose(got, numpy.array([0.9, -1.9, 0.4]))


def test_update_leaves_gradient_untouched_and_float32_stays_float32():
    p = Parameter(numpy.ones(4, dtype=numpy.float32))
    g = numpy.full(4, 0.5, dtype=numpy.float32)
    p.grad = g
    for opt in (SGD([p], lr=0.1, momentum=0.9, weight_decay=0.1), Adam([p]), AdamW([p])):
        opt.step()
        assert p.data.dtype == numpy.float32 and p.grad is g
        assert numpy.all(g == 0.5)


def test_zero_grad_drops_by_default_and_fills_in_place_on_request():
    p = Parameter(numpy.ones(3))
    bucket = numpy.ones(5)
    p.grad = bucket[1:4]  # a view, as data parallelism makes them
    opt = SGD([p], lr=0.1)
    opt.zero_grad(set_to_none=False)
    assert p.grad.base is bucket and numpy.all(bucket == [1, 0, 0, 0, 1])
    opt.zero_grad()
    assert p.grad is None


def test_parameters_without_grad_are_skipped():
    a, b = Parameter(numpy.ones(2)), Parameter(numpy.ones(2))
    a.grad = numpy.ones(2)
    opt = Adam([a, b], lr=0.1)
    opt.step()
    assert numpy.all(b.data == 1) and "state.1.exp_avg" not in opt.state_dict()


@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: Adam(ps, lr=0.01),
    lambda ps: AdamW(ps, lr=0.01),
])
def test_state_dict_round_trip_resumes_exactly(make):
    straight, _ = run(make)
    p = Parameter(numpy.array(P0))
    opt = make([p])
    for g in GRADS[:2]:
        p.grad = numpy.array(g)
        opt.step()
    saved = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in opt.state_dict().items()}
    assert saved["step"] == 2 and all(isinstance(v, (int, float, numpy.ndarray))
                                      for v in saved.values())
    p2 = Parameter(p.data.copy())
    opt2 = make([p2])
    opt2.load_state_dict(saved)
    for g in GRADS[2:]:
        p2.grad = numpy.array(g)
        opt2.step()
    numpy.testing.assert_array_equal(p2.data, straight)


def test_load_state_dict_names_bad_keys_and_shapes():
    p = Parameter(numpy.ones(3))
    opt = Adam([p])
    with pytest.raises(KeyError, match="step"):
        opt.load_state_dict({"lr": 0.1})
    with pytest.raises(KeyError, match="state.1.exp_avg"):
        opt.load_state_dict({"step": 1, "lr": 0.1, "state.1.exp_avg": numpy.ones(3)})
    with pytest.raises(ValueError, match=r"\(4,\).*\(3,\)"):
        opt.load_state_dict({"step": 1, "lr": 0.1, "state.0.exp_avg": numpy.ones(4)})


def test_lr_attribute_drives_the_step():
    p = Parameter(numpy.zeros(1))
    p.grad = numpy.ones(1)
    opt = SGD([p], lr=1.0)
    opt.lr = 0.25
    opt.step()
    assert p.data[0] == -0.25 and opt.state_dict()["lr"] == 0.25


def test_constructor_errors_name_the_value():
    p = Parameter(numpy.ones(1))
    with pytest.raises(ValueError, match="-1"):
        SGD([p], lr=-1)
    with pytest.raises(ValueError, match="nesterov"):
        SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="empty"):
        Adam([])


@pytest.mark.parametrize("name,kwargs", [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("Adam", {"lr": 0.01, "weight_decay": 0.01}),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
])
@pytest.mark.extra("torch")
def test_matches_torch_optim_in_float32(name, kwargs):
    torch = pytest.importorskip("torch")
    import mpidl.optim

    rng = numpy.random.default_rng(0)
    p0 = rng.standard_normal((7, 5)).astype(numpy.float32)
    grads = rng.standard_normal((6, 7, 5)).astype(numpy.float32)
    p = Parameter(p0.copy())
    opt = getattr(mpidl.optim, name)([p], **kwargs)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    topt = getattr(torch.optim, name)([tp], **kwargs)
    for g in grads:
        p.grad = g.copy()
        opt.step()
        tp.grad = torch.from_numpy(g.copy())
        topt.step()
    assert allclose(p.data, tp.detach().numpy())


@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda ps: Adam(ps, lr=0.01, weight_decay=0.01),
    lambda ps: AdamW(ps, lr=0.01),
])
def test_blocked_update_of_a_large_parameter_equals_the_whole_array_update(make, monkeypatch):
    import mpidl.optim.optimizer as base

    rng = numpy.random.default_rng(0)
    p0 = rng.standard_normal((3, base.BLOCK + 5)).astype(numpy.float32)  # 3+ blocks
    grads = rng.standard_normal((2, *p0.shape)).astype(numpy.float32)

    def train():
        p = Parameter(p0.copy())
        opt = make([p])
        for g in grads:
            p.grad = g
            opt.step()
        return p.data

    blocked = train()
    monkeypatch.setattr(base, "BLOCK", p0.size)
    numpy.testing.assert_array_equal(blocked, train())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_cupy_updates_equal_numpy_updates(name):
    from mpidl.backend import cupy_module

    cp = cupy_module()
    if cp is None:
        pytest.skip("needs CuPy and a GPU")
    import mpidl.optim

    kwargs = {"lr": 0.01, "momentum": 0.9} if name == "SGD" else {"lr": 0.01}
    rng = numpy.random.default_rng(0)
    p0 = rng.standard_normal((300, 500)).astype(numpy.float32)
    grads = rng.standard_normal((3, 300, 500)).astype(numpy.float32)
    results = []
    for xp in (numpy, cp):
        p = Parameter(xp.asarray(p0))
        opt = getattr(mpidl.optim, name)([p], **kwargs)
        for g in grads:
            p.grad = xp.asarray(g)
            opt.step()
        results.append(p.data)
    assert allclose(results[1], results[0])


def test_the_dynamic_loss_scale_backs_off_on_overflow_and_grows_after_good_steps():
    from mpidl.optim import DynamicLossScale

    s = DynamicLossScale(init=1024.0, growth_interval=3, min_scale=256.0)
    assert s.update(False) and s.scale == 512.0
    assert s.update(False) and s.scale == 256.0 and s.at_minimum
    assert not s.update(False) and s.scale == 256.0      # never below the minimum
    assert [s.update(True) for _ in range(3)] == [False, False, True] and s.scale == 512.0
    copy = DynamicLossScale()
    copy.load_state_dict(s.state_dict())
    assert (copy.scale, copy.good_steps) == (512.0, 0)
    with pytest.raises(ValueError, match="need init >= min_scale"):
        DynamicLossScale(init=0.5)


def test_an_overflow_starts_the_count_of_good_steps_again():
    from mpidl.optim import DynamicLossScale

    s = DynamicLossScale(init=1024.0, growth_interval=3)
    assert [s.update(True) for _ in range(2)] == [False, False]  # one short of growing
    assert s.update(False) and s.scale == 512.0
    assert [s.update(True) for _ in range(2)] == [False, False] and s.scale == 512.0
    assert s.update(True) and s.scale == 1024.0  # three good steps since the overflow


def test_unscale_divides_every_gradient_in_place():
    from mpidl.optim import DynamicLossScale, unscale_

    p = Parameter(numpy.ones(3, dtype=numpy.float16))
    p.grad = numpy.full(3, 1024.0, dtype=numpy.float16)
    view = p.grad
    unscale_([p, Parameter(numpy.ones(2))], DynamicLossScale(init=512.0))
    assert p.grad is view and numpy.array_equal(p.grad, numpy.full(3, 2.0, numpy.float16))


@pytest.mark.parametrize("make", [lambda ps: Adam(ps, lr=1e-3),
                                  lambda ps: AdamW(ps, lr=1e-3, weight_decay=0.1)],
                         ids=["Adam", "AdamW"])
def test_float16_parameters_take_the_float32_step_rounded_once(make):
    # In float16, eps=1e-8 is 0 and m = v = 0 gave 0/0: [nan, -inf, nan, 0.999].
    grads = [[0, 1e-3, 0, 1], [0.5, -2e-3, 0, 1], [1e-4, 0.25, -3.0, 0]]
    half = Parameter(numpy.ones(4, dtype=numpy.float16))
    opt = make([half])
    ref = Parameter(numpy.ones(4, dtype=numpy.float32))  # float32 state, float32 step
    ref_opt = make([ref])
    for g in grads:
        half.grad = numpy.array(g, dtype=numpy.float16)
        opt.step()
        ref.grad = half.grad.astype(numpy.float32)
        ref_opt.step()
        expected = ref.data.astype(numpy.float16)
        ref.data[...] = expected  # the float16 parameter holds the rounded value
        assert half.data.dtype == numpy.float16 and numpy.isfinite(half.data).all()
        numpy.testing.assert_array_equal(half.data, expected)
    assert opt.state[0]["exp_avg"].dtype == opt.state[0]["exp_avg_sq"].dtype == numpy.float32


def test_float16_adam_state_reloads_as_float32_and_continues_alike():
    grads = [numpy.array(g, dtype=numpy.float16) for g in ([0, 1e-3, 1], [2, -1e-2, 0])]
    p = Parameter(numpy.ones(3, dtype=numpy.float16))
    opt = Adam([p], lr=1e-2)
    p.grad = grads[0]
    opt.step()
    saved = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in opt.state_dict().items()}
    q = Parameter(p.data.copy())
    fresh = Adam([q], lr=1e-2)
    fresh.load_state_dict(saved)
    assert fresh.state[0]["exp_avg"].dtype == numpy.float32
    p.grad, q.grad = grads[1], grads[1].copy()
    opt.step()
    fresh.step()
    numpy.testing.assert_array_equal(q.data, p.data)
