"""Standardised inputs and targets: the train split's column statistics, the fixed layer
that applies them, and the mlp `mpidl train` builds with them."""
from __future__ import annotations

import numpy
import pytest

from mpidl.autograd import Tensor
from mpidl.data import write_shards
from mpidl.data.format import read_manifest
from mpidl.data.hdf5 import ShardedDataset
from mpidl.data.stats import MAX_COLUMNS, column_scale, column_stats
from mpidl.models import mlp
from mpidl.nn import Standardize
from mpidl.train.config import ConfigError, load_config
from mpidl.train.model import build_model


def test_column_stats_are_each_positions_mean_and_std_over_the_finite_values():
    rng = numpy.random.default_rng(0)
    # columns in very different units, more rows than one block, a NaN and an inf
    x = (rng.standard_normal((7000, 3)) * [0.01, 1.0, 1000.0] + [5.0, -2.0, 1e6])
    x = x.astype(numpy.float32)
    x[3, 0], x[10, 2] = numpy.nan, numpy.inf
    got = column_stats(x)
    for j in range(3):
        finite = x[:, j][numpy.isfinite(x[:, j])].astype(numpy.float64)
        assert got["mean"][j] == pytest.approx(finite.mean(), rel=1e-12)
        assert got["std"][j] == pytest.approx(finite.std(), rel=1e-9)
    images = rng.random((20, 2, 3)).astype(numpy.float32)  # value positions in C order
    assert column_stats(images)["mean"] == pytest.approx(
        images.reshape(20, -1).mean(0).tolist(), rel=1e-6)


def test_column_stats_of_a_column_without_finite_values_and_of_what_has_none():
    x = numpy.array([[1.0, numpy.nan], [3.0, numpy.nan]])
    assert column_stats(x) == {"mean": [2.0, None], "std": [1.0, None]}
    assert column_stats(numpy.zeros((4, MAX_COLUMNS + 1), numpy.float32)) is None
    assert column_stats(numpy.zeros((0, 3))) is None
    assert column_stats(numpy.array(["a", "b"])) is None


def test_the_writer_stores_column_stats_for_features_and_regression_targets(tmp_path):
    rng = numpy.random.default_rng(1)
    x = rng.standard_normal((50, 4)).astype(numpy.float32) * 10
    y = rng.standard_normal((50, 2)).astype(numpy.float32) + 100
    write_shards(str(tmp_path / "d"), {"x": x, "y": y}, labels=None)
    m = read_manifest(str(tmp_path / "d" / "train"))
    mean, std = column_scale(m, "y")
    assert mean == pytest.approx(y.mean(0).tolist(), rel=1e-6)
    assert std == pytest.approx(y.std(0).tolist(), rel=1e-5)
    assert column_scale(m, "x")[0] == pytest.approx(x.mean(0).tolist(), rel=1e-5, abs=1e-6)
    assert column_scale(m, "labels") is None


def test_standardize_and_its_inverse():
    layer = Standardize([1.0, None, 5.0], [2.0, 3.0, 0.0], dtype=numpy.float64)
    x = numpy.array([[3.0, 7.0, 6.0]])
    # unknown mean: kept as it is; zero std (a constant column): only centred
    assert layer(x).data.tolist() == [[1.0, 7.0, 1.0]]
    back = Standardize([1.0, None, 5.0], [2.0, 3.0, 0.0], inverse=True, dtype=numpy.float64)
    assert back(layer(x)).data.tolist() == x.tolist()
    assert sorted(layer.state_dict()) == ["mean", "std"]  # buffers: saved, not trained
    assert layer.parameters() == []
    with pytest.raises(ValueError, match="has 2 values per sample"):
        layer(numpy.zeros((1, 2)))


def test_the_inverse_passes_the_gradient_scaled_by_std():
    back = Standardize([10.0, -1.0], [4.0, 0.5], inverse=True, dtype=numpy.float64)
    z = Tensor(numpy.array([[0.3, -0.2], [1.0, 2.0]]), requires_grad=True)
    back(z).sum().backward()
    assert z.grad.tolist() == [[4.0, 0.5], [4.0, 0.5]]


def test_an_mlp_with_scales_is_the_plain_mlp_on_standardised_data():
    rng = numpy.random.default_rng(2)
    x = rng.standard_normal((8, 3)) * [1.0, 100.0, 0.01] + [0.0, 500.0, 1.0]
    mean, std = x.mean(0), x.std(0)
    scaled = mlp([3, 5, 2], seed=0, dtype=numpy.float64, input_stats=(mean, std),
                 target_stats=([10.0, 20.0], [2.0, 3.0]))
    plain = mlp([3, 5, 2], seed=0, dtype=numpy.float64)
    z = plain((x - mean) / std).data
    assert numpy.allclose(scaled(x).data, z * [2.0, 3.0] + [10.0, 20.0], rtol=1e-12)
    assert mlp([3, 5, 2], seed=0, standardize=False, input_stats=(mean, std)).inputs is None
    with pytest.raises(ValueError, match="inputs: 2 statistics for a width of 3"):
        mlp([3, 5, 2], input_stats=([0, 0], [1, 1]))


