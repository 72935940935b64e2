"""batch_norm and the BatchNorm layers: forward against the textbook formulas, backward
against finite differences (float64), training and evaluation modes, the running
statistics against PyTorch's ``BatchNorm{1,2,3}d`` over several steps when installed,
the buffers in state dicts and checkpoints, and float32 accuracy far from zero."""
from __future__ import annotations

import numpy
import pytest

import mpidl.functions as F
from mpidl.autograd import Tensor
from mpidl.backend import as_numpy
from mpidl.nn import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d, Sequential
from mpidl.testing import allclose
from mpidl.testing.gradcheck import gradcheck

SHAPES = [(6, 3), (4, 3, 5), (3, 2, 4, 5), (2, 2, 3, 4, 3)]
IDS = ["BC", "BCL", "BCHW", "BCDHW"]
LAYERS = {2: BatchNorm1d, 3: BatchNorm1d, 4: BatchNorm2d, 5: BatchNorm3d}


def _randn(xp, *shape, seed=0, scale=1.0, shift=0.0, dtype=numpy.float64):
    a = numpy.random.default_rng(seed).standard_normal(shape) * scale + shift
    return xp.asarray(a.astype(dtype))


def _axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _col(v, ndim):
    return numpy.asarray(v).reshape((1, -1) + (1,) * (ndim - 2))


def reference_train(x, w, b, eps=1e-5):
    x = as_numpy(x).astype(numpy.float64)
    mean = x.mean(axis=_axes(x), keepdims=True)
    var = x.var(axis=_axes(x), keepdims=True)
    y = (x - mean) / numpy.sqrt(var + eps)
    if w is not None:
        y = y * _col(as_numpy(w), x.ndim) + _col(as_numpy(b), x.ndim)
    return y


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_training_forward_normalises_over_batch_and_space_and_updates_running_stats(xp, shape):
    x = _randn(xp, *shape, seed=1, scale=2.0, shift=3.0)
    w, b = _randn(xp, shape[1], seed=2), _randn(xp, shape[1], seed=3)
    rm, rv = _randn(xp, shape[1], seed=4), xp.asarray(numpy.linspace(0.5, 2.0, shape[1]))
    rm0, rv0 = as_numpy(rm).copy(), as_numpy(rv).copy()
    y = F.batch_norm(Tensor(x), rm, rv, Tensor(w), Tensor(b), training=True, momentum=0.3)
    assert allclose(y.data, reference_train(x, w, b))
    xn = as_numpy(x)
    n = xn.size // shape[1]
    assert allclose(rm, 0.7 * rm0 + 0.3 * xn.mean(axis=_axes(xn)))
    assert allclose(rv, 0.7 * rv0 + 0.3 * xn.var(axis=_axes(xn)) * n / (n - 1))  # unbiased


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_eval_forward_uses_the_running_statistics(xp, shape):
    x = _randn(xp, *shape, seed=5)
    w, b = _randn(xp, shape[1], seed=6), _randn(xp, shape[1], seed=7)
    rm, rv = _randn(xp, shape[1], seed=8), xp.asarray(numpy.linspace(0.5, 2.0, shape[1]))
    rm0 = as_numpy(rm).copy()
    y = F.batch_norm(Tensor(x), rm, rv, Tensor(w), Tensor(b), training=False, eps=1e-3)
    d = x.ndim
    want = (as_numpy(x) - _col(rm0, d)) / numpy.sqrt(_col(as_numpy(rv), d) + 1e-3) \
        * _col(as_numpy(w), d) + _col(as_numpy(b), d)
    assert allclose(y.data, want) and numpy.array_equal(as_numpy(rm), rm0)  # not updated


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_gradients_match_finite_differences(xp, shape, training):
    x = _randn(xp, *shape, seed=9, scale=1.5, shift=-1.0)
    w, b = _randn(xp, shape[1], seed=10), _randn(xp, shape[1], seed=11)
    rm, rv = _randn(xp, shape[1], seed=12), xp.asarray(numpy.linspace(0.5, 2.0, shape[1]))

    def fn(a, weight, bias):
        # Fresh copies: the finite differences run forward many times, each training
        # forward updating the running statistics in place.
        return F.batch_norm(a, rm.copy(), rv.copy(), weight, bias, training=training)

    assert gradcheck(fn, [x, w, b])


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=IDS[1:3])
def test_batch_norm_without_affine_parameters_gradchecks(xp, shape):
    x = _randn(xp, *shape, seed=13)
    assert gradcheck(lambda a: F.batch_norm(a, training=True), [x])
    y = F.batch_norm(Tensor(x), training=True)
    assert allclose(y.data, reference_train(x, None, None))


