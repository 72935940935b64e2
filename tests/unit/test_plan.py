"""The planner's arithmetic, the cost model and the profiles (no MPI, no measurement)."""
from __future__ import annotations

import math

import pytest

from hpc import bench, costmodel
from hpc.costmodel import Link, NetworkProfile
from mpidl import plan
from mpidl.plan_step import StepCosts


def _net(alpha=10e-6, bandwidth=1e9, name="test"):
    return NetworkProfile(name, "a test", {"default": Link(alpha, bandwidth)})


def test_a_link_recovered_from_a_fit_predicts_the_fitted_times_at_that_rank_count():
    for op in costmodel.COLLECTIVES:
        for ranks in (2, 3, 8):
            link = costmodel.link_from_fit(op, alpha=12e-6, beta=3e9, ranks=ranks)
            for n in (1e3, 1e6, 1e9):
                assert link.time(op, n, ranks) == pytest.approx(12e-6 + n / 3e9)


def test_ring_allreduce_cost_is_the_textbook_formula():
    link = Link(alpha=1e-6, bandwidth=25e9)
    # 1 GB over 16 ranks at 25 GB/s: 2 * 15/16 / 25 s = 75 ms, plus 30 alpha.
    assert link.time("allreduce", 1e9, 16) == pytest.approx(0.075 + 30e-6)
    assert link.time("allreduce", 1e9, 1) == 0.0
    assert link.time("bcast", 8e6, 5) == pytest.approx(3 * 1e-6 + 8e6 / 25e9)


def test_a_fit_on_one_rank_cannot_make_a_network_profile():
    with pytest.raises(costmodel.ProfileError, match="measure at 2 ranks"):
        costmodel.link_from_fit("allreduce", 1e-6, 1e9, ranks=1)


def test_the_planner_matches_a_hand_worked_example():
    # 1M parameters (4 MB of float32 gradient, one 4 MiB bucket), global batch 64,
    # 50,000 samples x 3 epochs = ceil(150000 / 64) = 2344 steps; compute 1 ms/sample.
    work = plan.Workload(samples=50000, epochs=3, global_batch=64, params=1_000_000,
                         grad_bytes=4_000_000, bucket_bytes=4 * 2**20)
    rows = plan.predict(work, lambda b: 1e-3 * b, [1, 2, 8], _net(), _net(name="node"),
                        ranks_per_node=1, setup_hours=40.0,
                        costs=StepCosts(overlap_share=1.0))  # all of backward hides it
    one, two, eight = rows
    assert work.steps == 2344
    assert one.step_s == pytest.approx(0.064) and one.comm_s == 0.0
    # 2 ranks on 2 nodes: allreduce = 2 * 10 us + 2 * (1/2) * 4e6 B / 1e9 B/s = 4.02 ms,
    # hidden behind backward (2/3 of 32 ms of compute): the step is the compute.
    assert two.comm_s == pytest.approx(0.00402)
    assert two.exposed_comm_s == 0.0 and two.step_s == pytest.approx(0.032)
    assert two.speedup == pytest.approx(2.0) and two.efficiency == pytest.approx(1.0)
    # 8 ranks: batch 8, compute 8 ms; allreduce = 14 * 10 us + 2 * 7/8 * 4 ms = 7.14 ms;
    # exposed 7.14 - 2/3 * 8 = 1.8067 ms; step 9.8067 ms; speedup 64 / 9.8067 = 6.526.
    assert eight.comm_s == pytest.approx(0.00714)
    assert eight.exposed_comm_s == pytest.approx(0.00714 - 0.008 * 2 / 3)
    assert eight.speedup == pytest.approx(0.064 / (0.008 + 0.00714 - 0.008 * 2 / 3))
    # 2344 steps x 64 ms = 150.016 s = 0.041671 h at 1 rank; 2 ranks save half of it:
    # 40 h of setup take 40 / 0.0208356 = 1920 trainings to pay off.
    assert one.train_hours == pytest.approx(2344 * 0.064 / 3600)
    assert two.saving_hours == pytest.approx(2344 * 0.032 / 3600)
    assert two.trainings_to_break_even == pytest.approx(40 / (2344 * 0.032 / 3600))
    assert one.memory_bytes == 1_000_000 * 4 * 4  # params, grads, two AdamW moments
    # The verdict takes the fastest: 8 ranks train in 2344 x 9.8067 ms = 22.99 s = 0.006385 h,
    # saving 0.041671 - 0.006385 = 0.035286 h a training: 40 / 0.035286 = 1133.6 trainings.
    line = plan.verdict(rows, setup_hours=40.0, queue_hours=0.0)
    assert line == ("8 ranks: 6.5x faster, 23 s instead of 3 min; with 40 h of setup it pays "
                    "off after 1134 trainings: not worth it for one training")