def _dataset(tmp_path, y):
    rng = numpy.random.default_rng(3)
    x = (rng.standard_normal((40, 3)) * [1, 1000, 0.001]).astype(numpy.float32)
    write_shards(str(tmp_path / "d"), {"x": x, "y": y}, test_fraction=0.25)
    return ShardedDataset(str(tmp_path / "d" / "train"))


def test_the_trainers_mlp_takes_the_train_splits_scales(tmp_path):
    train = _dataset(tmp_path, numpy.arange(40, dtype=numpy.float32) * 7)
    model = build_model(load_config("reviews", ["--model=mlp"]), train)
    mean, std = column_scale(train.manifest, "x")
    assert model.inputs.mean.tolist() == pytest.approx(mean, rel=1e-6)
    assert model.inputs.std.tolist() == pytest.approx(std, rel=1e-6)
    assert model.targets.mean.tolist() == pytest.approx(column_scale(train.manifest, "y")[0])
    raw = build_model(load_config("reviews", ["--model=mlp", "--model.standardize=false"]),
                      train)
    assert raw.inputs is None and raw.targets is None
    with pytest.raises(ConfigError, match="--model.input_stats is not an option"):
        build_model(load_config("reviews", ["--model=mlp", "--model.input_stats=[1]"]), train)


def test_a_classifiers_outputs_are_logits_not_rescaled(tmp_path):
    train = _dataset(tmp_path, numpy.arange(40) % 2)
    model = build_model(load_config("reviews", ["--model=mlp"]), train)
    assert model.inputs is not None and model.targets is None


def test_the_regression_loss_is_in_standard_units_of_the_train_split(tmp_path):
    from mpidl.train.objective import objective_for

    rng = numpy.random.default_rng(4)
    y = (rng.standard_normal((40, 2)) * [1.0, 1000.0]).astype(numpy.float32)
    train = _dataset(tmp_path, y)
    objective = objective_for(load_config("reviews", ["--model=mlp"]), train)
    std = numpy.array(column_scale(train.manifest, "y")[1])

    class Constant:  # predicts 0: the loss is the targets' squared z-scores
        def __call__(self, x):
            return Tensor(numpy.zeros((len(x), 2)))

    x = numpy.zeros((5, 3), numpy.float32)
    loss, count, _ = objective.step(Constant(), x, y[:5].astype(numpy.float64), numpy)
    assert count == 10
    assert float(loss.data) == pytest.approx(float(((y[:5] / std) ** 2).sum()), rel=1e-6)


def test_the_conv_models_predict_regression_targets_in_standard_units(tmp_path):
    rng = numpy.random.default_rng(6)
    x = rng.standard_normal((40, 1, 8, 8)).astype(numpy.float32)
    y = (rng.standard_normal((40, 2)) * [3.0, 300.0] + 1000).astype(numpy.float32)
    write_shards(str(tmp_path / "v"), {"x": x, "y": y})
    train = ShardedDataset(str(tmp_path / "v" / "train"))
    mean, std = column_scale(train.manifest, "y")
    cnn = build_model(load_config("reviews", ["--model=cnn"]), train)
    assert cnn.targets.mean.tolist() == pytest.approx(mean, rel=1e-6)
    assert cnn.targets.std.tolist() == pytest.approx(std, rel=1e-6)
    assert build_model(load_config("reviews", ["--model=cnn", "--model.standardize=false"]),
                       train).targets is None
    # cosmoflow too; a bounded head is in the targets' own units: no standardising then
    volumes = rng.standard_normal((40, 1, 4, 4, 4)).astype(numpy.float32)
    write_shards(str(tmp_path / "w"), {"x": volumes, "y": y})
    train3 = ShardedDataset(str(tmp_path / "w" / "train"))
    assert build_model(load_config("reviews", ["--model=cosmoflow"]),
                       train3).targets is not None
    bounded = build_model(load_config("reviews", ["--model=cosmoflow",
                                                  "--model.output_scale=1.2"]), train3)
    assert bounded.targets is None and bounded.output_scale == 1.2
    out = cnn(x[:3])
    assert out.shape == (3, 2) and numpy.isfinite(out.data).all()


def test_a_dataset_without_column_statistics_is_announced_not_silently_unscaled(tmp_path):
    from mpidl.testing.datasets import edit_manifest
    from mpidl.train.model import unscaled_note

    rng = numpy.random.default_rng(7)
    x = rng.standard_normal((20, 3)).astype(numpy.float32)
    write_shards(str(tmp_path / "d"), {"x": x, "y": numpy.arange(20, dtype=numpy.float32)})
    split = tmp_path / "d" / "train"
    config = load_config("reviews", ["--model=mlp"])
    assert unscaled_note(config, ShardedDataset(str(split))) is None
    edit_manifest(split, lambda m: [f.pop("columns") for f in
                                    m["metadata"]["stats"]["features"].values()])
    old = ShardedDataset(str(split))
    note = unscaled_note(config, old)
    assert note.startswith(f"note: {split} has no column statistics")
    assert "mlp's inputs and regression targets are not standardised" in note
    assert build_model(config, old).inputs is None  # and the model is the raw one
    off = load_config("reviews", ["--model=mlp", "--model.standardize=false"])
    assert unscaled_note(off, old) is None