def test_float32_statistics_stay_accurate_far_from_zero(xp):
    # Mean 1000, std 1: the sums-of-squares form in float32 has no correct digit left;
    # the shifted float64 sums (mpidl.functions.batchnorm) keep float32 accuracy.
    x = _randn(xp, 32, 4, 64, seed=14, shift=1000.0, dtype=numpy.float32)
    w = Tensor(xp.ones(4, dtype=numpy.float32), requires_grad=True)
    b = Tensor(xp.zeros(4, dtype=numpy.float32), requires_grad=True)
    xt = Tensor(x, requires_grad=True)
    y = F.batch_norm(xt, None, None, w, b, training=True)
    assert y.dtype == numpy.float32
    assert numpy.abs(as_numpy(y.data) - reference_train(x, None, None)).max() < 1e-5
    g = _randn(xp, *x.shape, seed=15, dtype=numpy.float32)
    y.backward(g)
    x64 = Tensor(x.astype(numpy.float64), requires_grad=True)
    F.batch_norm(x64, training=True).backward(g.astype(numpy.float64))
    assert allclose(xt.grad, as_numpy(x64.grad).astype(numpy.float32), scale=100)


def test_float16_is_normalised_in_float32(xp):
    x = _randn(xp, 16, 3, 8, seed=16, scale=30.0, dtype=numpy.float16)
    y = F.batch_norm(Tensor(x), training=True)
    assert y.dtype == numpy.float16
    assert allclose(y.data, reference_train(x, None, None).astype(numpy.float16), scale=3)


def test_an_empty_local_batch_takes_its_statistics_from_the_other_ranks(xp):
    # What a rank with no samples sees in SyncBatchNorm: the allreduce brings counts and
    # sums from elsewhere; its own share is zeros, and its output is empty.
    c = 3
    others = xp.concatenate([xp.asarray([8.0]), xp.full(c, 4.0), xp.full(c, 10.0)])
    seen = []

    def allreduce(buf):
        seen.append(as_numpy(buf).copy())
        buf += others if len(seen) == 1 else 0.0
        return buf

    rm, rv = xp.zeros(c), xp.ones(c)
    x = Tensor(xp.zeros((0, c, 4)), requires_grad=True)
    y = F.batch_norm(x, rm, rv, training=True, momentum=1.0, allreduce=allreduce)
    assert y.shape == (0, c, 4) and not seen[0].any()
    assert allclose(rm, numpy.full(c, 0.5))  # sum 4 over 8 values
    assert allclose(rv, numpy.full(c, (10 / 8 - 0.25) * 8 / 7))
    F.sum(y).backward()
    assert x.grad.shape == (0, c, 4) and len(seen) == 2 and not seen[1].any()


@pytest.mark.parametrize("call, match", [
    (lambda x: F.batch_norm(x[:1, :, :1], training=True), "more than 1 value per channel"),
    (lambda x: F.batch_norm(x), "needs running_mean and running_var"),
    (lambda x: F.batch_norm(x, numpy.zeros(2), numpy.ones(3)), r"running_mean has shape \(2,\)"),
    (lambda x: F.batch_norm(x, numpy.zeros(3)), "both running_mean and running_var"),
    (lambda x: F.batch_norm(x[0, 0], training=True), r"needs \(B, C, ...\)"),
])
def test_batch_norm_errors_name_the_values(call, match):
    with pytest.raises(ValueError, match=match):
        call(numpy.zeros((4, 3, 5)))


