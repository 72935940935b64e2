"""What the planner prices beyond compute and a line: a measured network curve, the
overlap a run achieved, the fixed cost a probe measured, shared cores (no timing is
asserted: the probe's plumbing is checked on thread ranks, its numbers are not)."""
from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

from hpc import bench, costmodel
from hpc.costmodel import Link, NetworkProfile
from mpidl import plan, plan_command
from mpidl.plan_probe import Probe, probe_step
from mpidl.plan_step import (BACKWARD_SHARE, StepCosts, achieved_overlap_share,
                             exposed_comm, fixed_cost, shared_cores)
from mpidl.testing import run_ranks

# An allreduce measured at 2 ranks: slow at 256 KB (a rendezvous), faster at 4 MB.
CURVE = ((4.0, 200e-6), (65536.0, 2.7e-3), (262144.0, 16e-3), (4194304.0, 76e-3))


def _curved(alpha=50e-6, bandwidth=0.05e9):
    return Link(alpha, bandwidth, ((2, CURVE),))


def test_a_measured_curve_gives_its_own_times_at_its_sizes_and_rank_count():
    link = _curved()
    for n, t in CURVE:
        assert link.time("allreduce", n, 2) == pytest.approx(t)
    # Between two sizes: straight in log-log, so the geometric mean at the geometric
    # middle (128 KiB between 64 and 256 KiB).
    assert link.time("allreduce", 131072, 2) == pytest.approx(math.sqrt(2.7e-3 * 16e-3))
    # The line alone would say 4 MB takes 100 us + 84 ms; the curve says 76 ms.
    assert link.line("allreduce", 4194304, 2) == pytest.approx(100e-6 + 4194304 / 0.05e9)


def test_beyond_its_sizes_a_curve_follows_the_line_from_its_last_point():
    link = _curved()
    big = 4 * 4194304
    ratio = link.line("allreduce", big, 2) / link.line("allreduce", 4194304, 2)
    assert link.time("allreduce", big, 2) == pytest.approx(76e-3 * ratio)
    assert link.time("allreduce", 1.0, 2) == pytest.approx(
        200e-6 * link.line("allreduce", 1.0, 2) / link.line("allreduce", 4.0, 2))


def test_at_another_rank_count_the_curve_scales_by_the_lines_ratio():
    link = _curved()
    n = 262144.0
    want = 16e-3 * link.line("allreduce", n, 3) / link.line("allreduce", n, 2)
    assert link.time("allreduce", n, 3) == pytest.approx(want)
    assert link.time("allreduce", n, 1) == 0.0
    assert Link(50e-6, 0.05e9).time("allreduce", n, 3) == link.line("allreduce", n, 3)


