"""Layers: values against NumPy/PyTorch references, gradients against finite differences."""
import numpy
import pytest

from mpidl import functions as F
from mpidl.nn import (
    GELU, Embedding, EmbeddingBag, LayerNorm, Linear, MultiHeadAttention, Parameter,
    TransformerEncoderLayer,
)
from mpidl.nn.attention import merge_heads, split_heads
from mpidl.nn.linear import linear
from mpidl.testing import allclose

F64 = numpy.float64


def numerical_grads(f, arrays, eps=1e-6):
    """Central differences of the scalar f() with respect to each array (changed in place)."""
    out = []
    for a in arrays:
        g = numpy.zeros_like(a)
        it = numpy.nditer(a, flags=["multi_index"])
        for _ in it:
            i = it.multi_index
            old = a[i]
            a[i] = old + eps
            hi = f()
            a[i] = old - eps
            lo = f()
            a[i] = old
            g[i] = (hi - lo) / (2 * eps)
        out.append(g)
    return out


def check_module_grads(module, x, weights=None):
    """Backward of sum(module(x) * w) against finite differences, for x and every parameter."""
    x = numpy.array(x)
    w = weights if weights is not None else numpy.random.default_rng(9).standard_normal(
        module(x).shape)

    def loss():
        return float((module(x).data * w).sum())

    from mpidl.autograd import Tensor

    xt = Tensor(x, requires_grad=x.dtype.kind == "f")
    module.zero_grad(set_to_none=True)
    F.sum(F.mul(module(xt), w)).backward()
    params = module.parameters()
    arrays = [p.data for p in params] + ([x] if xt.requires_grad else [])
    analytic = [p.grad for p in params] + ([xt.grad] if xt.requires_grad else [])
    for a, num in zip(analytic, numerical_grads(loss, arrays)):
        assert allclose(a, num, dtype=F64, scale=1e4), numpy.abs(a - num).max()


def test_linear_computes_x_wt_plus_b_on_any_leading_shape():
    lin = Linear(4, 3, seed=0)
    x = numpy.random.default_rng(1).standard_normal((2, 5, 4)).astype(numpy.float32)
    y = lin(x)
    assert y.shape == (2, 5, 3) and y.dtype == numpy.float32
    assert allclose(y.data, x @ lin.weight.data.T + lin.bias.data)
    with pytest.raises(ValueError, match="4 features.*expects 5"):
        Linear(5, 3, seed=0)(x)


def test_linear_writes_first_gradients_into_grad_buffers_then_adds():
    lin = Linear(3, 2, seed=0, dtype="float64")
    x = numpy.random.default_rng(1).standard_normal((4, 3))
    F.sum(lin(x)).backward()
    ref_w, ref_b = lin.weight.grad.copy(), lin.bias.grad.copy()
    lin.zero_grad()
    flat = numpy.full(9, numpy.nan)  # as a data-parallel bucket: stale values
    lin.weight.grad_buffer, lin.bias.grad_buffer = flat[:6].reshape(2, 3), flat[6:8]
    F.sum(lin(x)).backward()
    assert lin.weight.grad is lin.weight.grad_buffer and lin.bias.grad is lin.bias.grad_buffer
    assert allclose(flat[:6].reshape(2, 3), ref_w) and allclose(flat[6:8], ref_b)
    F.sum(lin(x)).backward()
    assert allclose(lin.weight.grad, 2 * ref_w) and lin.weight.grad is lin.weight.grad_buffer
    assert numpy.isnan(flat[8])  # nothing written past the slices


def test_a_tensor_used_twice_by_one_linear_still_sums_both_gradients():
    w = Parameter(numpy.random.default_rng(2).standard_normal((3, 3)))
    F.sum(linear(w, w)).backward()  # w as the input and as the weight
    ref = w.grad.copy()
    w.grad, w.grad_buffer = None, numpy.full((3, 3), numpy.nan)
    F.sum(linear(w, w)).backward()
    assert allclose(w.grad, ref) and w.grad is w.grad_buffer


def test_linear_initial_scale_is_pytorchs():
    w = Linear(400, 300, seed=0).weight.data
    assert abs(w).max() <= 1 / 20 and abs(w).max() > 0.049


@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradients_match_finite_differences(bias):
    lin = Linear(4, 3, bias=bias, seed=0, dtype=F64)
    check_module_grads(lin, numpy.random.default_rng(2).standard_normal((2, 3, 4)))


def test_layer_norm_and_gelu_modules_gradcheck():
    check_module_grads(LayerNorm(5, dtype=F64), numpy.random.default_rng(3).standard_normal((3, 5)))
    check_module_grads(GELU(), numpy.random.default_rng(4).standard_normal((3, 5)))


def test_embedding_and_bag_look_up_and_average_rows():
    ids = numpy.array([[1, 2, 2], [0, 3, 1]])
    emb = Embedding(4, 2, seed=0)
    assert allclose(emb(ids).data, emb.weight.data[ids])
    bag = EmbeddingBag(4, 2, seed=0)
    assert allclose(bag(ids).data, bag.weight.data[ids].mean(axis=1))
    check_module_grads(EmbeddingBag(4, 2, seed=0, dtype=F64), ids)


