"""The Chrome trace: valid JSON in the Trace Event Format, one process per rank."""
from __future__ import annotations

import json
import time

from mpidl.train.timeline import Timeline, write_trace


def _x_events(doc):
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def test_trace_is_loadable_json_with_complete_events_in_microseconds(tmp_path, comm):
    timeline = Timeline(rank=comm.rank)
    timeline.reset_origin()
    with timeline.span("forward", "compute", step=0):
        time.sleep(0.002)
    start = time.perf_counter()
    timeline.add("allreduce", "comm", start, 0.0015)
    path = timeline.write(tmp_path / "trace.json", gather=comm.allgather_obj)
    if comm.rank != 0:
        assert path is None
        return
    doc = json.loads((tmp_path / "trace.json").read_text())
    assert doc["displayTimeUnit"] == "ms"
    events = _x_events(doc)
    assert [e["name"] for e in events if e["pid"] == 0] == ["forward", "allreduce"]
    forward, allreduce = events[0], events[1]
    assert forward["dur"] >= 2000                      # microseconds
    assert allreduce["dur"] == 1500.0 and allreduce["ts"] >= forward["ts"]
    assert forward["args"] == {"step": 0}
    for e in events:
        assert set(e) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid"}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["name"] == "thread_name"}
    assert names[(0, forward["tid"])] == "compute" and names[(0, allreduce["tid"])] == "comm"
    processes = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
                 if e["name"] == "process_name"}
    assert processes == {r: f"rank {r}" for r in range(comm.size)}


def test_several_ranks_become_several_processes(tmp_path):
    traces = []
    for rank in range(3):
        timeline = Timeline(rank=rank)
        timeline.add("step 0", "compute", timeline.origin, 0.01)
        timeline.add("batch", "input", timeline.origin, 0.001)
        traces.append(timeline.local_trace())
    doc = json.loads(open(write_trace(tmp_path / "t" / "trace.json", traces)).read())
    events = _x_events(doc)
    assert sorted({e["pid"] for e in events}) == [0, 1, 2]
    assert all(e["tid"] == 0 for e in events if e["cat"] == "compute")
    assert len({e["tid"] for e in events}) == 2


def test_disabled_timeline_records_and_writes_nothing(tmp_path):
    timeline = Timeline(rank=0, enabled=False)
    with timeline.span("x"):
        pass
    timeline.add("y", "comm", 0.0, 1.0)
    assert timeline.events == []
    assert timeline.write(tmp_path / "trace.json") is None
    assert not (tmp_path / "trace.json").exists()


def test_events_beyond_the_limit_are_counted_and_reported(tmp_path):
    timeline = Timeline(rank=0, max_events=2)
    for i in range(5):
        timeline.add(f"e{i}", "compute", timeline.origin + i, 0.5)
    assert len(timeline.events) == 2 and timeline.dropped == 3
    doc = json.loads(open(timeline.write(tmp_path / "trace.json")).read())
    assert any("3 events not recorded" in e["name"] for e in doc["traceEvents"])
