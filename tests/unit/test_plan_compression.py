"""The planner prices compression: PowerSGD's messages at their own sizes, its compute,
its uncompressed first steps, and whether compressing changes the verdict."""
from __future__ import annotations

import pytest

from hpc.costmodel import Link, NetworkProfile
from mpidl import plan
from mpidl.models import mlp
from mpidl.parallel import PowerSGDOptions
from mpidl.plan_step import StepCosts


def _net(alpha=10e-6, bandwidth=1e9, name="test"):
    return NetworkProfile(name, "a test", {"default": Link(alpha, bandwidth)})


def _work(model, steps_worth=2344):
    count = sum(p.data.size for p in model.parameters())
    return plan.Workload(samples=64 * steps_worth, epochs=1, global_batch=64, params=count,
                         grad_bytes=4 * count, bucket_bytes=4 * 2**20)


def test_powersgd_messages_are_the_buckets_uncompressed_tensors_and_ps_then_the_qs():
    # sizes (200, 100, 3): weights 200x100 and 100x3, biases 100 and 3 (whichever way
    # round the weights are stored, n + m is the same); one bucket
    model = mlp(sizes=(200, 100, 3), seed=0)
    work = plan.compressed_workload(_work(model), model, PowerSGDOptions(4),
                                    extra_compute_s=0.0)
    # the 200x100 matrix: 20,000 elements > 2 x 300 x 4, compressed: P and Q of 4 columns;
    # the 100x3 one: 300 < 2 x 103 x 3, uncompressed with the biases: 300 + 100 + 3
    shapes = {tuple(p.data.shape) for p in model.parameters()}
    n, m = next(s for s in shapes if 200 in s)
    assert work.messages == (4 * (403 + 4 * n), 4 * (4 * m))
    assert work.uncompressed_steps == 1000 and work.compressed_as == "powersgd:4"


def test_compression_shrinks_the_exchange_and_adds_its_compute_and_warm_up():
    model = mlp(sizes=(1000, 1000, 10), seed=0)
    base = _work(model)
    lowrank = plan.compressed_workload(base, model, PowerSGDOptions(
        1, start_powerSGD_iter=344), extra_compute_s=0.002)
    net = _net(bandwidth=1.25e8)  # 1 GbE
    plain_comm = plan.comm_seconds(base, 2, 2, net, net)
    low_comm = plan.comm_seconds(lowrank, 2, 2, net, net)
    assert low_comm == pytest.approx(sum(net.time("allreduce", b, 2)
                                         for b in lowrank.messages))
    assert low_comm < plain_comm / 50
    compute = lambda b: 1e-4 * b  # noqa: E731
    costs = StepCosts(overlap_share=0.0)
    plain_rows = plan.predict(base, compute, [1, 2], net, net, costs=costs)
    rows = plan.predict(lowrank, compute, [1, 2], net, net, costs=costs)
    assert rows[0].step_s == plain_rows[0].step_s  # one rank compresses nothing
    two, plain_two = rows[1], plain_rows[1]
    assert two.compute_s == pytest.approx(32 * 1e-4 + 0.002)
    assert two.step_s == pytest.approx(two.compute_s + low_comm)
    # 344 steps at the uncompressed step, 2000 at the compressed one
    assert two.train_hours == pytest.approx((344 * plain_two.step_s + 2000 * two.step_s)
                                            / 3600)


def test_sixteen_bits_halve_every_bucket():
    model = mlp(sizes=(1000, 1000, 10), seed=0)
    base = _work(model)
    half = plan.compressed_workload(base, model, "bfloat16")
    net = _net()
    assert half.compression and half.compressed_as == "bf16"
    assert plan.comm_seconds(half, 2, 2, net, net) < plan.comm_seconds(base, 2, 2, net, net)
    assert plan.compressed_workload(base, model, None) is base


def test_the_verdict_line_says_when_compression_makes_distributing_worth_it():
    model = mlp(sizes=(1000, 1000, 10), seed=0)
    base = _work(model)
    lowrank = plan.compressed_workload(base, model, PowerSGDOptions(1, start_powerSGD_iter=0),
                                       extra_compute_s=0.0)
    slow = _net(bandwidth=1.25e8)
    compute = lambda b: 1e-4 * b  # noqa: E731
    costs = StepCosts(overlap_share=0.0)
    plain = plan.predict(base, compute, [1, 2], slow, slow, costs=costs)
    low = plan.predict(lowrank, compute, [1, 2], slow, slow, costs=costs)
    assert not plan.worth_it(plain, 0.0, 0.0) and plan.worth_it(low, 0.0, 0.0)
    line = plan.compression_verdict(plain, low, "powersgd:1", 0.0, 0.0)
    assert line.startswith('--compression powersgd:1 turns "not worth it" into "worth it"')
    same = plan.compression_verdict(low, low, "powersgd:1", 0.0, 0.0)
    assert "does not change the verdict (worth it either way)" in same


def test_the_compression_compute_is_measured_here():
    shapes = [[(300, 200), (200,)]]
    t1 = plan.measure_powersgd(shapes, PowerSGDOptions(1))
    assert t1 > 0
