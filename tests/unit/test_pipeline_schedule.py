"""Pipeline schedules as data: order, messages, deadlock freedom, bubble and memory."""
from __future__ import annotations

import pytest

from mpidl.parallel.pipeline_schedule import (Action, ScheduleError, check_layout, messages,
                                              peak_in_flight, schedule, simulate, validate)

LAYOUTS = [(2, 4), (2, 5), (3, 6), (4, 4), (4, 8), (4, 16)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", LAYOUTS)
def test_gpipe_and_1f1b_idle_exactly_p_minus_1_over_m_of_their_busy_time(name, p, m):
    sim = simulate(schedule(name, p, m), p)
    assert sim.bubble == pytest.approx((p - 1) / m, abs=1e-12)
    assert sim.makespan == pytest.approx(2 * (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (2, 6, 3), (4, 4, 2), (4, 8, 2), (4, 16, 4)])
def test_interleaved_idles_p_minus_1_over_v_m(p, m, v):
    sim = simulate(schedule("interleaved", p, m, v), p, v)
    assert sim.bubble == pytest.approx((p - 1) / (v * m), abs=1e-12)


def test_1f1b_warms_up_p_minus_rank_minus_1_forwards_and_holds_p_minus_rank():
    ranks = schedule("1f1b", 4, 8)
    assert ranks[0][:6] == [Action("F", 0, i) for i in range(4)] + [Action("B", 0, 0),
                                                                     Action("F", 0, 4)]
    assert ranks[3][:2] == [Action("F", 3, 0), Action("B", 3, 0)]
    assert [peak_in_flight(a) for a in ranks] == [4, 3, 2, 1]
    assert [peak_in_flight(a) for a in schedule("gpipe", 4, 8)] == [8] * 4


def test_interleaved_rank_0_holds_2_p_minus_1_plus_v_minus_1_p_plus_1_chunk_microbatches():
    p, m, v = 4, 8, 2
    ranks = schedule("interleaved", p, m, v)
    assert [peak_in_flight(a) for a in ranks] == [2 * (p - r - 1) + (v - 1) * p + 1
                                                  for r in range(p)]
    # Megatron's order: chunk 0 for microbatches 0..p-1, then chunk 1 for them.
    assert ranks[0][:8] == [Action("F", 0, i) for i in range(4)] + \
        [Action("F", 4, i) for i in range(4)]


def test_the_messages_follow_from_the_part_and_the_direction():
    assert messages(Action("F", 0, 3), 4) == (None, messages(Action("F", 1, 3), 4)[0])
    got, sent = messages(Action("B", 2, 1), 4)
    assert (got.kind, got.part, sent.kind, sent.part) == ("gradient", 2, "gradient", 1)
    assert messages(Action("B", 3, 0), 4)[0] is None  # the last part holds the loss


def test_blocking_sends_deadlock_1f1b_and_the_engines_posted_sends_do_not():
    ranks = schedule("1f1b", 2, 4)
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits to send .*activation.*"
                       "rank 1 waits to send .*gradient"):
        simulate(ranks, 2, blocking_sends=True)
    simulate(ranks, 2)  # the engine's order: sends posted, receives wait
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(schedule("interleaved", 4, 8, 2), 4, 2, blocking_sends=True)


def test_a_schedule_out_of_order_or_with_an_action_missing_is_refused():
    ranks = schedule("1f1b", 2, 4)
    swapped = [ranks[0], [ranks[1][1], ranks[1][0]] + ranks[1][2:]]
    with pytest.raises(ScheduleError, match=r"rank 1 runs B\(1, 0\) before its forward"):
        validate(swapped, 2, 4)
    with pytest.raises(ScheduleError, match="runs 7 actions, not 8"):
        validate([ranks[0], ranks[1][:-1]], 2, 4)
    reordered = [ranks[0], [ranks[1][2], ranks[1][3], ranks[1][0], ranks[1][1]] + ranks[1][4:]]
    with pytest.raises(ScheduleError, match="order 0..m-1"):
        validate(reordered, 2, 4)
    # Rank 0 waits for microbatch 0's gradient before it sends microbatch 1's
    # activation; rank 1 wants that activation before it sends the gradient: a cycle.
    cycle = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
             [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)]]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits to recv .*gradient.*"
                       r"rank 1 waits to recv .*activation', part=1, microbatch=1"):
        validate(cycle, 2, 2)


@pytest.mark.parametrize("args,match", [
    (("1f1b", 4, 3), "3 microbatches for 4 stages; use at least 4"),
    (("interleaved", 4, 6, 2), "not a multiple of the 4 stages.*use 4 or 8"),
    (("gpipe", 2, 4, 2), "one chunk per rank"),
    (("zb", 2, 4), "use one of gpipe, 1f1b, interleaved"),
    (("1f1b", 0, 4), "stages=0 must be a positive int")])
def test_an_impossible_layout_says_what_works(args, match):
    with pytest.raises(ValueError, match=match):
        check_layout(*args)


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1),
                                        ("interleaved", 2, 6, 3), ("interleaved", 4, 8, 2)])
def test_each_rank_receives_from_a_peer_in_the_order_the_peer_sends(name, p, m, v):
    # So even one tag for every message would match: the engine's tags (by part and
    # direction) are a second guard, not what keeps messages apart.
    sent, received = {}, {}
    for r, acts in enumerate(schedule(name, p, m, v)):
        for a in acts:
            got, out = messages(a, p * v)
            if out is not None:
                sent.setdefault((r, out.part % p), []).append(out)
            if got is not None:
                peer = (got.part - 1 if got.kind == "activation" else got.part + 1) % p
                received.setdefault((peer, r), []).append(got)
    assert sent == received
