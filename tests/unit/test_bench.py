"""hpc.bench's pure parts: the alpha-beta fit, bus-bandwidth factors, sizes, arguments."""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpc import bench

ROOT = Path(__file__).resolve().parents[2]


def test_fit_recovers_alpha_and_beta_from_exact_times():
    sizes = bench.message_sizes(4, 64 * 1024**2)
    alpha, beta = 2e-6, 3e9
    fit = bench.fit_alpha_beta(sizes, [alpha + s / beta for s in sizes])
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.beta == pytest.approx(beta, rel=1e-9)
    assert fit.time(1024**2) == pytest.approx(alpha + 1024**2 / beta)


def test_fit_is_close_under_five_percent_multiplicative_noise():
    rng = np.random.default_rng(0)
    sizes = np.array(bench.message_sizes(4, 64 * 1024**2), dtype=float)
    times = (1.5e-6 + sizes / 8e9) * rng.uniform(0.95, 1.05, sizes.size)
    fit = bench.fit_alpha_beta(sizes, times)
    # Relative residuals: the small sizes still pin alpha down, the large ones beta.
    assert fit.alpha == pytest.approx(1.5e-6, rel=0.1)
    assert fit.beta == pytest.approx(8e9, rel=0.1)


def test_fit_holds_alpha_at_zero_rather_than_negative():
    sizes = [1e3, 1e6, 1e9]
    fit = bench.fit_alpha_beta(sizes, [s / 1e9 for s in sizes])  # pure bandwidth
    assert fit.alpha == pytest.approx(0.0, abs=1e-15)
    assert fit.beta == pytest.approx(1e9)
    # A time that shrinks with size would need alpha < 0: alpha is held at 0.
    fit = bench.fit_alpha_beta([1, 2], [1e-3, 3e-3])
    assert fit.alpha >= 0 and fit.beta > 0


def test_fit_of_constant_times_is_pure_latency():
    fit = bench.fit_alpha_beta([8, 64, 512], [5e-6, 5e-6, 5e-6])
    assert fit.alpha == pytest.approx(5e-6)
    assert fit.time(1e9) == pytest.approx(5e-6)  # beta is infinite, up to round-off


def test_fit_of_times_falling_with_size_gives_infinite_bandwidth():
    fit = bench.fit_alpha_beta([8, 64, 512], [6e-6, 5e-6, 4e-6])
    assert math.isinf(fit.beta) and fit.alpha == pytest.approx(5e-6, rel=0.1)


@pytest.mark.parametrize("sizes, times, words", [
    ([8, 8], [1e-6, 2e-6], "2 distinct sizes"),
    ([8, 16], [1e-6], "one length"),
    ([8, 16], [1e-6, 0.0], "> 0"),
])
def test_fit_rejects_what_it_cannot_fit(sizes, times, words):
    with pytest.raises(ValueError, match=words):
        bench.fit_alpha_beta(sizes, times)


@pytest.mark.parametrize("op, n, factor", [
    ("allreduce", 1, 0.0), ("allreduce", 2, 1.0), ("allreduce", 4, 1.5),
    ("allreduce", 8, 1.75), ("allgather", 2, 0.5), ("allgather", 4, 0.75),
    ("reduce_scatter", 8, 0.875), ("bcast", 1, 1.0), ("bcast", 16, 1.0),
    ("alltoall", 4, 0.75), ("sendrecv", 2, 1.0), ("sendrecv", 8, 1.0),
])
def test_bus_factor_follows_nccl_tests(op, n, factor):
    assert bench.bus_factor(op, n) == pytest.approx(factor)


def test_bus_factor_rejects_unknown_op_and_empty_group():
    with pytest.raises(ValueError, match="scan"):
        bench.bus_factor("scan", 2)
    with pytest.raises(ValueError, match="size=0"):
        bench.bus_factor("allreduce", 0)


def test_result_bandwidths_use_the_median_window():
    res = bench.Result("allreduce", 1_000_000, 250_000, "float32", "numpy", ranks=4,
                       nodes=1, iters=10, windows=[3e-3, 1e-3, 2e-3])
    assert res.seconds == 2e-3
    assert res.algbw == pytest.approx(5e8)
    assert res.busbw == pytest.approx(5e8 * 1.5)
    record = res.to_json()
    assert record["time_us"] == pytest.approx(2000)
    assert (record["time_us_min"], record["time_us_max"]) == pytest.approx((1000, 3000))
    assert record["busbw_GBps"] == pytest.approx(0.75)