def test_a_saved_sweep_is_loaded_back_as_its_curve_beside_those_at_other_rank_counts(
        tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDL_PROFILE_DIR", str(tmp_path))
    sizes, times = [n for n, _ in CURVE], [t for _, t in CURVE]
    fits = {"allreduce": bench.fit_alpha_beta(sizes, times)}
    costmodel.save_network_profile("shaped", fits, ranks=2, nodes=2, source="a test",
                                   curves={"allreduce": list(zip(sizes, times))})
    slower = [t * 1.6 for t in times]  # the same sizes at 3 ranks, measured later
    costmodel.save_network_profile("shaped", fits, ranks=3, nodes=3, source="a test",
                                   curves={"allreduce": list(zip(sizes, slower))})
    link = costmodel.load_network("shaped").link("allreduce")
    assert [r for r, _ in link.curves] == [2, 3]
    for (n, t), t3 in zip(CURVE, slower):
        assert link.time("allreduce", n, 2) == pytest.approx(t, rel=1e-5)
        assert link.time("allreduce", n, 3) == pytest.approx(t3, rel=1e-5)
    # 4 ranks: the 3-rank curve (the nearest), carried by the line's ratio.
    n = 262144.0
    assert link.time("allreduce", n, 4) == pytest.approx(
        16e-3 * 1.6 * link.line("allreduce", n, 4) / link.line("allreduce", n, 3), rel=1e-5)
    # Saving at 2 ranks again replaces that curve and keeps the one at 3.
    costmodel.save_network_profile("shaped", fits, ranks=2, nodes=2, source="a test",
                                   curves={"allreduce": list(zip(sizes, slower))})
    link = costmodel.load_network("shaped").link("allreduce")
    assert link.time("allreduce", 4.0, 2) == pytest.approx(200e-6 * 1.6, rel=1e-5)
    assert [r for r, _ in link.curves] == [2, 3]


@pytest.mark.parametrize("table, match", [
    ("[allreduce.measured.2]\nsizes = [4, 2]\ntime_us = [1, 2]\n", "sizes increasing"),
    ("[allreduce.measured.2]\nsizes = [4, 8]\ntime_us = [1]\n", "of one length"),
    ("[allreduce.measured.2]\nsizes = [4, 8]\n", "must be lists"),
    ("[allreduce.measured.one]\nsizes = [4, 8]\ntime_us = [1, 2]\n", "by its rank count"),
    ("[allreduce.measured.1]\nsizes = [4, 8]\ntime_us = [1, 2]\n", "by its rank count"),
])
def test_a_malformed_curve_is_refused_naming_the_file(tmp_path, table, match):
    path = tmp_path / "bad.toml"
    path.write_text(f'source = "x"\n[allreduce]\nalpha_us = 1\nbandwidth_GBps = 1\n{table}')
    with pytest.raises(costmodel.ProfileError, match=match) as e:
        costmodel.load_network(str(path))
    assert str(path) in str(e.value)


def test_overlap_hides_its_share_of_backward_and_no_more():
    # 30 ms of compute: backward 20 ms; half of it hides 10 ms of a 25 ms exchange.
    assert exposed_comm(25e-3, 30e-3, True, 0.5) == pytest.approx(15e-3)
    assert exposed_comm(25e-3, 30e-3, True, 1.0) == pytest.approx(5e-3)
    assert exposed_comm(5e-3, 30e-3, True, 1.0) == 0.0
    assert exposed_comm(25e-3, 30e-3, False, 1.0) == 25e-3


def test_the_achieved_share_is_what_the_run_did_not_wait_for_over_its_backward():
    # Priced 25 ms, waited 15 ms, compute 30 ms: 10 ms hidden of a 20 ms backward.
    assert achieved_overlap_share(25e-3, 15e-3, 30e-3) == pytest.approx(0.5)
    assert achieved_overlap_share(25e-3, 40e-3, 30e-3) == 0.0  # slower than priced
    assert achieved_overlap_share(25e-3, 0.0, 3e-3) == 1.0
    assert achieved_overlap_share(0.0, 1e-3, 30e-3) == 0.0
    # Round trip: the share achieved, priced again, gives the run's wait back.
    share = achieved_overlap_share(25e-3, 15e-3, 30e-3)
    assert exposed_comm(25e-3, 30e-3, True, share) == pytest.approx(15e-3)


def test_ranks_beyond_the_cores_share_them():
    assert shared_cores(0.1, 2, None) == 0.1
    assert shared_cores(0.1, 2, 2) == 0.1
    assert shared_cores(0.1, 3, 2) == pytest.approx(0.15)
    with pytest.raises(ValueError, match="cores=0"):
        StepCosts(cores=0)
    with pytest.raises(ValueError, match="overlap_share=1.5"):
        StepCosts(overlap_share=1.5)


def test_the_fixed_cost_is_the_probe_beyond_compute_and_exchange():
    assert fixed_cost(2.0e-3, 0.8e-3, 0.2e-3) == pytest.approx(1.0e-3)
    assert fixed_cost(0.9e-3, 0.8e-3, 0.2e-3) == 0.0


def _net(curve=False):
    link = _curved() if curve else Link(50e-6, 0.05e9)
    return NetworkProfile("test", "a test", {"allreduce": link})


def test_predict_adds_the_fixed_cost_to_distributed_rows_and_shares_cores():
    work = plan.Workload(samples=6400, epochs=1, global_batch=64, params=1000,
                         grad_bytes=4000, bucket_bytes=2**22)
    costs = StepCosts(overlap_share=0.0, fixed_s=1e-3, cores=2)
    one, two, three = plan.predict(work, lambda b: 1e-4 * b, [1, 2, 3], _net(curve=True),
                                   _net(), ranks_per_node=1, costs=costs)
    assert one.fixed_s == 0.0 and one.step_s == pytest.approx(6.4e-3)
    comm2 = _curved().time("allreduce", 4000, 2)
    assert two.comm_s == pytest.approx(comm2) and two.exposed_comm_s == pytest.approx(comm2)
    assert two.step_s == pytest.approx(3.2e-3 + comm2 + 1e-3)
    # 3 ranks on 2 cores: 22 samples' compute and the exchange take 1.5x.
    assert three.compute_s == pytest.approx(2.2e-3 * 1.5)
    assert three.comm_s == pytest.approx(1.5 * _curved().time("allreduce", 4000, 3))
    assert three.step_s == pytest.approx(3.3e-3 + three.comm_s + 1e-3)


def test_ranks_of_one_node_use_its_link_and_ranks_of_several_the_network():
    work = plan.Workload(samples=640, epochs=1, global_batch=64, params=10**6,
                         grad_bytes=4 * 10**6, bucket_bytes=2**22)
    fast = NetworkProfile("shm", "a test", {"default": Link(1e-6, 10e9)})
    rows = plan.predict(work, lambda b: 1e-3, [2, 4], _net(), fast, ranks_per_node=2)
    two, four = rows
    assert (two.nodes, four.nodes) == (1, 2)
    assert two.comm_s == pytest.approx(fast.time("allreduce", 4 * 10**6, 2))
    assert four.comm_s == pytest.approx(_net().time("allreduce", 4 * 10**6, 4))


def test_overlapped_buckets_across_nodes_are_priced_with_the_non_blocking_allreduce():
    # DataParallel overlaps across nodes by default, through MPI's Iallreduce, which
    # Open MPI runs apart from its tuned Allreduce (twice the time over TCP, measured).
    work = plan.Workload(samples=640, epochs=1, global_batch=64, params=10**6,
                         grad_bytes=4 * 10**6, bucket_bytes=2**22)
    blocking, nonblocking = Link(50e-6, 0.05e9), Link(50e-6, 0.025e9)
    net = NetworkProfile("tcp", "a test", {"allreduce": blocking, "iallreduce": nonblocking})
    shm = NetworkProfile("shm", "a test", {"allreduce": Link(1e-6, 10e9)})
    n = 4 * 10**6
    assert plan.comm_seconds(work, 4, 2, net, shm) == pytest.approx(nonblocking.time(
        "iallreduce", n, 4))
    off = dataclasses.replace(work, overlap=False)
    assert plan.comm_seconds(off, 4, 2, net, shm) == pytest.approx(blocking.time(
        "allreduce", n, 4))
    # A profile without the non-blocking curve prices it with the allreduce's.
    old = NetworkProfile("tcp", "a test", {"allreduce": blocking})
    assert plan.comm_seconds(work, 4, 2, old, shm) == pytest.approx(blocking.time(
        "allreduce", n, 4))
    # Within one node (overlap off by default) the node's link and its allreduce.
    assert plan.comm_seconds(work, 2, 1, net, shm) == pytest.approx(shm.time(
        "allreduce", n, 2))


def _args(**kw):
    base = dict(cores=None, ranks_per_node=1)
    base.update(kw)
    return argparse.Namespace(**base)


def test_step_costs_take_a_runs_achieved_overlap_and_a_probes_fixed_cost():
    work = plan.Workload(samples=640, epochs=1, global_batch=64, params=10**6,
                         grad_bytes=4 * 10**6, bucket_bytes=2**23)
    net = _net()
    priced = net.time("allreduce", 4 * 10**6, 2)  # 2 ranks on 2 nodes
    run = {"ranks": 2, "compute_s": 0.03, "comm_wait_s": priced - 0.01}
    costs = plan_command._step_costs(_args(), work, lambda b: 1e-3 * b, net, net, run, None)
    assert costs.overlap_share == pytest.approx(0.01 / (BACKWARD_SHARE * 0.03))
    assert costs.fixed_s == 0.0 and "achieved by the run at 2 ranks" in costs.overlap_from
    # A probe at 2 ranks on one node (overlap off there): 40 ms against 32 ms of
    # compute and the priced exchange.
    shm = NetworkProfile("shm", "a test", {"default": Link(1e-6, 10e9)})
    probe = Probe(ranks=2, nodes=1, per_rank_batch=32, step_s=0.040, steps=30)
    costs = plan_command._step_costs(_args(cores=4), work, lambda b: 1e-3 * b, net, shm,
                                     None, probe)
    in_node = shm.time("allreduce", 4 * 10**6, 2)
    assert costs.fixed_s == pytest.approx(0.040 - 0.032 - in_node)
    assert costs.cores == 4 and "probed: 30 steps at 2 ranks on 1 node" in costs.fixed_from


TINY = ["--data.num-train=120", "--data.num-test=20", "--data.vocab-size=200",
        "--data.seq-len=16", "--model.dim=8", "--model.hidden=8", "--global-batch=16",
        "--progress=never", "--keep-freed-memory=false"]


@pytest.mark.parametrize("size, per_node, nodes, batch", [(2, None, 1, 8), (3, 2, 2, 6)])
def test_the_probe_takes_its_steps_on_every_rank_and_agrees_on_one_result(
        tmp_path, size, per_node, nodes, batch):
    from mpidl.comm import SingleCommunicator
    from mpidl.train.config import load_config
    from mpidl.train.log import Logger
    from mpidl.train.task import prepare_data

    config = load_config(None, [*TINY, f"--data.cache-dir={tmp_path}"])
    data = prepare_data(config, SingleCommunicator(), Logger())
    results = run_ranks(size, probe_step, config, data_dir=data, steps=4,
                        ranks_per_node=per_node, timeout=60)
    assert len(set(results)) == 1  # every rank returns the same Probe
    probe = results[0]
    assert (probe.ranks, probe.nodes, probe.per_rank_batch, probe.steps) == \
        (size, nodes, batch, 4)
    assert probe.step_s > 0


def test_a_run_whose_last_node_is_not_full_spans_the_network_and_its_overlap_counts():
    # 3 ranks at 2 a node: 2 nodes, the buckets overlap backward (the default across
    # nodes) and the run's achieved share is taken, priced on the network at 3 ranks;
    # a node count rounded down would see one node, no overlap, and keep the default.
    work = plan.Workload(samples=640, epochs=1, global_batch=63, params=10**6,
                         grad_bytes=4 * 10**6, bucket_bytes=2**23)
    net, shm = _net(), NetworkProfile("shm", "a test", {"default": Link(1e-6, 10e9)})
    priced = net.time("allreduce", 4 * 10**6, 3)
    run = {"ranks": 3, "compute_s": 0.03, "comm_wait_s": priced - 0.01}
    costs = plan_command._step_costs(_args(ranks_per_node=2), work, lambda b: 1e-3 * b, net,
                                     shm, run, None)
    assert "achieved by the run at 3 ranks" in costs.overlap_from
    assert costs.overlap_share == pytest.approx(0.01 / (BACKWARD_SHARE * 0.03))
