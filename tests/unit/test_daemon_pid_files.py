"""How the test Slurms' scripts read a daemon's pid file (tests/slurm/common.sh), in a
plain bash under ``set -euo pipefail`` as the scripts run, without a Slurm.

A daemon removes its pid file as it exits, so a script that polls the file while
stopping the daemon can find it one moment and not the next. CI once lost the virtual
cluster that way: `cluster.sh down` died on the read and left namespaces, links and a
folder behind (2026-12-02).

    PYTHONPATH=. .venv/bin/python -m pytest -p no:cacheprovider -q tests/unit/test_daemon_pid_files.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "tests" / "slurm" / "common.sh"


def _bash(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "$0"; {script}',
                           str(COMMON), *args], capture_output=True, text=True, timeout=30)


def test_a_pid_file_that_comes_and_goes_while_polled_never_ends_the_script(tmp_path):
    # What `cluster.sh down` does while a daemon stops: poll its pid file, which the
    # daemon removes as it exits. Here a writer makes and removes the file as fast as it
    # can while bash polls it 200 times; a read that fails between the two must say "not
    # alive", not end the script (with `$(<file)` it ended within the first few polls).
    pidfile = tmp_path / "munged.pid"
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                               str(tmp_path)])
    writer = subprocess.Popen([sys.executable, "-c", _FLICKER, str(pidfile), str(daemon.pid)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"   # polls start once it flickers
        proc = _bash('n=0; for _ in $(seq 200); do slurm_alive "$1" "$2" && n=$((n + 1)); '
                     'done; echo "went on, alive $n times"', str(pidfile), str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("went on"), proc.stdout
        # A missing file is no daemon either.
        pidfile_gone = tmp_path / "gone.pid"
        proc = _bash('slurm_pid "$1" "$2" || echo "not alive"; echo "went on"',
                     str(pidfile_gone), str(tmp_path))
        assert proc.stdout.split() == ["not", "alive", "went", "on"], proc.stdout + proc.stderr
    finally:
        for p in (writer, daemon):
            p.kill()
            p.wait()


# Write the pid file, remove it, again and again (until killed).
_FLICKER = """
import os, sys
path, pid = sys.argv[1], sys.argv[2] + "\\n"
print("writing", flush=True)
while True:
    with open(path, "w") as f:
        f.write(pid)
    os.unlink(path)
"""


def test_a_running_process_is_ours_only_when_its_command_line_names_our_folder(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir()
    sleeper = subprocess.Popen(["sleep", "30"])
    named = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(ours)])
    try:
        for proc, expected in ((named, str(named.pid)), (sleeper, "")):
            pidfile = tmp_path / f"{proc.pid}.pid"
            pidfile.write_text(f"{proc.pid}\n")
            out = _bash('slurm_pid "$1" "$2" || echo "not ours"', str(pidfile), str(ours))
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == (expected or "not ours")
        # A pid file holding something other than a pid.
        junk = tmp_path / "junk.pid"
        junk.write_text("slurmctld\n")
        out = _bash('slurm_alive "$1" "$2" || echo "not ours"', str(junk), str(ours))
        assert out.stdout.strip() == "not ours", out.stdout + out.stderr
    finally:
        for proc in (sleeper, named):
            proc.kill()
            proc.wait()
