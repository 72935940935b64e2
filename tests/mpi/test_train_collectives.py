"""The collective parts of the training pieces, at any size: preemption agreement and
the gathered timeline. Each test ends in a collective verdict."""
from __future__ import annotations

import json
import os
import signal

import pytest

from mpidl.testing import assert_all_ranks
from mpidl.train.signals import PreemptionFlag
from mpidl.train.timeline import Timeline

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def test_one_signalled_rank_stops_every_rank_at_the_same_step(comm):
    stopped_at = None
    with PreemptionFlag() as flag:
        for step in range(5):
            if step == 2 and comm.rank == comm.size - 1:
                os.kill(os.getpid(), signal.SIGUSR1)      # only the last rank is signalled
            if flag.agree(comm):
                stopped_at = step
                break
    assert_all_ranks(comm, stopped_at == 2, f"stopped at step {stopped_at}, expected 2")


def test_timeline_is_gathered_to_rank_zero_as_one_trace(comm, tmp_path_factory):
    # Every rank gets its own tmp dir; rank 0's is where the file must appear.
    path = os.path.join(tmp_path_factory.mktemp(f"rank{comm.rank}"), "trace.json")
    timeline = Timeline(rank=comm.rank)
    comm.barrier()
    timeline.reset_origin()
    for step in range(comm.rank + 1):                     # rank r records r + 1 steps
        with timeline.span(f"step {step}", "compute"):
            pass
    written = timeline.write(path, gather=comm.allgather_obj)
    ok, message = True, ""
    if comm.rank == 0:
        doc = json.load(open(path))
        counts = {}
        for e in doc["traceEvents"]:
            if e["ph"] == "X":
                counts[e["pid"]] = counts.get(e["pid"], 0) + 1
        ok = written == path and counts == {r: r + 1 for r in range(comm.size)}
        message = f"events per rank {counts}"
    else:
        ok, message = written is None and not os.path.exists(path), "a non-root rank wrote"
    assert_all_ranks(comm, ok, message)
