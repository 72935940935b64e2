"""fp32 master weights (mpidl.optim.MasterWeights) around every optimizer, and the
bfloat16 arithmetic quirks the engine converts at the boundary."""
from __future__ import annotations

import numpy
import pytest

from mpidl import backend
from mpidl.autograd import Tensor
from mpidl.functions import layer_norm, softmax_cross_entropy
from mpidl.models import gpt
from mpidl.nn import Linear
from mpidl.nn.module import Parameter
from mpidl.optim import LAMB, LARS, SGD, Adam, AdamW, MasterWeights

BF16 = backend.bfloat16()
HALVES = {"fp16": numpy.dtype(numpy.float16), "bf16": BF16}
OPTIMIZERS = {"sgd": (SGD, {"lr": 0.1, "momentum": 0.9}), "adam": (Adam, {"lr": 1e-2}),
              "adamw": (AdamW, {"lr": 1e-2}), "lars": (LARS, {"lr": 5.0}),
              "lamb": (LAMB, {"lr": 1e-2})}


def small_gpt(half=None):
    model = gpt(vocab=23, seq_len=8, dim=8, layers=1, heads=2, seed=3)
    return model.half_(half) if half is not None else model


def train(model, opt, steps=3):
    rng = numpy.random.default_rng(0)
    for _ in range(steps):
        ids = rng.integers(0, 23, size=(4, 8))
        loss = model.loss(ids, reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss


@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_masters_stay_fp32_and_the_half_parameters_are_their_rounding(name, half):
    cls, kw = OPTIMIZERS[name]
    model = small_gpt(HALVES[half])
    before = [p.data.copy() for p in model.parameters()]
    opt = MasterWeights(cls(model.parameters(), **kw))
    train(model, opt)
    finer = 0
    for p, m, b in zip(model.parameters(), opt.masters, before):
        assert m.data.dtype == numpy.float32 and p.data.dtype == HALVES[half]
        assert numpy.array_equal(p.data.view(numpy.uint16),
                                 m.data.astype(HALVES[half]).view(numpy.uint16))
        assert not numpy.array_equal(p.data, b)  # every tensor was updated
        finer += int((m.data != p.data.astype(numpy.float32)).sum())
    assert finer > 0  # the masters hold what the half copies cannot
    for key, value in opt.state_dict().items():
        if hasattr(value, "dtype"):
            assert value.dtype == numpy.float32, key


@pytest.mark.parametrize("half", sorted(HALVES))
def test_updates_below_half_an_ulp_accumulate_in_the_master(half):
    """lr 1e-3 on a weight of 1: the update is below bfloat16's half ulp (2**-8), so a
    half parameter updated in place never moves, and the master does."""
    dtype = HALVES[half]
    plain, mastered = (Parameter(numpy.ones(4, dtype=dtype)) for _ in range(2))
    opt_plain = SGD([plain], lr=1e-3 if half == "bf16" else 1e-4)
    opt = MasterWeights(SGD([mastered], lr=1e-3 if half == "bf16" else 1e-4))
    for _ in range(100):
        for p in (plain, mastered):
            p.grad = numpy.ones(4, dtype=dtype)
        opt_plain.step()
        opt.step()
    assert (plain.data == 1).all()
    want = 1 - 100 * (1e-3 if half == "bf16" else 1e-4)
    numpy.testing.assert_allclose(opt.masters[0].data, want, rtol=1e-5)
    assert (mastered.data == numpy.float32(want).astype(dtype)).all()


def test_the_state_dict_holds_the_masters_and_a_load_continues_exactly():
    model = small_gpt(BF16)
    opt = MasterWeights(AdamW(model.parameters(), lr=1e-2))
    train(model, opt, steps=2)
    state = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in opt.state_dict().items()}
    assert {k.rsplit(".", 1)[1] for k in state if k.startswith("state.")} == {
        "exp_avg", "exp_avg_sq", "step", "master"}
    values = [p.data.copy() for p in model.parameters()]
    train(model, opt, steps=1)
    again = small_gpt(BF16)
    for p, v in zip(again.parameters(), values):
        p.data[...] = v
    opt2 = MasterWeights(AdamW(again.parameters(), lr=1e-2))
    opt2.load_state_dict(state)
    train(again, opt2, steps=1)  # the same third batch: seeded alike
    for a, b in zip(model.parameters(), again.parameters()):
        assert numpy.array_equal(a.data.view(numpy.uint16), b.data.view(numpy.uint16))


