"""hpc.files.check_output: the one rule for every file a command writes."""
from __future__ import annotations

import os

import pytest

from hpc.files import OutputError, check_output


def test_a_new_file_may_be_written(tmp_path):
    assert check_output(str(tmp_path / "new.json"), force=False) == str(tmp_path / "new.json")


def test_an_existing_file_needs_force_and_the_message_names_it_and_the_flag(tmp_path):
    old = tmp_path / "precious.csv"
    old.write_text("keep me")
    with pytest.raises(OutputError, match=rf"{old} already exists; name another file, or "
                                          r"pass --force to write over it"):
        check_output(str(old), force=False)
    assert check_output(str(old), force=True) == str(old)


def test_an_empty_name_is_refused():
    with pytest.raises(OutputError, match="an empty file name"):
        check_output("", force=True)


def test_a_file_the_command_reads_is_refused_even_with_force(tmp_path):
    source = tmp_path / "checkpoint.h5"
    source.write_bytes(b"x")
    for path in (str(source), str(tmp_path / "." / "checkpoint.h5")):
        with pytest.raises(OutputError, match="which this command reads: it is never written "
                                              "over, even with --force"):
            check_output(path, force=True, reads=[str(source)])


def test_a_link_or_a_hard_link_to_a_file_read_is_the_file_read(tmp_path):
    source = tmp_path / "data.h5"
    source.write_bytes(b"x")
    os.symlink(source, tmp_path / "soft")
    os.link(source, tmp_path / "hard")
    for name in ("soft", "hard"):
        with pytest.raises(OutputError, match="which this command reads"):
            check_output(str(tmp_path / name), force=True, reads=[str(source)])


def test_any_file_in_a_directory_read_is_refused_and_one_beside_it_is_not(tmp_path):
    dataset = tmp_path / "data"
    (dataset / "train").mkdir(parents=True)
    with pytest.raises(OutputError, match=f"lies in {dataset}, which this command reads"):
        check_output(str(dataset / "train" / "new.h5"), force=True, reads=[str(dataset)])
    beside = str(tmp_path / "data-2.h5")  # a name that only starts like the directory's
    assert check_output(beside, force=False, reads=[str(dataset)]) == beside
