"""Reference models: sizes, determinism, agreement with PyTorch, and that they learn."""
import hashlib
import os
import subprocess
import sys

import numpy
import pytest

import mpidl.models as models
from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.optim import SGD, Adam
from mpidl.testing import allclose

F64 = numpy.float64


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    """Train with one BLAS thread: on a shared 2-core machine, OpenBLAS's threads
    spin-wait for each other on these small matrices and a step gets ~20x slower."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.mark.parametrize("name,count", [
    ("mlp", 1_863_690), ("bow", 2_593_538), ("transformer", 1_437_186),
])
def test_reference_models_have_the_pytorch_parameter_counts(name, count):
    # performance.md section 3: mlp 1.86 M, bow 2.59 M, transformer 1.44 M.
    assert models.build(name).num_parameters() == count


def test_models_map_arrays_or_tensors_to_logits():
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((3, 784)).astype(numpy.float32)
    assert models.mlp(seed=0)(x).shape == (3, 10)
    assert models.mlp(seed=0)(Tensor(x.reshape(3, 28, 28))).shape == (3, 10)
    ids = rng.integers(0, 50, size=(2, 7))
    assert models.bow(vocab=50, seed=0)(ids).shape == (2, 2)
    small = dict(vocab=50, seq_len=8, dim=16, layers=1, heads=2)
    assert models.transformer(**small, ffn=32, seed=0)(Tensor(ids)).shape == (2, 2)
    logits = models.gpt(**small, seed=0)(ids)
    assert logits.shape == (2, 7, 50) and logits.dtype == numpy.float32
    with pytest.raises(ValueError, match="seq_len=8"):
        models.gpt(**small, seed=0)(numpy.zeros((1, 9), dtype=numpy.int64))
    with pytest.raises(ValueError, match="unknown model"):
        models.build("resnet")


def test_gpt_is_causal_and_ties_its_output_to_the_embedding():
    model = models.gpt(vocab=20, seq_len=6, dim=8, layers=1, heads=2, seed=0)
    assert "tok.weight" in dict(model.named_parameters())
    assert not any(n.startswith("head") for n, _ in model.named_parameters())
    ids = numpy.array([[1, 2, 3, 4, 5, 6]])
    changed = ids.copy()
    changed[0, 4] = 9
    a, b = model(ids).data, model(changed).data
    numpy.testing.assert_array_equal(a[:, :4], b[:, :4])  # the past does not see the future
    assert not numpy.allclose(a[:, 4:], b[:, 4:])
    untied = models.gpt(vocab=20, seq_len=6, dim=8, layers=1, heads=2, tie_weights=False)
    assert untied.num_parameters() == model.num_parameters() + 20 * 8


def params_digest(model):
    h = hashlib.sha256()
    for name, a in model.state_dict().items():
        h.update(name.encode() + a.tobytes())
    return h.hexdigest()


def test_same_seed_builds_bit_identical_models_in_another_process():
    code = ("import mpidl.models as m, hashlib\n"
            "h = hashlib.sha256()\n"
            "for n, a in m.transformer(vocab=100, seq_len=8, seed=11).state_dict().items():\n"
            "    h.update(n.encode() + a.tobytes())\n"
            "print(h.hexdigest())\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60, check=True).stdout.strip()
    assert out == params_digest(models.transformer(vocab=100, seq_len=8, seed=11))
    assert out != params_digest(models.transformer(vocab=100, seq_len=8, seed=12))


def test_float64_models_for_gradient_checks():
    model = models.bow(vocab=30, dim=4, hidden=5, dtype=F64, seed=0)
    assert all(p.dtype == F64 for p in model.parameters())


class TorchTransformer:
    """The PyTorch reference transformer classifier of the benchmarks, built with our weights."""

    def __init__(self, torch, ours):
        nn = torch.nn
        vocab, dim = ours.tok.weight.shape
        layer = ours.layers[0]
        self.torch = torch
        self.tok = nn.Embedding(vocab, dim, dtype=torch.float64)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, layer.self_attn.heads, layer.linear1.out_features,
                                       dropout=0.0, activation="gelu", norm_first=True,
                                       batch_first=True, dtype=torch.float64)
            for _ in ours.layers)
        self.head = nn.Linear(dim, ours.head.out_features, dtype=torch.float64)
        self.pos = nn.Parameter(torch.from_numpy(ours.pos.data.copy()))
        ref = {"tok.weight": self.tok.weight, "head.weight": self.head.weight,
               "head.bias": self.head.bias}
        for i, tl in enumerate(self.layers):
            for k, v in tl.named_parameters():
                ours_name = k.replace("in_proj_weight", "in_proj.weight").replace(
                    "in_proj_bias", "in_proj.bias")
                ref[f"layers.{i}.{ours_name}"] = v
        with torch.no_grad():
            for k, v in ref.items():
                v.copy_(torch.from_numpy(ours.state_dict()[k]))
        self.named = dict(ref, pos=self.pos)

    def __call__(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


@pytest.mark.extra("torch")
def test_transformer_logits_and_gradients_match_pytorch():
    torch = pytest.importorskip("torch")
    ours = models.transformer(vocab=40, seq_len=6, dim=8, layers=2, heads=2, ffn=12,
                              dtype=F64, seed=0)
    ref = TorchTransformer(torch, ours)
    rng = numpy.random.default_rng(1)
    ids, labels = rng.integers(0, 40, size=(3, 6)), numpy.array([0, 1, 1])
    logits = ours(ids)
    F.softmax_cross_entropy(logits, labels).backward()
    t_logits = ref(torch.from_numpy(ids))
    torch.nn.functional.cross_entropy(t_logits, torch.from_numpy(labels)).backward()
    assert allclose(logits.data, t_logits.detach().numpy())
    for name, p in ours.named_parameters():
        assert allclose(p.grad, ref.named[name].grad.numpy()), name


def test_small_mlp_fits_a_separable_problem_exactly():
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((128, 10)).astype(numpy.float32)
    y = (x @ rng.standard_normal((10, 3))).argmax(axis=1)  # linearly separable labels
    model = models.mlp(sizes=(10, 32, 3), seed=0)
    opt = Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        opt.zero_grad()
        F.softmax_cross_entropy(model(x), y).backward()
        opt.step()
    assert (model(x).data.argmax(axis=1) == y).mean() == 1.0


def order_task(rng, n, seq_len=12, vocab=10):
    """Sequences with one token 1 and one token 2: label 1 iff the 1 comes first."""
    ids = rng.integers(3, vocab, size=(n, seq_len))
    pos = numpy.argsort(rng.random((n, seq_len)), axis=1)[:, :2]
    rows = numpy.arange(n)
    ids[rows, pos[:, 0]] = 1
    ids[rows, pos[:, 1]] = 2
    return ids, (pos[:, 0] < pos[:, 1]).astype(numpy.int64)


def test_small_transformer_learns_which_token_comes_first():
    rng = numpy.random.default_rng(0)
    model = models.transformer(vocab=10, seq_len=12, dim=32, layers=1, heads=2, ffn=64,
                               seed=0)
    opt = Adam(model.parameters(), lr=3e-3)
    for _ in range(250):
        ids, y = order_task(rng, 64)
        opt.zero_grad()
        F.softmax_cross_entropy(model(ids), y).backward()
        opt.step()
    ids, y = order_task(numpy.random.default_rng(99), 512)
    accuracy = (model.eval()(ids).data.argmax(axis=1) == y).mean()
    assert accuracy > 0.9, accuracy


def test_transformer_pad_mask_ignores_padding():
    model = models.transformer(vocab=10, seq_len=6, dim=8, layers=1, heads=2, ffn=16,
                               pad_id=0, seed=0)
    padded = model(numpy.array([[3, 4, 5, 0, 0, 0]])).data
    # The same tokens without the padding give the same logits: padding is invisible.
    assert allclose(padded, model(numpy.array([[3, 4, 5]])).data, scale=10)


def test_gpt_learns_a_deterministic_successor_sequence():
    rng = numpy.random.default_rng(0)
    model = models.gpt(vocab=16, seq_len=8, dim=32, layers=1, heads=2, seed=0)
    opt = SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for _ in range(60):
        start = rng.integers(0, 16, size=(32, 1))
        seq = (start + numpy.arange(9)) % 16  # next token = token + 1
        opt.zero_grad()
        loss = F.softmax_cross_entropy(model(seq[:, :-1]), seq[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 2.0 and losses[-1] < 0.3, (losses[0], losses[-1])


@pytest.mark.gpu
def test_model_moved_to_cupy_gives_the_numpy_logits():
    from mpidl.backend import cupy_module

    cp = cupy_module()
    if cp is None:
        pytest.skip("needs CuPy and a GPU")
    model = models.transformer(vocab=40, seq_len=6, dim=8, layers=1, heads=2, ffn=12, seed=0)
    ids = numpy.random.default_rng(0).integers(0, 40, size=(2, 6))
    expected = model(ids).data
    model.to(cp)
    assert allclose(model(cp.asarray(ids)).data, expected, scale=10)


def test_the_bag_of_words_with_a_pad_id_averages_real_tokens_only():
    bow = models.bow(vocab=30, dim=4, hidden=5, classes=2, pad_id=0, seed=1)
    short = numpy.array([[5, 7, 0, 0, 0, 0]])
    assert numpy.allclose(bow(short).data, bow(numpy.array([[5, 7]])).data)
    reference = models.bow(vocab=30, dim=4, hidden=5, classes=2, seed=1)  # padding counts
    assert not numpy.allclose(reference(short).data, reference(numpy.array([[5, 7]])).data)


def test_a_language_models_loss_gives_padded_targets_nothing():
    gpt = models.gpt(vocab=20, seq_len=8, dim=8, layers=1, heads=2, pad_id=0, seed=2,
                     dtype="float64")
    ids = numpy.array([[3, 4, 5, 6, 0, 0, 0, 0]])
    assert gpt.count_targets(ids) == 3  # 4, 5, 6 are predicted; the padding is not
    padded = gpt.loss(ids, reduction="sum")
    real = gpt.loss(ids[:, :4], reduction="sum")
    assert numpy.isclose(float(padded.data), float(real.data))
    padded.backward()
    grad = gpt.tok.weight.grad.copy()
    for p in gpt.parameters():
        p.grad = None
    gpt.loss(ids[:, :4], reduction="sum").backward()
    assert numpy.allclose(grad, gpt.tok.weight.grad)


# -- the convolutional models ---------------------------------------------------------
def test_conv_models_have_the_derived_parameter_counts():
    # cnn: convs 288 + 18,432 + 73,728 (no bias under batch norm), batch norms 2 x 224,
    # head 1,290. cosmoflow at 128^3 is the MLPerf reference's 5.6 M
    # (science-and-planner.md section 1).
    assert models.build("cnn").num_parameters() == 94_186
    assert models.build("cosmoflow").num_parameters() == 1_140_388
    assert models.cosmoflow(in_shape=(4, 128, 128, 128)).num_parameters() == 5_597_604
    assert models.cosmoflow(in_shape=(4, 128, 128, 128)).blocks == 5


def test_conv_models_take_their_shapes_from_the_data():
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((3, 28, 28)).astype(numpy.float32)
    for shape in [(28, 28), (1, 28, 28)]:
        model = models.cnn(in_shape=shape, outputs=5, seed=0)
        assert model.in_shape == (1, 28, 28)
        assert model(x).shape == (3, 5)  # (B, H, W) samples of one channel
        assert model(x.reshape(3, 784)).shape == (3, 5)  # flattened samples
    rgb = models.cnn(in_shape=(3, 9, 13), outputs=2, channels=(4, 8), seed=0)
    assert rgb(rng.integers(0, 255, size=(2, 3, 9, 13))).dtype == numpy.float32  # uint8-like
    vol = models.cosmoflow(in_shape=(16, 16, 16), outputs=3, base_channels=4, seed=0)
    assert vol.in_shape == (1, 16, 16, 16) and vol.blocks == 2
    assert vol(rng.standard_normal((2, 16, 16, 16))).shape == (2, 3)
    assert models.cnn(in_shape=(1, 1, 1), outputs=2, seed=0)(numpy.ones((2, 1, 1, 1))).shape \
        == (2, 2)  # a 1x1 map is not pooled
    with pytest.raises(ValueError, match=r"does not hold samples of in_shape=\(1, 28, 28\)"):
        models.cnn(seed=0)(numpy.zeros((2, 3, 28, 28)))
    with pytest.raises(ValueError, match="in_shape=.*must be"):
        models.cnn(in_shape=(1, 2, 3, 4))
    with pytest.raises(ValueError, match="pass blocks <= 3"):
        models.cosmoflow(in_shape=(1, 8, 8, 8), blocks=4)


def test_cosmoflow_bounded_head_and_options():
    model = models.cosmoflow(in_shape=(2, 8, 8, 8), outputs=4, base_channels=4, hidden=(8,),
                             output_scale=1.2, dropout=0.5, batch_norm=True, seed=0)
    y = model(numpy.random.default_rng(1).standard_normal((3, 2, 8, 8, 8)) * 100)
    assert y.shape == (3, 4) and numpy.abs(y.data).max() <= 1.2
    assert sum(type(m).__name__ == "Dropout" for _, m in model.named_modules()) == 1
    assert "features.1.running_mean" in model.state_dict()  # BatchNorm3d after the conv


def torch_cnn(torch, ours):
    """PyTorch's cnn with our weights (same layer list, same parameter names)."""
    nn = torch.nn
    layers = []
    for m in ours.features:
        kind = type(m).__name__
        if kind == "Conv2d":
            layers.append(nn.Conv2d(m.in_channels, m.out_channels, 3, padding=1,
                                    bias=m.bias is not None, dtype=torch.float64))
        elif kind == "BatchNorm2d":
            layers.append(nn.BatchNorm2d(m.num_features, dtype=torch.float64))
        elif kind == "ReLU":
            layers.append(nn.ReLU())
        else:
            layers.append(nn.MaxPool2d(2))
    ref = nn.ModuleDict({"features": nn.Sequential(*layers),
                         "head": nn.Linear(ours.head.in_features, ours.outputs,
                                           dtype=torch.float64)})
    ref.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in ours.state_dict().items()})
    return ref


