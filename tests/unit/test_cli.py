"""The mpidl command's dispatch and the size-1 communicator."""
from __future__ import annotations

import subprocess
import sys

import numpy

from mpidl.cli import COMMANDS, main
from mpidl.comm import SingleCommunicator, split_counts


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_command_is_an_error_naming_it(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_python_dash_m_mpidl_runs_a_script(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('hello', sys.argv[1:])\n")
    out = subprocess.run([sys.executable, "-m", "mpidl", "run", str(script), "x"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "hello ['x']\n"


def test_split_counts_gives_the_first_ranks_one_more():
    assert split_counts(10, 3) == [4, 3, 3]
    assert split_counts(2, 3) == [1, 1, 0]
    assert sum(split_counts(12345, 7)) == 12345


def test_single_communicator_rejects_peers_other_than_itself():
    import pytest

    c = SingleCommunicator()
    with pytest.raises(ValueError, match="dest=1 is not a rank"):
        c.sendrecv(numpy.zeros(2), dest=1, source=0)
