"""`mpidl bench` and `mpidl plan` as users run them, at 1 and 2 ranks: JSON, PNG, profiles,
and a batch script that `mpidl sbatch`'s conventions accept."""
from __future__ import annotations

import json
import sys

import pytest

from mpidl.testing.launch import mpiexec
from trainjob import SMALL

pytestmark = [pytest.mark.timeout(240), pytest.mark.extra("matplotlib")]

pytest.importorskip("matplotlib")


def _run(n, *args, env=None):
    result = mpiexec(n, [sys.executable, "-m", "mpidl", *args], timeout=180, env=env)
    assert result.returncode == 0, result.output
    return result


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_of_every_op_plots_and_saves_a_profile_the_planner_reads(tmp_path, cache):
    png = tmp_path / "net.png"
    env = {"MPIDL_PROFILE_DIR": str(tmp_path / "profiles")}
    result = _run(2, "bench", "--op", "all", "--max-bytes", "16384", "--iters", "3",
                  "--warmup", "2", "--windows", "2", "--plot", str(png),
                  "--save-profile", "here", env=env)
    assert "# hpc.bench alltoall: 2 ranks" in result.stdout
    assert "# hpc.bench sendrecv: 2 ranks" in result.stdout
    assert _is_png(png)
    saved = tmp_path / "profiles" / "network" / "here.toml"
    assert saved.is_file() and "measured with `mpidl bench`" in saved.read_text()
    planned = _run(1, "plan", "--ranks", "1,2", "--network", "here", "--node-network", "here",
                   "--ranks-per-node", "2", "--step-time", "0.01", *SMALL,
                   f"--data.cache-dir={cache}", env=env)
    assert "network: here between nodes, here within" in planned.stdout


@pytest.mark.parametrize("n", [1, 2])
def test_plan_writes_its_table_plot_and_batch_script(tmp_path, cache, n):
    out = tmp_path / "plan.json"
    png = tmp_path / "plan.png"
    job = tmp_path / "job.sbatch"
    result = _run(n, "plan", "--ranks", "1,2,4", "--network", "ib-hdr", "--samples", "50000",
                  "--epochs", "3", "--setup-hours", "40", "--queue-hours", "1",
                  "--json", str(out), "--plot", str(png), "--sbatch", str(job), *SMALL,
                  f"--data.cache-dir={cache}")
    assert result.stdout.count("verdict: ") == 1, result.stdout  # rank 0 alone prints
    doc = json.loads(out.read_text())
    assert [r["ranks"] for r in doc["rows"]] == [1, 2, 4]
    for row in doc["rows"]:
        assert row["step_s"] == pytest.approx(row["compute_s"] + row["exposed_comm_s"]
                                              + row["fixed_s"] + row["input_s"])
        # The compute is measured here, on a machine whose load varies: how efficient
        # the ranks come out is a timing (1.51 under load), not a property to assert.
        assert row["train_hours"] > 0 and row["efficiency"] > 0
    # Under mpiexec -n 2 the ranks probe a distributed step first (mpidl/plan_probe.py).
    assert ("probed: 30 steps at 2 ranks on 1 node(s)" in doc["fixed_from"]) == (n == 2)
    assert doc["verdict"] in result.stdout and _is_png(png)
    # the modes at 2 and 4 ranks: ZeRO 3's state is the data-parallel state over the ranks
    modes = {(m["ranks"], m["mode"]): m for m in doc["modes"]}
    assert {r for r, _ in modes} == {2, 4} and "modes: model state per rank" in result.stdout
    for r in (2, 4):
        assert modes[r, "zero3"]["state_bytes"] == pytest.approx(
            modes[r, "data"]["state_bytes"] / r)
        assert modes[r, "data"]["largest_params"] == pytest.approx(
            doc["memory_per_rank"] / 16)  # AdamW: 16 bytes per parameter
    script = job.read_text()
    assert script.startswith("#!") and "#SBATCH --nodes=" in script
    best = next(r for r in doc["rows"] if r["ranks"] == doc["best_ranks"])
    assert f"#SBATCH --nodes={best['nodes']}" in script


def test_plan_from_a_run_uses_its_measured_times(tmp_path, cache):
    from trainjob import train

    run = str(tmp_path / "run")
    assert train(2, run, cache, "--epochs=1").returncode == 0
    result = _run(1, "plan", "--from-run", run, "--ranks", "1,2", "--network", "10gbe")
    assert f"compute measured by the run {run} (2 ranks)" in result.stdout


def test_plan_names_a_missing_profile_and_a_bad_rank_list(tmp_path):
    result = mpiexec(1, [sys.executable, "-m", "mpidl", "plan", "--network", "carrier-pigeon",
                         f"--data.cache-dir={tmp_path}"], timeout=60)
    assert result.returncode == 2 and "no network profile 'carrier-pigeon'" in result.stderr
    result = mpiexec(1, [sys.executable, "-m", "mpidl", "plan", "--ranks", "0,2"], timeout=60)
    assert result.returncode == 2 and "--ranks: '0,2': rank counts >= 1" in result.stderr


def test_plan_prices_powersgd_beside_the_uncompressed_exchange(tmp_path, cache):
    out = tmp_path / "plan.json"
    result = _run(1, "plan", "--ranks", "1,2", "--network", "10gbe", "--step-time", "0.05",
                  "--compression", "powersgd:2", "--start-powersgd-iter=10",
                  "--json", str(out), *SMALL, f"--data.cache-dir={cache}")
    doc = json.loads(out.read_text())
    low = doc["compression"]
    assert low["how"] == "powersgd:2" and low["uncompressed_steps"] == 10
    assert [r["ranks"] for r in low["rows"]] == [1, 2]
    assert low["rows"][0]["step_s"] == doc["rows"][0]["step_s"]  # one rank: no exchange
    assert sum(low["messages"]) > 0 and low["extra_compute_s"] > 0
    assert "with --compression powersgd:2: " in result.stdout
    assert f"verdict with --compression powersgd:2: {low['verdict']}" in result.stdout
    assert low["change"] in result.stdout and low["change"].startswith("--compression")