@pytest.mark.extra("torch")
def test_cnn_matches_pytorch_in_training_and_eval_mode():
    torch = pytest.importorskip("torch")
    ours = models.cnn(in_shape=(2, 10, 9), outputs=3, channels=(4, 6), dtype=F64, seed=0)
    ref = torch_cnn(torch, ours)

    def forward_ref(x):
        return ref["head"](ref["features"](x).mean(dim=(2, 3)))

    rng = numpy.random.default_rng(2)
    for training in (True, False):
        ours.train(training)
        ref.train(training)
        x, labels = rng.standard_normal((4, 2, 10, 9)), numpy.array([0, 2, 1, 2])
        ours.zero_grad()
        ref.zero_grad()
        logits = ours(x)
        F.softmax_cross_entropy(logits, labels).backward()
        t_logits = forward_ref(torch.from_numpy(x))
        torch.nn.functional.cross_entropy(t_logits, torch.from_numpy(labels)).backward()
        assert allclose(logits.data, t_logits.detach().numpy())
        theirs = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            assert allclose(p.grad, theirs[name].grad.numpy()), name
        buffers = ref.state_dict()
        for name, b in ours.named_buffers():
            assert allclose(b, buffers[name].numpy()), name


def adam_losses(model, loss_fn, x, y, steps, lr):
    """The losses of ``steps`` full-batch Adam steps."""
    opt = Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_cnn_and_cosmoflow_reduce_their_losses_in_a_few_steps():
    rng = numpy.random.default_rng(3)
    x = rng.standard_normal((16, 1, 12, 12)).astype(numpy.float32)
    y = (x[:, 0, :6].mean(axis=(1, 2)) > x[:, 0, 6:].mean(axis=(1, 2))).astype(numpy.int64)
    model = models.cnn(in_shape=(1, 12, 12), outputs=2, channels=(8, 16), seed=0)
    losses = adam_losses(model, F.softmax_cross_entropy, x, y, 15, 1e-2)
    assert losses[-1] < 0.5 * losses[0], losses
    v = rng.standard_normal((8, 2, 8, 8, 8)).astype(numpy.float32)
    t = numpy.stack([v.mean(axis=(1, 2, 3, 4)), v[:, 0].std(axis=(1, 2, 3))], 1)
    net = models.cosmoflow(in_shape=(2, 8, 8, 8), outputs=2, base_channels=8, seed=0)
    losses = adam_losses(net, F.mean_squared_error, v, t, 15, 3e-3)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name", ["cnn", "cosmoflow"])
