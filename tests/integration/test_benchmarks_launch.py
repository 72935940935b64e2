"""The data-parallel benchmarks still run, on real ranks, and report what they claim to.

Tiny windows: these check the scripts (their cases, records and launches), never a time.
``dp_train.py`` needs PyTorch and is not run here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mpidl.testing.launch import launch_env, mpiexec

pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("flags", [[], ["--hot"], ["--then-read"]])
def test_gradsync_measures_every_case_on_two_ranks(flags):
    # The script launches mpiexec itself, as a user runs it.
    result = subprocess.run(
        [sys.executable, os.path.join(BENCH, "gradsync.py"), "--models", "transformer",
         "--bucket-mb", "1,4", "--rounds", "1", "--windows", "2", "--window-s", "0.01",
         "--warmup-s", "0.01", *flags],
        capture_output=True, text=True, timeout=200, cwd=ROOT, env=launch_env(ENV))
    assert result.returncode == 0, result.stdout + result.stderr
    records = _records(result.stdout)
    cases = {r["case"] for r in records}
    assert cases == {"raw", "per_param", "bucketed 1", "bucketed 4", "bucketed-allreduce 1",
                     "bucketed-allreduce 4", "bucketed-nb 1", "bucketed-nb 4"}, cases
    for r in records:
        assert (r["model"], r["world"], r["params"]) == ("transformer", 2, 28)
        assert r["gradients"] == ("hot" if "--hot" in flags else "fresh")
        assert r["then_read"] == ("--then-read" in flags)
        assert 0 < r["ms"]["min"] <= r["ms"]["median"] <= r["ms"]["max"]
        assert r["ms"]["n"] == 2
    assert "| transformer | 5.7 | 28 | bucketed 4 |" in result.stdout


@pytest.mark.parametrize("n,model", [(1, "mlp"), (2, "mlp"), (2, "bow")])
def test_dp_phases_times_each_variant(n, model):
    variants = "dataparallel,allreduce,ring,zero1,window-zero1"
    result = mpiexec(n, [sys.executable, os.path.join(BENCH, "dp_phases.py"), "--steps", "3",
                         "--warmup", "1", "--model", model, "--variants", variants],
                     timeout=200, env=ENV, cwd=ROOT)
    assert result.returncode == 0, result.output
    records = _records(result.stdout)
    expected = ["dataparallel", "allreduce"] + (
        ["ring", "zero1", "window-zero1"] if model == "mlp" else [])
    assert [r["variant"] for r in records] == expected
    for r in records:
        assert (r["ranks"], r["model"]) == (n, model)
        assert r["ms"]["step"] >= r["ms"]["compute"] > 0
        assert all(r["ms"][k] >= 0 for k in ("skew", "sync", "sparse", "opt"))


@pytest.mark.extra("torch")
def test_conv_gemms_times_the_three_gemms_and_both_layers():
    pytest.importorskip("torch")
    result = subprocess.run([sys.executable, os.path.join(BENCH, "conv_gemms.py"), "--rounds",
                             "1", "--reps", "1"], capture_output=True, text=True, timeout=200,
                            cwd=ROOT, env=launch_env(ENV))
    assert result.returncode == 0, result.stdout + result.stderr
    (record,) = _records(result.stdout)
    ms = record["ms"]
    assert set(ms) == {"forward W @ cols", "forward (cols^T @ W^T)^T",
                       "weight gradient gy @ cols^T", "weight gradient (cols @ gy^T)^T",
                       "input gradient W^T @ gy", "input gradient (gy^T @ W)^T",
                       "mpidl layer", "PyTorch layer"}, ms
    assert all(v > 0 for v in ms.values()), ms
    floor = sum(min(v for k, v in ms.items() if k.startswith(kind))
                for kind in ("forward", "weight gradient", "input gradient"))
    assert record["gemm_floor_ms"] == pytest.approx(floor)
    assert "GEMM floor / PyTorch's whole layer" in result.stdout


_WINDOW_ZERO1 = """
import sys, numpy
import mpidl.comm
from mpidl.comm.shared import NodeSharedArrays
from dp_phases import window_zero1_step
comm = mpidl.comm.world()
sizes = [1001, 70000]  # a share smaller than the scratch, and one of several pieces
grads = NodeSharedArrays(comm, [numpy.arange(n, dtype=numpy.float32) * (comm.rank + 1)
                                for n in sizes])
params = NodeSharedArrays(comm, [numpy.ones(n, numpy.float32) for n in sizes])
window_zero1_step(grads, params, numpy.empty(4096, numpy.float32), lr=0.5)
total = comm.size * (comm.size + 1) // 2  # the ranks' gradients, summed
ok = all(numpy.allclose(copy, 1 - 0.5 * total * numpy.arange(n))
         for n, copies in zip(sizes, params.copies) for copy in copies)
grads.free(); params.free()
print("verdict", comm.rank, ok)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_window_zero1_leaves_every_copy_of_the_parameters_updated_by_the_summed_gradient(n):
    result = mpiexec(n, [sys.executable, "-c", _WINDOW_ZERO1], timeout=120, cwd=ROOT,
                     env={"PYTHONPATH": os.pathsep.join([BENCH, ENV["PYTHONPATH"]])})
    assert result.returncode == 0, result.output
    verdicts = sorted(line for line in result.stdout.splitlines() if line.startswith("verdict"))
    assert verdicts == [f"verdict {r} True" for r in range(n)], result.output
