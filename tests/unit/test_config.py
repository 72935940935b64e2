"""The training configuration: presets, files, overrides, type checks, TOML round trip."""
from __future__ import annotations

import dataclasses
import re
import sys
import typing

import pytest

from mpidl.train.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    default_run_dir,
    list_presets,
    load_config,
    parse_overrides,
    split_args,
    to_toml,
)
from mpidl.train.model_keys import check_model, check_model_kwargs

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def test_no_arguments_gives_the_reviews_preset():
    config = load_config()
    assert config.task == "reviews"
    assert config.model.name in ("bow", "transformer")
    assert config.data.num_train == 25000 and config.data.num_test == 25000


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_round_trips(name):
    config = load_config(name)
    assert config_from_dict(tomllib.loads(to_toml(config))) == config


def test_presets_include_reviews():
    assert "reviews" in list_presets()


def test_override_forms_equals_space_flag_and_negated_flag():
    config = load_config("reviews", ["--epochs=5", "--lr", "0.01", "--trace",
                                     "--no-checkpoint-epochs", "--global-batch=128"])
    assert config.epochs == 5 and config.lr == 0.01 and config.global_batch == 128
    assert config.trace is True and config.checkpoint_epochs is False


def test_parse_overrides_turns_dashes_into_underscores():
    assert parse_overrides(["--run-dir", "x", "--flag", "--model.num-heads=4"]) == [
        ("run_dir", "x"), ("flag", None), ("model.num_heads", "4")]


def test_table_shorthand_sets_model_name_and_data_path():
    config = load_config(None, ["--model=transformer", "--data", "some/dir"])
    assert config.model.name == "transformer" and config.data.path == "some/dir"
    assert config_from_dict({"model": "mlp"}).model.name == "mlp"


def test_nested_keys_and_model_kwargs():
    config = load_config(None, ["--data.seq-len=64", "--model.dim=32", "--model.hidden=[16, 8]",
                                "--model.act=gelu", "--model.dropout=0.1"])
    assert config.data.seq_len == 64
    assert config.model.kwargs == {"dim": 32, "hidden": [16, 8], "act": "gelu", "dropout": 0.1}


def test_optional_key_can_be_cleared_and_set():
    config = load_config(None, ["--steps=100", "--clip-grad-norm=1"])
    assert config.steps == 100 and config.clip_grad_norm == 1.0
    assert isinstance(config.clip_grad_norm, float)
    assert load_config(None, ["--steps=100", "--steps=none"]).steps is None


@pytest.mark.parametrize("args, expected", [
    (["--resume"], True), (["--resume=false"], False), (["--resume", "auto"], "auto"),
    (["--resume", "runs/a/checkpoints/checkpoint-00000010.h5"],
     "runs/a/checkpoints/checkpoint-00000010.h5"),
    (["--resume", "--epochs=1"], True),
])
def test_resume_accepts_bool_auto_or_path(args, expected):
    assert load_config(None, args).resume == expected


