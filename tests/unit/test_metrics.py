"""Metrics: the JSONL writer, the per-step time split, throughput."""
from __future__ import annotations

import json
import time

import numpy
import pytest

from mpidl.train.metrics import (
    MetricsWriter,
    StepTimer,
    StepTimes,
    Throughput,
    read_metrics,
    trim_metrics,
)
from mpidl.train.timeline import Timeline


def test_writer_appends_one_flushed_json_object_per_line(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        writer.write({"kind": "train", "step": 1}, loss=numpy.float32(0.5), accuracy=0.75)
        # flushed: readable while the writer is still open
        first = json.loads(path.read_text().splitlines()[0])
        assert first["loss"] == 0.5 and first["kind"] == "train"
        assert isinstance(first["time"], float)
        writer.write(kind="eval", step=numpy.int64(2), epoch=0, test_loss=0.3, test_accuracy=0.9,
                     hist=numpy.arange(3))
    with MetricsWriter(path) as writer:                       # a resumed run appends
        writer.write(kind="train", step=3, loss=float("nan"), time=123.0)
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["hist"] == [0, 1, 2]
    assert records[2]["loss"] is None and records[2]["time"] == 123.0   # NaN is not JSON


def test_disabled_writer_writes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path, enabled=False)
    writer.write(kind="train", step=1)
    writer.close()
    assert not path.exists()


def test_read_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    with pytest.warns(RuntimeWarning, match="metrics.jsonl:3"):
        assert read_metrics(path) == [{"step": 1}, {"step": 2}]


def test_trim_drops_records_after_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        for step in range(1, 6):
            writer.write(kind="train", step=step)
        writer.write(kind="summary")
    assert trim_metrics(path, 3) == 2
    assert [r.get("step") for r in read_metrics(path)] == [1, 2, 3, None]
    assert trim_metrics(tmp_path / "none.jsonl", 3) == 0


def test_step_times_add_up_and_waits_are_counted():
    timer = StepTimer()
    with timer.step():
        with timer.measure("input"):
            time.sleep(0.01)
        with timer.measure("comm"):
            time.sleep(0.02)
        timer.add("comm", 0.005)                 # a wait measured elsewhere
        time.sleep(0.01)
    t = timer.last
    assert t.input >= 0.01 and t.comm >= 0.025 and t.compute >= 0.0
    assert t.total == pytest.approx(t.compute + t.comm + t.input)
    assert t.as_record() == {"time_step": t.total, "time_compute": t.compute,
                             "time_comm": t.comm, "time_input": t.input}
    with timer.step():
        pass
    assert timer.steps == 2
    assert timer.mean().comm == pytest.approx(t.comm / 2)
    timer.reset()
    assert timer.mean() == StepTimes(0.0, 0.0, 0.0, 0.0)


def test_unknown_category_is_an_error():
    with pytest.raises(ValueError, match="'network'"):
        StepTimer().add("network", 1.0)


def test_step_timer_feeds_the_timeline():
    timeline = Timeline(rank=0)
    timer = StepTimer(timeline=timeline, sync=lambda: None)
    with timer.step():
        with timer.measure("input"):
            pass
        with timer.measure("comm", name="allreduce bucket 0"):
            pass
    assert [(e[0], e[1]) for e in timeline.events] == [
        ("input", "input"), ("allreduce bucket 0", "comm"), ("step 0", "compute")]


def test_throughput_is_over_a_moving_window():
    meter = Throughput(window=2)
    assert meter.rate == 0.0
    meter.update(100, 1.0)
    meter.update(100, 1.0)
    assert meter.update(300, 0.5) == pytest.approx(400 / 1.5)
    assert meter.overall == pytest.approx(500 / 2.5)
    with pytest.raises(ValueError):
        Throughput(window=0)


def test_appending_after_a_torn_last_line_starts_a_new_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "train", "st')  # killed mid-line
    w = MetricsWriter(path)
    w.write(kind="train", step=1)
    w.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 1]  # ours intact, the torn one not


def test_a_device_clock_times_steps_from_events_without_host_waits():
    # CUDA events stand-in: each event records the fake device time (ms) it is
    # reached at. A step's total is the device time between its marks (plus the input
    # wait before its first mark).
    from mpidl.backend import DeviceClock
    from mpidl.testing.fakedevice import FakeCupy

    cp = FakeCupy()
    timer = StepTimer(clock=DeviceClock(cp))
    seen = []
    for span in (40.0, 25.0, 10.0):  # ms of device work per step
        with timer.step():
            timer.add("comm", 0.004)
            cp.clock += span  # the device works through the step
        seen.append(timer.last)
    assert seen[0].total == pytest.approx(0.040, abs=2e-3)
    assert seen[0].comm == 0.004 and seen[0].compute == pytest.approx(0.036, abs=2e-3)
    assert [t.total for t in seen[1:]] == [pytest.approx(0.025, abs=2e-3),
                                           pytest.approx(0.010, abs=2e-3)]
    assert cp.host_waits() == 0  # a timed step never waited for the device
    assert timer.mean().total == pytest.approx(0.075 / 3, abs=2e-3)


def test_a_device_clock_behind_the_host_reports_a_step_late_and_waits_only_then():
    from mpidl.backend import DeviceClock
    from mpidl.testing.fakedevice import FakeCupy

    cp = FakeCupy()
    timer = StepTimer(clock=DeviceClock(cp))
    cp.hold_events = True  # the device is behind the host: marks not reached yet
    lags = []
    for _ in range(3):
        with timer.step():
            pass
        lags.append(timer.steps)
    assert lags == [0, 1, 2] and timer.last is not None  # the previous step's times
    assert cp.host_waits() == 2  # one wait per step older than the newest, none mid-step
    timer.flush()
    assert timer.steps == 3
