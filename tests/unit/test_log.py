"""Rank-0 printing, the progress bar (tqdm or plain lines), the summary table."""
from __future__ import annotations

import io

import pytest

from mpidl.train.log import (
    Logger,
    ProgressBar,
    format_duration,
    format_summary,
    format_table,
    format_value,
)


def test_info_on_rank_zero_only_and_warnings_from_any_rank(capsys):
    Logger(rank=1, size=2).info("hidden")
    Logger(rank=0, size=2).info("shown")
    Logger(rank=1, size=2).warning("disk almost full")
    out, err = capsys.readouterr()
    assert out == "shown\n"
    assert err == "rank 1/2: warning: disk almost full\n"


def test_batch_jobs_get_plain_lines_with_eta():
    out = io.StringIO()                       # not a terminal, as in a Slurm log
    bar = ProgressBar(total=10, file=out, plain_every=0.0)
    for _ in range(4):
        bar.update(loss=0.5, samples_per_s=12345.0)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 5 and "\r" not in out.getvalue()
    assert lines[-1].startswith("train 4/10 (40%) loss 0.5 samples_per_s 12.3k | elapsed")
    assert "eta" in lines[-1]


def test_other_ranks_and_never_mode_print_nothing():
    for kwargs in ({"enabled": False}, {"mode": "never"}, {"enabled": False, "mode": "always"}):
        out = io.StringIO()
        with ProgressBar(total=3, file=out, plain_every=0.0, **kwargs) as bar:
            bar.update(loss=1.0)
            bar.write("message")
        assert out.getvalue() == ""


def test_always_mode_draws_a_tqdm_bar_and_resumes_from_initial():
    out = io.StringIO()
    with ProgressBar(total=10, initial=5, mode="always", file=out) as bar:
        bar.update(2, loss=0.25)
        bar.write("evaluated epoch 0")
    text = out.getvalue()
    assert "7/10" in text and "loss=0.25" in text and "evaluated epoch 0" in text
    with pytest.raises(ValueError, match="'sometimes'"):
        ProgressBar(total=1, mode="sometimes")


def test_eta_from_steps_done_since_start():
    bar = ProgressBar(total=100, initial=50, enabled=False)
    assert bar.eta() == float("inf")


def test_formatting_helpers():
    assert format_duration(4.31) == "4.3s" and format_duration(float("nan")) == "?"
    assert format_duration(75.2) == "1m15s" and format_duration(3725) == "1h02m05s"
    assert format_value(0.123456) == "0.1235" and format_value(2e-5) == "2.00e-05"
    assert format_value(3) == "3" and format_value(25000.0) == "25.0k"


def test_table_aligns_numbers_right_and_text_left():
    table = format_table(["name", "value"], [["loss", 0.5], ["accuracy", 0.93125]], title="result")
    assert table.splitlines() == [
        "result",
        "name       value",
        "--------  ------",
        "loss         0.5",
        "accuracy  0.9313",
    ]


def test_summary_has_one_row_per_evaluation_and_the_totals():
    records = [
        {"kind": "train", "step": 1, "epoch": 0, "loss": 0.6, "accuracy": 0.7},
        {"kind": "train", "step": 2, "epoch": 0, "loss": 0.4, "accuracy": 0.9},
        {"kind": "eval", "step": 2, "epoch": 0, "test_loss": 0.3, "test_accuracy": 0.92},
        {"kind": "eval", "step": 4, "epoch": 1, "test_loss": 0.2, "test_accuracy": 0.94},
    ]
    text = format_summary(records, {"wall time": format_duration(151), "ranks": 2})
    lines = text.splitlines()
    assert lines[0].split() == ["epoch", "step", "train", "loss", "train", "acc", "test", "loss",
                                "test", "acc"]
    assert lines[2].split() == ["0", "2", "0.5", "0.8", "0.3", "0.92"]
    assert lines[3].split() == ["1", "4", "-", "-", "0.2", "0.94"]
    assert lines[-2:] == ["wall time: 2m31s", "ranks:     2"]


def test_a_diverging_loss_and_a_missing_value_read_as_numbers_not_nonsense():
    assert format_value(5.760173386189647e26) == "5.76e+26"  # was "576017338618964706263564288.0k"
    assert format_value(1_234_567.0) == "1.23e+06" and format_value(999_999.0) == "1000.0k"
    assert format_value(None) == "-"  # a JSON null: no counted sample, or not finite


def test_summary_of_a_run_whose_windows_were_all_skipped_shows_dashes():
    records = [
        {"kind": "train", "epoch": 0, "step": 8, "loss": None, "accuracy": None},
        {"kind": "eval", "epoch": 0, "step": 8, "test_loss": None, "test_accuracy": 0.05},
        {"kind": "train", "epoch": 1, "step": 16, "loss": 5.76e26, "accuracy": 0.36},
        {"kind": "eval", "epoch": 1, "step": 16, "test_loss": 1.5e6, "test_accuracy": 0.64},
    ]
    text = format_summary(records, {"final test accuracy": None})
    assert "None" not in text and "k " not in text and not text.endswith("k")
    rows = text.splitlines()
    assert rows[2].split() == ["0", "8", "-", "-", "-", "0.05"]
    assert rows[3].split() == ["1", "16", "5.76e+26", "0.36", "1.5e+06", "0.64"]
    assert rows[-1].split() == ["final", "test", "accuracy:", "-"]
