"""``mpidl plot``: PNGs from a run's metrics (skipped without matplotlib)."""
from __future__ import annotations

import pytest

from mpidl.train.metrics import MetricsWriter
from mpidl.train.plot import main

pytestmark = pytest.mark.extra("matplotlib")
pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path):
    run = tmp_path / "run"
    with MetricsWriter(run / "metrics.jsonl") as writer:
        for step in range(1, 21):
            writer.write(kind="train", step=step, epoch=step // 11, loss=1.0 / step,
                         accuracy=0.5 + step / 50, lr=1e-3, samples_per_s=1000.0 + step,
                         time_step=0.03, time_compute=0.02, time_comm=0.006, time_input=0.004)
        writer.write(kind="train", step=20, epoch=1, loss=0.04, accuracy=0.9)   # resumed twice
        for epoch, step in ((0, 10), (1, 20)):
            writer.write(kind="eval", step=step, epoch=epoch, test_loss=0.3, test_accuracy=0.9)
    return run


def test_plot_writes_three_pngs_into_the_run_directory(tmp_path, capsys):
    run = _run(tmp_path)
    assert main([str(run)]) == 0
    for name in ("loss.png", "accuracy.png", "throughput.png"):
        assert (run / name).read_bytes()[:8] == PNG_MAGIC
    assert "loss.png" in capsys.readouterr().out


def test_plot_to_another_directory(tmp_path):
    run = _run(tmp_path)
    assert main([str(run), "--out", str(tmp_path / "figs")]) == 0
    assert (tmp_path / "figs" / "throughput.png").exists()


def test_missing_metrics_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2  # bad input: docs/exit-status.md
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_plot_writes_over_its_own_plots_only_with_force(tmp_path, capsys):
    run = _run(tmp_path)
    (run / "loss.png").write_bytes(b"mine")
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'loss.png'} already exists; name another file, or pass --force" in err
    assert (run / "loss.png").read_bytes() == b"mine" and not (run / "accuracy.png").exists()
    assert main([str(run), "--force"]) == 0
    assert (run / "loss.png").read_bytes()[:8] == PNG_MAGIC