def test_split_and_merge_heads_are_inverse_reshapes():
    from mpidl.autograd import Tensor

    b, t, h, dh = 2, 3, 2, 4
    qkv = Tensor(numpy.random.default_rng(5).standard_normal((b, t, 3 * h * dh)),
                 requires_grad=True)
    q, k, v = split_heads(qkv, h)
    ref = qkv.data.reshape(b, t, 3, h, dh)
    assert numpy.array_equal(k.data, ref[:, :, 1].transpose(0, 2, 1, 3))
    assert numpy.array_equal(merge_heads(v).data, qkv.data[..., 2 * h * dh:])
    # Only q used: k and v get no gradient, their slots are zero.
    F.sum(q).backward()
    g = qkv.grad.reshape(b, t, 3, h * dh)
    assert numpy.all(g[:, :, 0] == 1) and not g[:, :, 1:].any()


@pytest.mark.parametrize("causal", [False, True])
def test_attention_gradients_match_finite_differences(causal):
    mha = MultiHeadAttention(4, 2, causal=causal, seed=0, dtype=F64)
    check_module_grads(mha, numpy.random.default_rng(6).standard_normal((2, 3, 4)))


def test_encoder_layer_gradients_match_finite_differences():
    layer = TransformerEncoderLayer(4, 2, 6, seed=0, dtype=F64)
    check_module_grads(layer, numpy.random.default_rng(7).standard_normal((1, 3, 4)))


def torch_encoder_layer(torch, ours):
    """PyTorch's pre-LN layer holding our layer's weights."""
    dim = ours.norm1.dim
    ref = torch.nn.TransformerEncoderLayer(
        dim, ours.self_attn.heads, ours.linear1.out_features, dropout=0.0, activation="gelu",
        norm_first=True, batch_first=True, dtype=torch.float64)
    names = {"self_attn.in_proj_weight": "self_attn.in_proj.weight",
             "self_attn.in_proj_bias": "self_attn.in_proj.bias"}
    state = ours.state_dict()
    ref.load_state_dict({k: torch.from_numpy(state[names.get(k, k)].copy())
                         for k in ref.state_dict()})
    return ref.eval()


@pytest.mark.extra("torch")
@pytest.mark.parametrize("causal", [False, True])
def test_encoder_layer_matches_pytorch(causal):
    torch = pytest.importorskip("torch")
    ours = TransformerEncoderLayer(8, 2, 16, causal=causal, seed=0, dtype=F64)
    ref = torch_encoder_layer(torch, ours)
    x = numpy.random.default_rng(8).standard_normal((2, 5, 8))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64) \
        if causal else None
    with torch.no_grad():
        expected = ref(torch.from_numpy(x), src_mask=mask, is_causal=causal).numpy()
    assert allclose(ours(x).data, expected)


def test_conv_layers_start_at_pytorchs_scale_and_name_their_parameters():
    from mpidl.nn import Conv1d, Conv2d, Conv3d

    for cls, k in ((Conv1d, 5), (Conv2d, 3), (Conv3d, 2)):
        conv = cls(8, 6, k, groups=2, seed=0)
        fan_in = 4 * k ** cls.dims
        w = conv.weight.data
        assert w.shape == (6, 4) + (k,) * cls.dims and w.dtype == numpy.float32
        assert abs(w).max() <= 1 / numpy.sqrt(fan_in) and abs(w).max() > 0.8 / numpy.sqrt(fan_in)
        assert abs(conv.bias.data).max() <= 1 / numpy.sqrt(fan_in)
        assert [n for n, _ in conv.named_parameters()] == ["weight", "bias"]
    assert Conv2d(2, 2, 3, bias=False, seed=0).bias is None
    with pytest.raises(ValueError, match="groups=3 must divide in_channels=4"):
        Conv2d(4, 6, 3, groups=3)
    with pytest.raises(ValueError, match="needs stride 1"):
        Conv2d(4, 6, 3, stride=2, padding="same")


def test_conv_and_pool_layers_compute_their_functions():
    from mpidl.nn import (
        AdaptiveAvgPool3d, AvgPool1d, Conv2d, Flatten, LeakyReLU, MaxPool2d,
    )

    x = numpy.random.default_rng(10).standard_normal((2, 3, 8, 8))
    conv = Conv2d(3, 4, 3, stride=2, padding=1, dilation=1, seed=0, dtype=F64)
    assert allclose(conv(x).data, F.conv2d(x, conv.weight, conv.bias, 2, 1).data)
    assert allclose(MaxPool2d(2)(x).data, F.max_pool2d(x, 2).data)
    x1 = x.reshape(2, 3, 64)
    assert allclose(AvgPool1d(4, 2, 1)(x1).data, F.avg_pool1d(x1, 4, 2, 1).data)
    x3 = x.reshape(2, 3, 4, 4, 4)
    assert AdaptiveAvgPool3d(1)(x3).shape == (2, 3, 1, 1, 1)
    assert Flatten()(x).shape == (2, 192) and Flatten(0, 1)(x).shape == (6, 8, 8)
    assert Flatten()(numpy.zeros((0, 3, 4))).shape == (0, 12)
    assert allclose(LeakyReLU(0.1)(x).data, numpy.where(x > 0, x, 0.1 * x))
    with pytest.raises(ValueError, match="must have 4 dimensions"):
        MaxPool2d(2)(x1)
    check_module_grads(Conv2d(3, 2, 2, dilation=(1, 2), padding="same", seed=1, dtype=F64),
                       x[:1, :, :4, :5])