@pytest.mark.parametrize("args, words", [
    (["--epoch=3"], ["'epoch'", "'epochs'"]),
    (["--data.num-trian=3"], ["'data.num_trian'", "'data.num_train'"]),
    (["--lerning-rate=1"], ["'lerning_rate'"]),
])
def test_unknown_key_is_named_with_close_matches(args, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("args, words", [
    (["--epochs=3.5"], ["'epochs'", "'3.5'", "int"]),
    (["--lr=fast"], ["'lr'", "'fast'", "float"]),
    (["--trace=maybe"], ["'trace'", "'maybe'", "bool"]),
    (["--steps=lots"], ["'steps'", "'lots'", "int or none"]),
    (["--optimizer=adamx"], ["'optimizer'", "'adamx'", "'adam'"]),
    (["--epochs"], ["'epochs'", "needs a value"]),
    (["--epochs=0"], ["'epochs'", ">= 1"]),
    (["--epochs.x=1"], ["'epochs'", "not a table"]),
])
def test_wrong_type_or_value_names_key_value_and_expected(args, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    for word in words:
        assert word in str(err.value)


def test_model_kwarg_type_is_checked_against_the_value_already_there(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "transformer"\ndim = 128\n')
    assert load_config(str(path), ["--model.dim=64"]).model.kwargs == {"dim": 64}
    with pytest.raises(ConfigError, match="'model.dim'.*'big'"):
        load_config(str(path), ["--model.dim=big"])


def test_toml_file_values_are_type_checked(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('epochs = "three"\n')
    with pytest.raises(ConfigError, match="'epochs'.*str.*expected int"):
        load_config(str(path))
    path.write_text("lr = 1\n")                      # an int is a fine float
    assert load_config(str(path)).lr == 1.0
    path.write_text("epochs = true\n")               # a bool is not an int
    with pytest.raises(ConfigError, match="'epochs'"):
        load_config(str(path))
    path.write_text("[data]\nsequence = 3\n")
    with pytest.raises(ConfigError, match="'data.sequence'"):
        load_config(str(path))


def test_the_generated_language_corpus_limits_are_config_errors():
    with pytest.raises(ConfigError, match="'data.seq_len' must be >= 4 .*language.*got 3"):
        load_config("gpt", ["--data.seq-len=3"])
    with pytest.raises(ConfigError, match="'data.vocab_size' must be >= 8 .*got 5"):
        load_config("gpt", ["--data.vocab-size=5"])
    assert load_config("gpt", ["--data.seq-len=4"]).data.seq_len == 4
    assert load_config("gpt", ["--data.seq-len=3", "--data=somewhere"]).data.seq_len == 3


def test_missing_file_is_named(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="nope.toml.*does not exist"):
        load_config(missing)


def test_unknown_preset_lists_presets_and_close_match():
    with pytest.raises(ConfigError, match="'reviewz'.*did you mean 'reviews'"):
        load_config("reviewz")


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("epochs = = 3\n")
    with pytest.raises(ConfigError, match="broken.toml.*not valid TOML"):
        load_config(str(path))


def test_round_trip_of_awkward_values():
    config = load_config(None, ["--steps=7", "--lr=1e-05", "--run-dir", 'a "quoted" dir/ü\\x',
                                "--model.hidden=[3, 4]", "--model.flag=true",
                                "--model.scale=0.1", "--warmup-fraction=0.0"])
    config.model.kwargs["nested"] = {"a": 1, "b c": "d"}
    text = to_toml(config)
    back = config_from_dict(tomllib.loads(text))
    assert back == config
    assert to_toml(back) == text


def test_none_valued_keys_are_left_out_and_come_back_as_none():
    text = to_toml(Config())
    assert "# steps = none" in text
    assert config_from_dict(tomllib.loads(text)).steps is None


def test_every_optional_key_defaults_to_none():
    # to_toml leaves None out (TOML has no null), so reading it back gives the default:
    # that is only None when the default is None.
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        if type(None) in typing.get_args(hints[f.name]):
            assert f.default is None, f.name


def test_scaled_lr_and_warmup():
    config = load_config(None, ["--lr=0.001", "--base-batch=64", "--global-batch=256"])
    assert config.scaled_lr() == pytest.approx(0.002)  # auto: AdamW's rule is sqrt
    config.lr_scaling = "linear"
    assert config.scaled_lr() == pytest.approx(0.004)
    config.lr_scaling = "sqrt"
    assert config.scaled_lr() == pytest.approx(0.002)
    config.lr_scaling = "none"
    assert config.scaled_lr() == 0.001
    config.warmup_steps, config.warmup_fraction = 0, 0.1
    assert config.warmup_for(1000) == 100
    config.warmup_steps = 30
    assert config.warmup_for(1000) == 30 and config.warmup_for(10) == 10


def test_split_args_takes_a_leading_preset_or_file():
    assert split_args([]) == (None, [])
    assert split_args(["my.toml", "--epochs=1"]) == ("my.toml", ["--epochs=1"])
    assert split_args(["--epochs=1"]) == (None, ["--epochs=1"])


def test_positional_after_overrides_is_an_error():
    with pytest.raises(ConfigError, match="must come first"):
        apply_overrides(Config(), ["--trace", "true", "extra.toml"])


def _model(vocab_size: int, dim: int = 128, dropout: float = 0.0, causal: bool = False):
    return None


def test_check_model_kwargs_against_the_constructor():
    config = load_config(None, ["--model.dim=64", "--model.dropout=0"])
    check_model_kwargs(config, _model)
    assert config.model.kwargs == {"dim": 64, "dropout": 0.0}
    config = load_config(None, ["--model.dimm=64"])
    with pytest.raises(ConfigError, match="'model.dimm'.*'model.dim'"):
        check_model_kwargs(config, _model)
    config = load_config(None, ["--model.causal=yes"])      # a string, not a bool
    with pytest.raises(ConfigError, match="'model.causal'"):
        check_model_kwargs(config, _model)


@pytest.mark.parametrize("args, message", [
    (["--model=transformer", "--model.dimm=64"], "'model.dimm'; did you mean 'model.dim'"),
    (["--model=transformer", "--model.dim=big"], "'model.dim'"),
    (["--model=bowx"], "unknown model 'bowx'; did you mean 'bow'"),
])
def test_the_reference_models_keys_are_checked_through_their_factories(args, message):
    # The factories take **kwargs and hand them to the model class: its constructor
    # decides which keys exist.
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_model(load_config(None, args))
    config = load_config(None, ["--model=transformer", "--model.dropout=0.1",
                                "--model.layers=1"])
    check_model(config)
    assert config.model.kwargs == {"dropout": 0.1, "layers": 1}


@pytest.mark.parametrize("arg, key", [
    ("--lr=inf", "'lr' must be a finite number > 0"), ("--min-lr-ratio=-3", "'min_lr_ratio'"),
    ("--weight-decay=-0.1", "'weight_decay'"), ("--momentum=1.5", "'momentum'"),
    ("--seed=-1", "'seed' must be >= 0"), ("--data.prefetch=-1", "'data.prefetch'"),
])
def test_out_of_range_values_name_their_key(arg, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(None, [arg])


def test_default_run_dir_uses_the_job_id_so_requeued_jobs_resume():
    config = Config()
    assert default_run_dir(config, job_id="4242").endswith("reviews-bow-4242")
    assert default_run_dir(config, stamp="20250101-000000").startswith("runs")


def test_the_training_order_is_configurable_and_checked():
    config = load_config(None, ["--data.shuffle=full", "--data.block_size=16"])
    assert (config.data.shuffle, config.data.block_size) == ("full", 16)
    assert load_config().data.block_size == 64  # the sampler's default
    with pytest.raises(ConfigError, match="'data.block_size' must be >= 1"):
        load_config(None, ["--data.block_size=0"])
    with pytest.raises(ConfigError, match="not one of \\['block', 'full'\\]"):
        load_config(None, ["--data.shuffle=random"])


def test_train_help_shows_the_values_the_same_command_would_run(capsys):
    from mpidl.train.command import main as train_main

    assert train_main(["reviews-transformer", "--epochs=7", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Keys as `reviews-transformer` sets them" in out
    assert "\nepochs = 7\n" in out and "\nclip_grad_norm = 1.0\n" in out
    assert train_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Keys as `reviews` sets them" in out and "\nepochs = 2\n" in out


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_the_watchdog_timeout_key_is_seconds_or_none(value):
    with pytest.raises(ConfigError, match=r"'timeout' must be a finite number >= 0 \(seconds"):
        load_config(None, [f"--timeout={value}"])
    assert load_config(None, ["--timeout=0"]).timeout == 0
    assert load_config(None, ["--timeout=none"]).timeout is None


def test_the_nonfinite_policy_keys_are_checked():
    assert load_config(None, ["--nonfinite=skip", "--nonfinite-steps=3"]).nonfinite == "skip"
    with pytest.raises(ConfigError, match="nonfinite"):
        load_config(None, ["--nonfinite=ignore"])
    with pytest.raises(ConfigError, match="'nonfinite_steps' must be >= 1"):
        load_config(None, ["--nonfinite-steps=0"])


@pytest.mark.parametrize("key", ["bucket-mb", "clip-grad-norm", "lr"])
@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_a_size_or_a_rate_is_a_finite_number_above_zero(key, value):
    with pytest.raises(ConfigError, match=f"'{key.replace('-', '_')}' must be a finite number "
                                          f"> 0.*got {value}"):
        load_config(None, [f"--{key}={value}"])


def test_the_custom_task_without_a_dataset_is_a_config_error_naming_the_option():
    with pytest.raises(ConfigError, match="task 'custom' trains on your dataset: pass "
                                          "--data=DIR"):
        load_config(None, ["--task=custom"])


@pytest.mark.parametrize("args", [["--schedule=gpipe"], ["--schedule", "gpipe"],
                                  ["--pipeline-schedule=gpipe"]])
def test_schedule_takes_a_pipeline_schedule_name_too(args, tmp_path):
    # The learning-rate and pipeline schedules share the key `schedule` (disjoint names).
    config = load_config("gpt", args + ["--schedule=linear"])
    assert (config.pipeline_schedule, config.schedule) == ("gpipe", "linear")
    path = tmp_path / "run.toml"
    path.write_text('task = "gpt"\nschedule = "interleaved"\n')
    config = load_config(str(path))
    assert (config.pipeline_schedule, config.schedule) == ("interleaved", "cosine")
    with pytest.raises(ConfigError, match="neither a learning-rate schedule .* nor a "
                                          "pipeline schedule"):
        load_config("gpt", ["--schedule=1F1B"])


def test_the_pipeline_and_recompute_keys_are_checked():
    config = load_config("gpt", ["--pipeline-parallel=2", "--virtual-stages=2",
                                 "--recompute=selective"])
    assert (config.pipeline_parallel, config.virtual_stages, config.recompute) == \
        (2, 2, "selective")
    for bad in ("--pipeline-parallel=0", "--virtual-stages=0"):
        with pytest.raises(ConfigError, match="must be >= 1"):
            load_config("gpt", [bad])
    with pytest.raises(ConfigError, match="recompute"):
        load_config("gpt", ["--recompute=some"])