# -- the layers -------------------------------------------------------------------------
def test_layers_hold_running_statistics_as_buffers_and_switch_modes():
    bn = BatchNorm2d(3)
    assert [n for n, _ in bn.named_parameters()] == ["weight", "bias"]
    assert list(bn.state_dict()) == ["weight", "bias", "running_mean", "running_var",
                                     "num_batches_tracked"]
    x = _randn(numpy, 4, 3, 2, 2, seed=17, shift=5.0, dtype=numpy.float32)
    bn(x)
    assert int(bn.num_batches_tracked) == 1 and bn.running_mean.dtype == numpy.float32
    assert numpy.all(bn.running_mean > 0.4)
    before = bn.running_mean.copy()
    y = bn.eval()(x)
    assert numpy.array_equal(bn.running_mean, before) and int(bn.num_batches_tracked) == 1
    want = (x - _col(before, 4)) / numpy.sqrt(_col(bn.running_var, 4) + 1e-5)
    assert allclose(y.data, want.astype(numpy.float32), scale=10)
    assert list(BatchNorm1d(3, track_running_stats=False, affine=False).state_dict()) == []


def test_momentum_none_is_a_cumulative_average():
    bn = BatchNorm1d(2, momentum=None, dtype="float64")
    xs = [_randn(numpy, 5, 2, seed=s, shift=s) for s in range(3)]
    for x in xs:
        bn(x)
    assert allclose(bn.running_mean, numpy.mean([x.mean(axis=0) for x in xs], axis=0))
    assert allclose(bn.running_var, numpy.mean([x.var(axis=0, ddof=1) for x in xs], axis=0))


def test_layers_check_the_input_rank_and_channels():
    with pytest.raises(ValueError, match="must have 4 dimensions"):
        BatchNorm2d(3)(numpy.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="must have 3 channels"):
        BatchNorm1d(3)(numpy.zeros((2, 4)))
    with pytest.raises(ValueError, match="must have 2 or 3 dimensions"):
        BatchNorm1d(3)(numpy.zeros((2, 3, 4, 4)))
    assert BatchNorm(3)(numpy.ones((2, 3, 2, 2, 2, 2))).shape == (2, 3, 2, 2, 2, 2)


def test_running_statistics_survive_a_checkpoint(tmp_path):
    pytest.importorskip("h5py")
    from mpidl.train.checkpoint import load_checkpoint, save_checkpoint

    src = Sequential(BatchNorm1d(3, dtype="float64"), BatchNorm2d(2))
    src[0](numpy.ones((2, 3)) * numpy.arange(3))
    src[1](_randn(numpy, 3, 2, 2, 2, seed=18, dtype=numpy.float32))
    path = save_checkpoint(tmp_path, 1, model=src.state_dict(), optimizer={}, rng={},
                           sampler={})
    dst = Sequential(BatchNorm1d(3, dtype="float64"), BatchNorm2d(2))
    dst.load_state_dict(load_checkpoint(path).model)
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert a.dtype == b.dtype and a.shape == b.shape and numpy.array_equal(a, b), name
    assert int(dst[0].num_batches_tracked) == 1


@pytest.mark.extra("torch")
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_layers_match_pytorch_over_training_and_eval_steps(shape, momentum):
    torch = pytest.importorskip("torch")
    ndim = len(shape)
    ours = LAYERS[ndim](shape[1], momentum=momentum, dtype="float64")
    ref = getattr(torch.nn, LAYERS[ndim].__name__)(shape[1], momentum=momentum,
                                                   dtype=torch.float64)
    rng = numpy.random.default_rng(19)
    w, b = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    ours.weight.data[...], ours.bias.data[...] = w, b
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        ref.bias.copy_(torch.from_numpy(b))
    for step, training in enumerate([True, True, False, True, False]):
        ours.train(training)
        ref.train(training)
        x = rng.standard_normal(shape) * (step + 1) + step
        gy = rng.standard_normal(shape)
        xt = Tensor(x, requires_grad=True)
        ours.zero_grad()
        y = ours(xt)
        y.backward(gy)
        tx = torch.tensor(x, requires_grad=True)
        ref.zero_grad()
        ty = ref(tx)
        ty.backward(torch.from_numpy(gy))
        assert allclose(y.data, ty.detach().numpy())
        assert allclose(xt.grad, tx.grad.numpy())
        assert allclose(ours.weight.grad, ref.weight.grad.numpy())
        assert allclose(ours.bias.grad, ref.bias.grad.numpy())
        theirs = ref.state_dict()
        for k, v in ours.state_dict().items():
            assert allclose(v, theirs[k].numpy()), k
