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


@pytest.mark.parametrize("name", ["run.png", "run.SVG"])
def test_out_naming_an_image_writes_one_file_of_the_three_panels(tmp_path, capsys, name):
    import matplotlib.image

    run = _run(tmp_path)
    out = tmp_path / "figures" / name
    assert main([str(run), "--out", str(out)]) == 0
    assert out.is_file(), f"{out} is not a file"
    assert capsys.readouterr().out.split() == [str(out)]
    assert not (run / "loss.png").exists()  # nothing else written
    if name.endswith(".png"):  # read back by matplotlib's own reader
        height, width = matplotlib.image.imread(out).shape[:2]
        assert width > 1000 and height > 800, (width, height)


def test_one_figure_holds_loss_accuracy_and_throughput():
    from mpidl.train.plot import _matplotlib, run_figure

    records = [{"kind": "train", "step": s, "loss": 1 / s, "accuracy": 0.5, "samples_per_s": 9.0,
                "time_compute": 0.01, "time_comm": 0.0, "time_input": 0.0} for s in (1, 2)]
    fig = run_figure(_matplotlib(), records, "run")
    titles = [ax.get_title() for ax in fig.axes]
    assert [t.split(" — ")[0] for t in titles if t] == ["loss", "accuracy", "throughput"]
    assert fig.axes[-1].get_ylabel() == "time per step (ms)"


def test_out_naming_an_existing_directory_with_an_image_suffix_writes_into_it(tmp_path):
    run = _run(tmp_path)
    (tmp_path / "old.png").mkdir()  # a directory is a directory, whatever its name
    assert main([str(run), "--out", str(tmp_path / "old.png")]) == 0
    assert (tmp_path / "old.png" / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_the_image_suffixes_named_without_matplotlib_are_those_it_writes():
    from matplotlib.backend_bases import FigureCanvasBase

    from mpidl.train.plot import IMAGE_SUFFIXES

    assert IMAGE_SUFFIXES <= set(FigureCanvasBase.get_supported_filetypes())
    assert {"png", "svg", "pdf"} <= IMAGE_SUFFIXES
