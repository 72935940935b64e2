"""PowerSGD's choices before any rank runs: what a compression value means, which
members of a bucket are compressed, how many elements travel, what the config accepts."""
from __future__ import annotations

import pytest

from mpidl.parallel import PowerSGDOptions, parse_compression
from mpidl.parallel.compression_choice import describe
from mpidl.parallel.powersgd import plan_bucket, wire_elements
from mpidl.train.config import Config, ConfigError, apply_overrides
from mpidl.train.config_checks import compression_of, validate


@pytest.mark.parametrize("text, parsed", [
    ("none", None), (None, None), ("fp16", "float16"), ("bf16", "bfloat16"),
    ("float16", "float16"), ("bfloat16", "bfloat16"),
    ("powersgd:4", PowerSGDOptions(matrix_approximation_rank=4)),
    ("PowerSGD:1", PowerSGDOptions()),
])
def test_every_spelling_reads_as_one_choice(text, parsed):
    assert parse_compression(text) == parsed
    assert parse_compression(describe(parsed)) == parsed


@pytest.mark.parametrize("text", ["zip", "powersgd", "powersgd:", "powersgd:0",
                                  "powersgd:-1", "powersgd:2.5", "powersgd:x", "fp8"])
def test_a_bad_value_names_itself_and_the_choices(text):
    with pytest.raises(ValueError, match=f"compression {text!r} is not one of none, fp16, "
                                         "bf16 or powersgd:R"):
        parse_compression(text)


def test_the_defaults_are_pytorchs():
    o = PowerSGDOptions()
    assert (o.matrix_approximation_rank, o.start_powerSGD_iter, o.use_error_feedback,
            o.warm_start, o.min_compression_rate) == (1, 1000, True, True, 2.0)


def test_biases_and_small_matrices_travel_uncompressed_together():
    # bucket order: a (64, 32) matrix, its bias, a (3, 4) matrix, a (4, 2, 2) filter bank
    plan = plan_bucket([(64, 32), (32,), (3, 4), (4, 2, 2)], PowerSGDOptions(4))
    assert [(k.index, k.n, k.m, k.rank) for k in plan.matrices] == [(0, 64, 32, 4)]
    # the bias and the two small tensors are adjacent: one run of 32 + 12 + 16
    assert plan.plain == [(2048, 60)]
    assert (plan.p_size, plan.q_size) == (64 * 4, 32 * 4)
    assert wire_elements([(64, 32), (32,), (3, 4), (4, 2, 2)], PowerSGDOptions(4)) == \
        (60 + 256, 128)


def test_the_rank_is_capped_by_the_matrix_and_a_threshold_of_zero_compresses_all():
    plan = plan_bucket([(3, 9), (5,)], PowerSGDOptions(8, min_compression_rate=0.0))
    assert [(k.n, k.m, k.rank) for k in plan.matrices] == [(3, 9, 3)]
    assert plan.plain == [(27, 5)]


def test_the_config_reads_the_choice_and_refuses_model_splits():
    config = apply_overrides(Config(), ["--compression", "powersgd:2",
                                        "--start-powersgd-iter=5"])
    validate(config)
    assert compression_of(config) == PowerSGDOptions(2, start_powerSGD_iter=5)
    for split in (["--zero=1"], ["--zero=3"], ["--tensor-parallel=2"],
                  ["--pipeline-parallel=2"], ["--sequence-parallel=ring"]):
        with pytest.raises(ConfigError, match="PowerSGD compresses whole-model data"):
            validate(apply_overrides(Config(), ["--compression=powersgd:2", *split]))
    validate(apply_overrides(Config(), ["--compression=bf16", "--zero=2"]))
    with pytest.raises(ConfigError, match="'compression'.*'powersgd:0' is not one of"):
        validate(apply_overrides(Config(), ["--compression=powersgd:0"]))