def test_within_one_node_the_node_link_counts_and_overlap_is_off():
    work = plan.Workload(samples=640, epochs=1, global_batch=64, params=250_000,
                         grad_bytes=1_000_000, bucket_bytes=4 * 2**20)
    fast = _net(alpha=1e-6, bandwidth=10e9, name="shm")
    rows = plan.predict(work, lambda b: 1e-4 * b, [2], _net(bandwidth=1e6), fast,
                        ranks_per_node=2)
    (two,) = rows
    assert two.nodes == 1
    assert two.comm_s == pytest.approx(2e-6 + 1e6 / 10e9)
    assert two.exposed_comm_s == two.comm_s  # one node: no overlap (DataParallel's default)


def test_more_ranks_than_samples_in_a_batch_is_an_error():
    work = plan.Workload(samples=100, epochs=1, global_batch=4, params=10, grad_bytes=40,
                         bucket_bytes=1024)
    with pytest.raises(ValueError, match="every rank needs a sample per step"):
        plan.predict(work, lambda b: 1.0, [8], _net(), _net())


def test_a_queue_longer_than_the_saving_is_not_worth_it():
    work = plan.Workload(samples=6400, epochs=1, global_batch=64, params=10, grad_bytes=40,
                         bucket_bytes=1024)
    rows = plan.predict(work, lambda b: 0.01 * b, [1, 4], _net(), _net(), queue_hours=5.0)
    assert "each run saves nothing: not worth it" in plan.verdict(rows, 0.0, 5.0)


def test_a_step_of_a_few_milliseconds_is_flagged_as_an_optimistic_prediction():
    work = plan.Workload(samples=6400, epochs=1, global_batch=64, params=10, grad_bytes=40,
                         bucket_bytes=1024)
    slow = plan.predict(work, lambda b: 1e-3 * b, [1, 2], _net(), _net())   # 32 ms at 2
    fast = plan.predict(work, lambda b: 2e-5 * b, [1, 2, 4], _net(), _net())  # 0.6 ms at 2
    assert plan.caveats(slow) == []
    (note,) = plan.caveats(fast)
    assert note.startswith("the step at 2, 4 ranks is under 5 ms") and "optimistic" in note


@pytest.mark.parametrize("kind", ["network", "device"])
def test_every_shipped_profile_parses_and_names_its_source(kind):
    names = costmodel.list_profiles(kind)
    assert len(names) >= 4, names
    for name in names:
        profile = (costmodel.load_network if kind == "network" else costmodel.load_device)(name)
        assert len(profile.source) > 40 and "http" not in profile.source[:0]
        if kind == "network":
            link = profile.link("allreduce")
            assert link.alpha > 0 and link.bandwidth > 0
        else:
            assert profile.flops > 0 and profile.memory_bytes > 0


def test_a_profile_without_a_source_or_with_a_bad_number_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('name = "bad"\n[default]\nalpha_us = 1\nbandwidth_GBps = 2\n')
    with pytest.raises(costmodel.ProfileError, match="names no source"):
        costmodel.load_network(str(path))
    path.write_text('source = "x"\n[default]\nalpha_us = 1\nbandwidth_GBps = -2\n')
    with pytest.raises(costmodel.ProfileError, match="bandwidth_GBps = -2 must be"):
        costmodel.load_network(str(path))
    with pytest.raises(costmodel.ProfileError, match="no network profile 'nowhere'"):
        costmodel.load_network("nowhere")


def test_a_saved_profile_is_found_by_name_and_reproduces_the_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDL_PROFILE_DIR", str(tmp_path))
    fits = {"allreduce": bench.AlphaBeta(20e-6, 2e9), "sendrecv": bench.AlphaBeta(5e-6, math.inf)}
    path = costmodel.save_network_profile("lab", fits, ranks=4, nodes=2, source="a test fit")
    assert path == tmp_path / "network" / "lab.toml"
    profile = costmodel.load_network("lab")
    assert "lab" in costmodel.list_profiles("network")
    assert profile.time("allreduce", 1e6, 4) == pytest.approx(20e-6 + 1e6 / 2e9, rel=1e-5)
    assert profile.link("sendrecv").bandwidth == pytest.approx(1e15)