def test_message_sizes_are_powers_of_the_factor_up_to_the_maximum():
    assert bench.message_sizes(4, 65536) == [4**k for k in range(1, 9)]
    assert bench.message_sizes(4, 64 * 1024**2)[-1] == 64 * 1024**2
    assert bench.message_sizes(1, 100, factor=10) == [1, 10, 100]
    assert bench.message_sizes(8, 8) == [8]
    with pytest.raises(ValueError, match="max_bytes=2"):
        bench.message_sizes(4, 2)


@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("64K", 65536), ("64KiB", 65536), ("16MiB", 16 * 1024**2),
    ("1MB", 10**6), ("2g", 2 * 1024**3), ("8 B", 8),
])
def test_parse_bytes_reads_units(text, value):
    assert bench.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "1.5M", "64 furlongs", "-4"])
def test_parse_bytes_rejects_nonsense(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a byte count"):
        bench.parse_bytes(text)


def test_parse_args_defaults_sweep_allreduce_float32_4_bytes_to_64_mib():
    args = bench.parse_args([])
    assert args.op == ["allreduce"]
    assert (args.min_bytes, args.max_bytes, args.factor) == (4, 64 * 1024**2, 4)
    assert args.dtype == "float32" and args.device == "numpy" and not args.json


def test_parse_args_reads_op_lists_sizes_and_counts():
    args = bench.parse_args(["--op", "allgather, allreduce,allgather", "--min-bytes", "1K",
                             "--max-bytes", "1MiB", "--iters", "5", "--warmup", "0",
                             "--windows", "2", "--window-s", "0", "--dtype", "float64",
                             "--json"])
    assert args.op == ["allgather", "allreduce"]
    assert (args.min_bytes, args.max_bytes) == (1024, 1024**2)
    assert (args.iters, args.warmup, args.windows, args.window_s) == (5, 0, 2, 0.0)
    assert args.dtype == "float64" and args.json
    assert bench.parse_args(["--op", "all"]).op == list(bench.OPS)


@pytest.mark.parametrize("argv, words", [
    (["--op", "scan"], "scan"),
    (["--iters", "0"], "argument --iters: '0' must be an integer >= 1"),
    (["--windows", "0"], "argument --windows: '0' must be an integer >= 1"),
    (["--window-s", "nan"], "argument --window-s: 'nan' must be a finite number >= 0"),
    (["--plot", "/nonexist/x.png"], "the directory /nonexist does not exist"),
    (["--save-profile", "../x"], "profile name '../x': use a plain name"),
    (["--factor", "1"], "--factor 1 must be >= 2"),
    (["--min-bytes", "1M", "--max-bytes", "1K"], "below --min-bytes"),
    (["--window-s", "-1"], "--window-s"),
    (["--dtype", "float16"], "invalid choice"),
    (["--max-bytes", "lots"], "not a byte count"),
])
def test_parse_args_names_the_bad_value(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_an_existing_plot_or_profile_needs_force_before_the_sweep(tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.setenv("MPIDL_PROFILE_DIR", str(tmp_path))
    (tmp_path / "network").mkdir()
    (tmp_path / "network" / "mine.toml").write_text("kept")
    (tmp_path / "net.png").write_bytes(b"kept")
    for argv, path in ((["--plot", str(tmp_path / "net.png")], tmp_path / "net.png"),
                       (["--save-profile", "mine"], tmp_path / "network" / "mine.toml")):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2
        assert f"{path} already exists; name another file, or pass --force" in \
            capsys.readouterr().err
        if argv[0] == "--plot" and importlib.util.find_spec("matplotlib") is None:
            continue  # refused for the file first; with --force, for the missing extra
        assert bench.parse_args([*argv, "--force"]).force
    assert (tmp_path / "network" / "mine.toml").read_text() == "kept"


@pytest.mark.parametrize("op, nbytes, n, elements", [
    ("allreduce", 4, 8, 1), ("allreduce", 4096, 8, 1024), ("bcast", 64, 3, 16),
    ("allgather", 4096, 4, 256), ("reduce_scatter", 4096, 4, 256),
    ("allgather", 4, 8, 1),  # rounds up to one element per rank
])
def test_elements_per_rank_follow_the_nccl_tests_buffer_convention(op, nbytes, n, elements):
    assert bench._elements(op, nbytes, 4, n) == elements


def test_python_m_hpc_bench_without_a_launcher_is_one_rank():
    # A subprocess: MPI_Init in the test process would outlive the test.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-m", "hpc.bench", "--max-bytes", "256", "--iters", "3",
         "--warmup", "2", "--windows", "2", "--json", "--op", "allreduce,bcast"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    sizes = [rec["bytes"] for rec in lines if "fit" not in rec]
    assert sizes == [4, 16, 64, 256] * 2
    fits = [rec for rec in lines if "fit" in rec]
    assert [f["op"] for f in fits] == ["allreduce", "bcast"]
    assert all(rec["ranks"] == 1 for rec in lines)
