"""`mpidl train --data DIR` with no preset: the model and the epochs follow the dataset."""
import numpy
import pytest

from mpidl.data.writer import write_shards, write_text_shards
from mpidl.train.config import load_config
from mpidl.train.data_fit import MAX_EPOCHS, MIN_STEPS, epochs_for, fit_to_data, sets


def _arrays(tmp_path, shape, dtype=numpy.float32, rows=40):
    out = str(tmp_path / "data")
    x = numpy.random.default_rng(0).standard_normal((rows, *shape)).astype(dtype)
    write_shards(out, {"x": x, "y": numpy.arange(rows) % 3}, test_fraction=0.25)
    return out


def _fit(argv):
    preset = None if not argv or argv[0].startswith("-") else argv[0]
    overrides = argv if preset is None else argv[1:]
    config = load_config(preset, overrides)
    return config, fit_to_data(config, preset, overrides)


@pytest.mark.parametrize("shape, model", [
    ((13,), "mlp"), ((), "mlp"), ((8, 8), "cnn"), ((1, 8, 8), "cnn"), ((3, 8, 8), "cnn"),
    ((8, 8, 8), "cosmoflow"), ((2, 4, 4, 4), "cosmoflow"),
])
def test_the_model_follows_the_kind_of_feature_data(tmp_path, shape, model):
    data = _arrays(tmp_path, shape)
    config, notes = _fit([f"--data={data}"])
    assert config.model.name == model
    assert notes[0].startswith(f"model {model} (the data holds float32 samples of shape")


def test_token_ids_get_the_bag_of_words_and_enough_epochs(tmp_path):
    data = str(tmp_path / "text")
    texts = [f"word{i % 50} good" if i % 2 else f"word{i % 50} bad" for i in range(2700)]
    write_text_shards(data, texts, [str(i % 2) for i in range(2700)])
    config, notes = _fit([f"--data={data}"])
    assert config.model.name == "bow" and "token ids" in notes[0]
    # 2,700 samples in batches of 64: 43 steps an epoch; 10 epochs reach MIN_STEPS
    assert config.epochs == 10 and notes[1].startswith("epochs 10 (at least 400 steps")


@pytest.mark.parametrize("argv", [
    ["--model=mlp"], ["--model", "mlp"], ["--model.name=mlp"],
])
def test_a_model_given_on_the_command_line_wins(tmp_path, argv):
    data = _arrays(tmp_path, (8, 8))
    config, notes = _fit([f"--data={data}", *argv])
    assert config.model.name == "mlp" and not any(n.startswith("model") for n in notes)


@pytest.mark.parametrize("argv, epochs", [
    (["--epochs=3"], 3), (["--epochs", "4"], 4), (["--steps=5"], 2),
])
def test_epochs_or_steps_given_on_the_command_line_win(tmp_path, argv, epochs):
    data = _arrays(tmp_path, (5,))
    config, notes = _fit([f"--data={data}", *argv])
    assert config.epochs == epochs and not any(n.startswith("epochs") for n in notes)


def test_a_preset_keeps_its_own_model_and_epochs(tmp_path):
    data = _arrays(tmp_path, (5,))
    config, notes = _fit(["reviews-transformer", f"--data={data}"])
    assert (config.model.name, config.epochs, notes) == ("transformer", 2, [])


def test_an_unreadable_dataset_chooses_nothing_and_is_left_to_the_trainer(tmp_path):
    config, notes = _fit([f"--data={tmp_path / 'missing'}"])
    assert (config.model.name, config.epochs, notes) == ("bow", 2, [])


def test_a_dataset_without_training_samples_chooses_nothing(tmp_path):
    # left to the trainer, which names the split that has none ("has no samples")
    out = str(tmp_path / "data")
    write_shards(out, {"x": numpy.zeros((0, 8), numpy.int32), "y": numpy.zeros(0, numpy.int64)},
                 test_arrays={"x": numpy.zeros((4, 8), numpy.int32),
                              "y": numpy.zeros(4, numpy.int64)})
    config, notes = _fit([f"--data={out}"])
    assert (config.model.name, config.epochs, notes) == ("bow", 2, [])


def test_the_generated_corpus_keeps_the_presets_choices():
    config, notes = _fit([])
    assert (config.model.name, config.epochs, notes) == ("bow", 2, [])


@pytest.mark.parametrize("samples, batch, at_least, epochs", [
    (2700, 64, 2, 10),                      # the UCI sentences: 43 steps an epoch
    (25000, 64, 2, 2),                      # the generated reviews keep the preset's 2
    (142, 64, 2, MAX_EPOCHS),               # the wine table: 3 steps an epoch, capped
    (1_000_000, 64, 2, 2), (0, 64, 2, MAX_EPOCHS),
])
def test_epochs_give_at_least_min_steps_within_the_bounds(samples, batch, at_least, epochs):
    got = epochs_for(samples, batch, at_least)
    assert got == epochs
    per_epoch = -(-samples // batch)
    assert got * per_epoch >= MIN_STEPS or got == MAX_EPOCHS


def test_sets_reads_every_spelling_of_a_key():
    assert sets(["--global-batch=8"], "global_batch") and sets(["--global_batch", "8"],
                                                                  "global_batch")
    assert sets(["--model.name=bow"], "model") and not sets(["--model.dim=4"], "model")
    assert not sets(["--epochs-x=1"], "epochs")


def test_the_linear_model_gets_its_own_rate_unless_one_is_given(tmp_path):
    data = _arrays(tmp_path, (5,))
    config, notes = _fit([f"--data={data}", "--model=linear"])
    assert config.lr == 1e-2 and any(n.startswith("lr 0.01") for n in notes)
    config, _ = _fit([f"--data={data}", "--model=linear", "--lr=3e-3"])
    assert config.lr == 3e-3


@pytest.mark.parametrize("rows, model", [(400, "linear"), (1400, "mlp")])
def test_a_small_regression_table_gets_the_linear_model(tmp_path, rows, model):
    out = str(tmp_path / "data")
    x = numpy.random.default_rng(0).standard_normal((rows, 10)).astype(numpy.float32)
    write_shards(out, {"x": x, "y": x[:, 0] * 2.0}, test_fraction=0.25, labels=None)
    config, notes = _fit([f"--data={out}"])
    assert config.model.name == model
    if model == "linear":  # 300 training rows: fewer than LINEAR_ROWS; its own rate
        assert "regression targets, 300 training rows: fewer than 1000" in notes[0]
        assert config.lr == 1e-2