def test_a_profile_saved_from_an_allreduce_alone_prices_the_other_collectives_with_it():
    profile = NetworkProfile("ar", "a test", {"allreduce": Link(5e-6, 1e9)})
    assert profile.stand_ins(["allreduce", "reduce_scatter", "allgather"]) == \
        ["reduce_scatter", "allgather"]
    assert profile.link("allgather") == profile.link("allreduce")
    assert _net().stand_ins(["allgather"]) == []  # [default] is no stand-in


def test_a_profile_without_the_allreduce_says_to_measure_every_collective():
    profile = NetworkProfile("sr", "a test", {"sendrecv": Link(5e-6, 1e9)})
    with pytest.raises(costmodel.ProfileError, match=r"no \[allgather\], \[default\], "
                       r"\[allreduce\] table.*mpidl bench --op all --save-profile sr"):
        profile.stand_ins(["allgather"])


def test_rank_counts_beyond_the_global_batch_name_the_largest_usable():
    plan.check_rank_counts([1, 2, 64], 64)
    with pytest.raises(ValueError, match="128 ranks for a global batch of 64: every rank "
                                         "needs a sample per step; use at most 64 ranks"):
        plan.check_rank_counts([1, 128], 64)


@pytest.mark.parametrize("hours, unit, per_hour", [
    ([1 / 3600, 1.3 / 3600], "s", 3600),          # a 1-second training
    ([0.5 / 60, 59 / 3600], "s", 3600),
    ([1 / 60, 0.4], "min", 60),
    ([0.9, 1.0], "h", 1),
    ([3.0, 47.0], "h", 1),
    ([20.0, 100.0], "days", 1 / 24),
])
def test_time_unit_is_chosen_from_the_longest_time(hours, unit, per_hour):
    assert plan.time_unit(max(hours)) == (unit, per_hour)


@pytest.mark.extra("matplotlib")
def test_the_plots_time_axis_takes_its_unit_from_the_times(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    # 100 steps of 10 ms (64 samples, 0.16 ms each) at 1 rank: 1 s to train
    work = plan.Workload(samples=6400, epochs=1, global_batch=64, params=10, grad_bytes=40,
                         bucket_bytes=1024)
    rows = plan.predict(work, lambda b: 0.01 * b / 64, [1, 2], _net(), _net())
    assert rows[0].train_hours == pytest.approx(1 / 3600)
    fig = plan.figure(rows, "test")
    axis = fig.axes[1]
    assert axis.get_ylabel() == "seconds to train"
    assert axis.lines[0].get_ydata()[0] == pytest.approx(1.0)
    path = plan.plot(rows, str(tmp_path / "plan.png"), "test")
    assert matplotlib.image.imread(path).shape[2] in (3, 4)  # an image, read back


@pytest.mark.parametrize("ranks,per_node,nodes", [(6, 4, 2), (5, 2, 3), (3, 2, 2), (4, 4, 1)])
def test_ranks_that_do_not_fill_the_last_node_still_count_it_and_cross_the_network(
        ranks, per_node, nodes):
    # 6 ranks at 4 a node take 2 nodes (the second half full): the gradient crosses the
    # network, not the node's shared memory; a node count rounded down prices 1 node.
    work = plan.Workload(samples=640, epochs=1, global_batch=60, params=250_000,
                         grad_bytes=1_000_000, bucket_bytes=4 * 2**20)
    network, shm = _net(alpha=10e-6, bandwidth=1e9), _net(alpha=1e-6, bandwidth=10e9, name="shm")
    (row,) = plan.predict(work, lambda b: 1e-4 * b, [ranks], network, shm,
                          ranks_per_node=per_node, costs=StepCosts(overlap_share=0.0))
    link = network if nodes > 1 else shm
    assert row.nodes == nodes
    assert row.comm_s == pytest.approx(link.time("allreduce", 1_000_000, ranks))
    assert row.step_s == pytest.approx(row.compute_s + row.comm_s)  # nothing hidden
