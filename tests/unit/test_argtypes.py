"""hpc.argtypes: command-line values checked as argparse reads them."""
from __future__ import annotations

import argparse
import os

import pytest

from hpc import argtypes


@pytest.mark.parametrize("check, text, value", [
    (argtypes.positive_int, "3", 3),
    (argtypes.positive_int, "1" * 400, int("1" * 400)),  # no float conversion to overflow
    (argtypes.nonnegative_int, "0", 0),
    (argtypes.positive_float, "0.25", 0.25),
    (argtypes.positive_float, "1e-9", 1e-9),
    (argtypes.nonnegative_float, "0", 0.0),
])
def test_a_value_inside_its_range_is_converted(check, text, value):
    assert check(text) == value


@pytest.mark.parametrize("check, text, words", [
    (argtypes.positive_int, "0", "'0' must be an integer >= 1"),
    (argtypes.positive_int, "-2", "'-2' must be an integer >= 1"),
    (argtypes.positive_int, "1.5", "'1.5' is not an integer"),
    (argtypes.nonnegative_int, "-1", "'-1' must be an integer >= 0"),
    (argtypes.positive_float, "-5", "'-5' must be a finite number > 0"),
    (argtypes.positive_float, "0", "'0' must be a finite number > 0"),
    (argtypes.positive_float, "nan", "'nan' must be a finite number > 0"),
    (argtypes.positive_float, "inf", "'inf' must be a finite number > 0"),
    (argtypes.positive_float, "fast", "'fast' is not a number"),
    (argtypes.nonnegative_float, "-3", "'-3' must be a finite number >= 0"),
    (argtypes.nonnegative_float, "nan", "'nan' must be a finite number >= 0"),
])
def test_a_value_outside_its_range_names_the_value_and_the_limit(check, text, words):
    with pytest.raises(argparse.ArgumentTypeError, match="e.g.") as exc:
        check(text)
    assert words in str(exc.value)


def test_number_problem_is_none_for_a_good_number_and_the_rule_for_a_bad_one():
    assert argtypes.number_problem(1.0, 0, strict=True) is None
    assert argtypes.number_problem(0.0, 0, strict=False) is None
    assert argtypes.number_problem(0.0, 0, strict=True) == "must be a finite number > 0"
    assert argtypes.number_problem(float("inf"), 0, strict=False) == \
        "must be a finite number >= 0"


def test_an_output_file_in_an_existing_directory_is_accepted(tmp_path):
    assert argtypes.output_file(str(tmp_path / "plan.json")) == str(tmp_path / "plan.json")
    (tmp_path / "old.json").write_text("{}")
    assert argtypes.output_file(str(tmp_path / "old.json")) == str(tmp_path / "old.json")


@pytest.mark.parametrize("name, words", [
    ("", "an empty file name"),
    (".", "is a directory; name a file to write"),
    ("missing/x.png", "missing does not exist; create it (mkdir -p"),
])
def test_an_output_file_that_cannot_be_written_is_refused_with_the_fix(tmp_path, name, words):
    path = str(tmp_path / name) if name not in ("", ".") else (name and str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        argtypes.output_file(path)
    assert words in str(exc.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_output_file_in_a_read_only_directory_is_refused(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(argparse.ArgumentTypeError, match="permission denied"):
            argtypes.output_file(str(tmp_path / "x"))
    finally:
        tmp_path.chmod(0o700)


def test_an_output_directory_that_can_be_made_or_written_has_no_problem(tmp_path):
    assert argtypes.output_dir_problem(str(tmp_path)) is None
    assert argtypes.output_dir_problem(str(tmp_path / "new" / "deeper")) is None
    assert not (tmp_path / "new").exists()  # the check makes nothing


@pytest.mark.parametrize("name, words", [
    ("", "an empty directory name"),
    ("file", "'{d}/file' is a file, not a directory; name a directory"),
    ("file/out", "'{d}/file/out': '{d}/file' is a file, so no directory can be made under it"),
    ("file/out/deeper", "'{d}/file' is a file, so no directory can be made under it"),
])
def test_an_output_directory_under_or_at_a_file_is_a_problem_naming_it(tmp_path, name, words):
    (tmp_path / "file").write_text("x")
    path = str(tmp_path / name) if name else ""
    assert words.format(d=tmp_path) in argtypes.output_dir_problem(path)
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere a permission bit "
                    "forbids (the read-only filesystem case: tests/integration/"
                    "test_bad_inputs.py)")
def test_an_output_directory_in_a_read_only_directory_is_a_problem(tmp_path):
    tmp_path.chmod(0o500)
    try:
        assert "cannot be written (Permission denied)" in \
            argtypes.output_dir_problem(str(tmp_path / "out"))
    finally:
        tmp_path.chmod(0o700)


def test_through_argparse_a_bad_value_exits_2_naming_the_option(capsys):
    parser = argparse.ArgumentParser(prog="mpidl plan")
    parser.add_argument("--step-time", type=argtypes.positive_float)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--step-time", "-5"])
    assert exc.value.code == 2
    assert "mpidl plan: error: argument --step-time: '-5' must be a finite number > 0" in \
        capsys.readouterr().err
