"""The collective ledger (numbers, call sites, waits) and the watchdog's parts that need no MPI."""
from __future__ import annotations

import pytest

from mpidl.comm import ledger as L
from mpidl.comm import watchdog as W


def test_the_ledger_numbers_calls_and_names_the_callers_line():
    book = L.Ledger("test", (0,))
    first = book.begin("allreduce_")
    second = book.begin("barrier")
    assert (first.seq, second.seq) == (1, 2)
    assert first.site.startswith("test_ledger_watchdog.py:") and first.site.endswith(
        "in test_the_ledger_numbers_calls_and_names_the_callers_line")


def test_a_wait_is_in_flight_inside_its_block_only_and_then_recent():
    book = L.Ledger("test", (0, 1))
    entry = book.begin("bcast_")
    with book.waiting(entry):
        assert book.inflight is entry and entry.start > 0 and entry.end == 0
        inner = book.begin("allgather_obj")
        with book.waiting(inner):
            assert book.inflight is inner
        assert book.inflight is entry  # nested collectives restore the outer one
    assert book.inflight is None and list(book.recent) == [inner, entry]
    snap = book.snapshot()
    assert snap["key"] == "test" and snap["world_ranks"] == [0, 1] and snap["seq"] == 2


def test_patience_marks_only_the_calls_begun_inside_it():
    book = L.Ledger("test", (0,))
    with L.patience("rank 0 writes a checkpoint"):
        patient = book.begin("allgather_obj")
    plain = book.begin("allgather_obj")
    assert patient.patient == "rank 0 writes a checkpoint" and plain.patient == ""


@pytest.mark.parametrize("raw,seconds", [(None, None), ("", None), ("30", 30.0),
                                         ("2.5", 2.5), ("0", 0.0), ("off", 0.0)])
def test_mpidl_timeout_is_read_as_seconds(raw, seconds):
    env = {} if raw is None else {"MPIDL_TIMEOUT": raw}
    assert W.timeout_from_env(env) == seconds


@pytest.mark.parametrize("raw", ["soon", "-1", "inf", "nan"])
def test_a_bad_mpidl_timeout_names_the_variable_and_the_fix(raw):
    with pytest.raises(ValueError, match="MPIDL_TIMEOUT=.* is not a number of seconds >= 0"):
        W.timeout_from_env({"MPIDL_TIMEOUT": raw})


def _state(rank, inflight=None, recent=(), exiting=None, world_ranks=(0, 1, 2)):
    return {"rank": rank, "now": 100.0, "exiting": exiting,
            "ledgers": [{"key": "world", "world_ranks": list(world_ranks), "seq": 3,
                         "inflight": inflight, "recent": list(recent)}]}


def _entry(seq, op, site, start=90.0):
    return {"seq": seq, "op": op, "site": site, "start": start, "end": 0.0, "patient": ""}


def test_the_report_names_who_never_arrived_where_they_are_and_who_did_not_answer():
    stuck = _entry(3, "allreduce_", "job.py:10 in <module>")
    states = {0: _state(0, stuck),
              1: _state(1, None, [_entry(2, "allreduce_", "job.py:9 in <module>")], exiting=3)}
    text = W.format_report("rank 0 has waited too long", states, 3, {},
                           {"key": "world", "seq": 3, "op": "allreduce_",
                            "site": "job.py:10 in <module>"})
    assert "aborting all 3 ranks" in text
    assert ("in allreduce_ #3 at job.py:10 in <module> on 'world': ranks 0; "
            "never arrived: 1, 2") in text
    assert "rank 0: in allreduce_ #3 at job.py:10 in <module> on 'world' for 10.0 s" in text
    assert ("rank 1: exiting with status 3, in no collective (last finished: allreduce_ #2 "
            "at job.py:9 in <module> on 'world')") in text
    assert "rank 2: no answer in 5 s: stopped, dead, or holding the GIL" in text


def test_the_collective_most_ranks_wait_in_is_the_one_others_never_arrived_at():
    a, b = _entry(3, "allreduce_", "x.py:1"), _entry(3, "barrier", "x.py:2")
    states = {0: _state(0, b), 1: _state(1, a), 2: _state(2, a)}
    text = W.format_report("r", states, 3, {}, {"key": "world", "seq": 3, "op": "barrier",
                                                "site": "x.py:2"})
    assert "in allreduce_ #3 at x.py:1 on 'world': ranks 1, 2; never arrived: 0" in text
