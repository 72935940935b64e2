"""mpidl plan's command line: every input checked before anything is measured."""
from __future__ import annotations

import argparse
import json

import pytest

from mpidl import plan_command
from mpidl.train.config import load_config


def test_rank_counts_are_read_from_a_comma_separated_list():
    assert plan_command.rank_counts("1, 2,8") == [1, 2, 8]


@pytest.mark.parametrize("text", ["", "0,2", "two", "1,-4"])
def test_a_rank_list_without_counts_of_at_least_one_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="rank counts >= 1, comma-separated"):
        plan_command.rank_counts(text)


def test_a_data_parallel_config_passes_the_layout_check():
    plan_command.check_layout(load_config("gpt"))


def test_a_tensor_split_is_refused_because_the_modes_table_prices_it():
    with pytest.raises(ValueError, match="--tensor-parallel=2: mpidl plan times one rank's "
                                         "data-parallel step.*leave out --tensor-parallel=2"):
        plan_command.check_layout(load_config("gpt", ["--tensor-parallel=2"]))


def test_a_split_of_a_model_that_cannot_split_says_which_model_it_is():
    with pytest.raises(ValueError, match="this config's model is 'bow'"):
        plan_command.check_layout(load_config("reviews", ["--sequence-parallel=ring"]))


@pytest.mark.parametrize("argv, words", [
    (["--step-time", "-5"], "argument --step-time: '-5' must be a finite number > 0"),
    (["--epochs", "0"], "argument --epochs: '0' must be a finite number > 0"),
    (["--samples", "-100"], "argument --samples: '-100' must be an integer >= 1"),
    (["--memory-gb", "nan"], "argument --memory-gb: 'nan' must be a finite number > 0"),
    (["--ranks-per-node", "0"], "argument --ranks-per-node: '0' must be an integer >= 1"),
    (["--setup-hours", "-3"], "argument --setup-hours: '-3' must be a finite number >= 0"),
    (["--queue-hours", "nan"], "argument --queue-hours: 'nan' must be a finite number >= 0"),
    (["--json", "/"], "argument --json: '/' is a directory"),
])
def test_every_number_and_output_file_is_checked_as_it_is_read(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        plan_command._parser().parse_known_args(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_a_config_override_in_the_space_form_is_not_taken_for_a_preset():
    args, rest = plan_command._parser().parse_known_args(
        ["--tensor-parallel", "2", "--step-time", "1"])
    assert rest == ["--tensor-parallel", "2"] and args.step_time == 1.0


GPT3_ARGS = ["gpt", "--layouts", "--model.layers=96", "--model.dim=12288", "--model.heads=96",
             "--data.seq-len=2048", "--data.vocab-size=51200", "--global-batch=1536",
             "--zero=1", "--precision", "bf16", "--recompute", "selective", "--device", "h100",
             "--ranks", "512,1024", "--ranks-per-node", "8", "--node-network", "nvlink",
             "--network", "ib-ndr"]


def test_plan_layouts_proposes_a_fitting_layout_and_writes_the_new_fields(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert plan_command.main([*GPT3_ARGS, "--json", str(path)]) == 0  # builds no model: ~0.1 s
    out = capsys.readouterr().out
    assert "174,615,846,912 parameters" in out and "proposal: 1024 ranks: t" in out
    doc = json.loads(path.read_text())
    assert doc["options"] == {"precision": "bf16", "recompute": "selective", "schedule": "1f1b",
                              "virtual": 1, "microbatch": 1, "zero": 1, "copies": 2,
                              "sequence_parallel": True}
    best = doc["proposals"]["1024"]
    for key in ("bubble", "p2p_bytes", "p2p_s", "dp_s", "tied_s", "state_bytes",
                "activation_bytes", "memory_bytes", "mfu", "step_s", "layout"):
        assert key in best
    assert best["fits"] and best["memory_bytes"] <= doc["memory_per_rank"] == 80e9
    assert best["tensor"] * best["pipeline"] * best["data"] == 1024
    assert {row["ranks"] for row in doc["layouts"]} == {512, 1024}


def test_a_fixed_pipeline_and_schedule_are_priced_as_asked(tmp_path):
    path = tmp_path / "plan.json"
    argv = [*GPT3_ARGS, "--tensor-parallel=8", "--pipeline-parallel", "8",
            "--pipeline-schedule", "interleaved", "--virtual-stages", "4", "--json", str(path)]
    assert plan_command.main(argv) == 0
    rows = json.loads(path.read_text())["layouts"]
    assert {(r["tensor"], r["pipeline"]) for r in rows} == {(8, 8)}
    assert rows[-1]["bubble"] == pytest.approx(7 / (4 * 96))  # 1024 ranks: d 16, m 96


@pytest.mark.parametrize("argv, words", [
    (["--recompute", "full"], "--recompute prices tensor x pipeline x data layouts: add --layouts"),
    (["--layouts"], "--layouts prices the gpt model's layouts from FLOPs: name the device"),
    (["--layouts", "--device", "h100", "--pipeline-schedule", "interleaved",
      "--virtual-stages", "1"], "--virtual-stages=1 is plain 1F1B"),
    (["--layouts", "--device", "h100", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--layouts", "--device", "h100", "--pipeline-parallel", "0"], "must be an integer >= 1"),
])
def test_bad_layout_flags_exit_2_with_one_message(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        plan_command.main(["gpt", *argv])
    assert exc.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--zero=2"], "--zero=2: layouts with a pipeline price ZeRO 1"),
    # The schedule may come from the config (pipeline_schedule): checked once it is read.
    (["--virtual-stages", "2"],
     "--virtual-stages=2: model chunks per rank are the interleaved schedule's"),
    (["--model=bow"], "this config's model is 'bow'"),
    (["--device", "cpu-core"], "device profile 'cpu-core'"),
])
def test_layouts_of_what_cannot_be_priced_exit_2_saying_what_can(argv, words, capsys):
    assert plan_command.main([*GPT3_ARGS, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpidl plan: error: ") and words in err


def test_the_configs_pipeline_keys_are_the_layout_flags_defaults(tmp_path):
    # A config (a run's config.toml) with a pipeline prices it; the flags given win.
    config = tmp_path / "run.toml"
    config.write_text('task = "gpt"\npipeline_parallel = 8\nschedule = "interleaved"\n'
                      'virtual_stages = 4\nrecompute = "full"\n[model]\nname = "gpt"\n')
    path = tmp_path / "plan.json"
    argv = [str(config), *GPT3_ARGS[1:], "--tensor-parallel=8", "--json", str(path)]
    argv.remove("selective")
    argv.remove("--recompute")
    assert plan_command.main(argv) == 0
    doc = json.loads(path.read_text())
    assert (doc["options"]["schedule"], doc["options"]["virtual"],
            doc["options"]["recompute"]) == ("interleaved", 4, "full")
    assert {(r["tensor"], r["pipeline"]) for r in doc["layouts"]} == {(8, 8)}
    again = [*argv, "--pipeline-parallel", "4", "--recompute", "none"]
    assert plan_command.main(again) == 2  # plan.json is there: written over only with --force
    assert plan_command.main([*again, "--force"]) == 0
    doc = json.loads(path.read_text())
    assert doc["options"]["recompute"] == "none"
    assert {r["pipeline"] for r in doc["layouts"]} == {4}


def test_a_pipeline_config_without_layouts_is_refused_saying_what_prices_it():
    with pytest.raises(ValueError, match="--pipeline-parallel=2: mpidl plan times one rank's "
                                         "data-parallel step.*--layouts"):
        plan_command.check_layout(load_config("gpt", ["--pipeline-parallel=2"]))
