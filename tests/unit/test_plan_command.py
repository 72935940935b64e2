"""mpidl plan's command line: every input checked before anything is measured."""
from __future__ import annotations

import argparse

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