def test_a_stepped_optimizer_is_refused():
    model = small_gpt(BF16)
    opt = SGD(model.parameters(), lr=0.1)
    train(model, opt, steps=1)
    with pytest.raises(ValueError, match="taken steps already"):
        MasterWeights(opt)


# -- bfloat16 on NumPy: what ml_dtypes lacks, converted at the boundary --------------------

def test_numpy_bfloat16_matmul_returns_float32_and_the_engine_rounds_it_back():
    rng = numpy.random.default_rng(0)
    a, b = rng.standard_normal((2, 16, 16)).astype(BF16)
    assert (a @ b).dtype == numpy.float32  # ml_dtypes' quirk, measured
    y = backend.matmul(a, b)
    assert y.dtype == BF16
    want = (a.astype(numpy.float32) @ b.astype(numpy.float32)).astype(BF16)
    assert numpy.array_equal(y.view(numpy.uint16), want.view(numpy.uint16))
    out = numpy.empty((16, 16), numpy.float32)  # a float32 gradient bucket
    assert backend.matmul(a, b, out=out) is out
    numpy.testing.assert_allclose(out, a.astype(numpy.float32) @ b.astype(numpy.float32),
                                  rtol=1e-6)


def test_bfloat16_sums_are_taken_in_float32():
    ones = numpy.ones(4096, dtype=BF16)
    assert float(ones.sum()) == 256  # every bfloat16 add rounds: the sum stops growing
    layer = Linear(1, 1, dtype=BF16, seed=0)  # the bias gradient: a column sum of gy
    layer.half_(BF16)
    y = layer(Tensor(numpy.ones((4096, 1), dtype=BF16)))
    y.backward(numpy.ones((4096, 1), dtype=BF16))
    assert layer.bias.grad.dtype == BF16 and float(layer.bias.grad[0]) == 4096


def test_bfloat16_layer_norm_and_loss_are_computed_in_float32():
    rng = numpy.random.default_rng(1)
    x = (rng.standard_normal((6, 64)) * 10 + 100).astype(BF16)  # |mean| >> std
    y = layer_norm(Tensor(x), None, None)
    assert y.data.dtype == BF16
    want = layer_norm(Tensor(x.astype(numpy.float32)), None, None).data
    numpy.testing.assert_array_equal(y.data, want.astype(BF16))
    logits = Tensor(rng.standard_normal((300, 50)).astype(BF16), requires_grad=True)
    loss = softmax_cross_entropy(logits, rng.integers(0, 50, 300), reduction="sum")
    assert loss.data.dtype == numpy.float32  # the loss stays fp32, as Megatron's
    loss.backward()
    assert logits.grad.dtype == BF16


def test_the_graph_keeps_half_inputs_for_backward():
    """The float32 functions keep their 16-bit inputs for backward (widened again,
    exactly, in backward): the gpt's graph holds 0.68x fp32's bytes (measured; the
    attention probabilities and GELU's tanh stay float32), 0.92x if it kept the widened
    copies."""
    from mpidl.nn.recompute import saved_bytes

    ids = numpy.random.default_rng(0).integers(0, 64, (8, 65))
    held = {}
    for name, half in (("fp32", None), ("bf16", BF16)):
        model = gpt(vocab=64, seq_len=64, dim=64, layers=2, heads=4, seed=0)
        held[name] = saved_bytes((model.half_(half) if half else model).loss(ids))
    assert held["bf16"] <= 0.72 * held["fp32"], held