def test_pooling_before_the_activation_is_the_usual_block(name):
    # The models pool before the activation (cheaper); the usual activation-then-pool
    # gives the same outputs and gradients, ties of ReLU zeros included.
    from mpidl.nn import LeakyReLU, ReLU
    from mpidl.nn.pool import MaxPool2d, MaxPool3d

    if name == "cnn":
        model = models.cnn(in_shape=(2, 8, 8), outputs=3, channels=(4, 6), dtype=F64, seed=0)
        x = numpy.random.default_rng(4).standard_normal((3, 2, 8, 8))
    else:
        model = models.cosmoflow(in_shape=(2, 8, 8, 8), outputs=3, base_channels=4,
                                 dtype=F64, seed=0)
        x = numpy.random.default_rng(4).standard_normal((3, 2, 8, 8, 8))
    layers = list(model.features)
    swapped = list(layers)
    for i in range(len(layers) - 1):
        if isinstance(layers[i], (MaxPool2d, MaxPool3d)) and \
                isinstance(layers[i + 1], (ReLU, LeakyReLU)):
            swapped[i], swapped[i + 1] = layers[i + 1], layers[i]
    assert swapped != layers
    grads = []
    for order in (layers, swapped):
        xt = Tensor(x, requires_grad=True)
        model.zero_grad()
        h = xt
        for layer in order:
            h = layer(h)
        out = model.head(model.pool(h)) if name == "cnn" else model.head(h)
        F.sum(out * out).backward()
        grads.append([out.data, xt.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert allclose(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cnn", "cosmoflow"])
def test_conv_models_moved_to_cupy_give_the_numpy_outputs_and_gradients(name):
    from mpidl.backend import cupy_module

    cp = cupy_module()
    if cp is None:
        pytest.skip("needs CuPy and a GPU")
    shape = (2, 12, 12) if name == "cnn" else (2, 8, 8, 8)
    kwargs = dict(channels=(4, 8)) if name == "cnn" else dict(base_channels=4, batch_norm=True)
    model = models.build(name, in_shape=shape, outputs=3, seed=0, dtype=F64, **kwargs)
    x = numpy.random.default_rng(5).standard_normal((3,) + shape)
    start = {k: v.copy() for k, v in model.state_dict().items()}
    results = []
    for xp in (numpy, cp):
        model.to(xp)
        model.load_state_dict(start)  # the same running statistics before each run
        model.zero_grad()
        out = model(xp.asarray(x))
        F.sum(out * out).backward()
        results.append([out.data] + [p.grad for p in model.parameters()] + model.buffers())
    for a, b in zip(*results):
        assert allclose(b, a)


def _counts(ids, vocab, pad_id):
    """The ``(B, vocab)`` count matrix of ``ids`` with ``pad_id`` left out, by hand."""
    out = numpy.zeros((len(ids), vocab))
    for row, bag in zip(out, ids):
        for i in bag:
            if i != pad_id:
                row[i] += 1
    return out


def test_the_linear_model_on_tokens_is_counts_times_a_table_plus_a_bias():
    # The independent reference: the count matrix a user gives scikit-learn, times the
    # weights; its gradient is counts^T @ dlogits (padding and repeats included).
    rng = numpy.random.default_rng(3)
    model = models.linear(vocab=12, classes=3, pad_id=0, dtype=F64)
    assert not model.embed.weight.data.any() and not model.bias.data.any()  # a zero start
    model.embed.weight.data[...] = rng.standard_normal((12, 3))
    model.bias.data[...] = rng.standard_normal(3)
    ids = numpy.array([[4, 4, 7, 0, 0], [0, 0, 0, 0, 0], [1, 11, 3, 3, 3]])
    counts = _counts(ids, 12, 0)
    logits = model(ids)
    assert allclose(logits.data, counts @ model.embed.weight.data + model.bias.data)
    g = rng.standard_normal((3, 3))
    F.sum(F.mul(logits, g)).backward()
    assert allclose(model.embed.weight.grad, counts.T @ g)
    assert allclose(model.bias.grad, g.sum(axis=0))


def test_the_linear_model_on_features_standardises_then_applies_one_layer():
    rng = numpy.random.default_rng(4)
    mean, std = rng.standard_normal(5), rng.uniform(0.5, 3, 5)
    model = models.linear(in_shape=(5,), outputs=2, input_stats=(mean, std),
                          target_stats=([10.0, -1.0], [2.0, 0.5]), dtype=F64)
    model.weight.data[...] = rng.standard_normal((5, 2))
    x = rng.standard_normal((4, 5)) * 7
    expected = ((x - mean) / std) @ model.weight.data * [2.0, 0.5] + [10.0, -1.0]
    assert allclose(model(x).data, expected)
    raw = models.linear(in_shape=(5,), outputs=2, input_stats=(mean, std), standardize=False)
    assert raw.inputs is None and raw.targets is None


@pytest.mark.parametrize("kwargs, message", [
    ({"vocab": 5, "in_shape": (3,), "classes": 2}, "give exactly one"),
    ({"vocab": 5}, "number of classes or outputs"),
    ({"vocab": 5, "classes": 2, "outputs": 3}, "disagree"),
])
def test_the_linear_model_says_which_arguments_are_missing_or_contradict(kwargs, message):
    with pytest.raises(ValueError, match=message):
        models.linear(**kwargs)


def test_sum_pooling_is_the_mean_times_the_real_tokens():
    ids = numpy.array([[5, 7, 7, 0, 0, 0]])
    mean = models.bow(vocab=30, dim=4, hidden=5, pad_id=0, seed=1, dtype=F64)
    total = models.bow(vocab=30, dim=4, hidden=5, pad_id=0, pooling="sum", seed=1, dtype=F64)
    table = mean.embed.weight.data
    bag = table[[5, 7, 7]].sum(axis=0)[None]  # (1, D): the three real tokens' rows summed
    assert allclose(total(ids).data, total.fc2(F.relu(total.fc1(bag))).data)
    assert not allclose(total(ids).data, mean(ids).data)
    with pytest.raises(ValueError, match="pooling='max'"):
        models.bow(vocab=30, pooling="max")


def test_the_bag_of_words_embedding_starts_at_the_given_scale():
    small = models.bow(vocab=2000, dim=16, embed_std=0.1, seed=0).embed.weight.data
    assert 0.09 < small.std() < 0.11
    assert 0.9 < models.bow(vocab=2000, dim=16, seed=0).embed.weight.data.std() < 1.1
