"""The tensor x pipeline x data layout formulas (mpidl.layouts) against hand-computed
values, and the planner's proposal for a GPT-3-sized model on 1,024 H100s."""
from __future__ import annotations

import math

import pytest

from hpc.costmodel import Link, load_device, load_network
from mpidl import layouts
from mpidl.layouts import GPTShape, Options

GPT3 = GPTShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, global_batch=1536)
SBH = 2048 * 12288  # s b h at b = 1


@pytest.mark.parametrize("precision, d, zero, expected", [
    ("fp32", 1, 0, 16), ("bf16", 1, 0, 18), ("fp16", 1, 0, 20),  # Megatron's table, AdamW
    ("fp32", 8, 1, 8 + 8 / 8), ("bf16", 8, 1, 6 + 12 / 8), ("fp16", 8, 1, 4 + 16 / 8),
    ("bf16", 8, 0, 18)])  # without ZeRO nothing is sharded
def test_model_state_bytes_per_parameter_follow_megatrons_table(precision, d, zero, expected):
    assert layouts.state_bytes_per_param(precision, d, zero) == expected


@pytest.mark.parametrize("recompute, precision, sp, expected", [
    ("none", "bf16", True, SBH * (34 + 5 * 96 * 2048 / 12288) / 8),   # 358,612,992
    ("selective", "bf16", True, 34 * SBH / 8),                        # the s^2 term gone
    ("full", "bf16", True, 2 * SBH / 8),                              # the layer input
    ("none", "bf16", False, SBH * (10 + 24 / 8 + 5 * 96 * 2048 / (12288 * 8))),
    ("none", "fp32", True, 2 * SBH * 114 / 8)])                       # 4-byte activations
def test_activation_bytes_per_layer_are_korthikantis(recompute, precision, sp, expected):
    got = layouts.activation_bytes_per_layer(GPT3, 1, 8, recompute, precision, sp)
    assert got == pytest.approx(expected, rel=1e-12)
    assert layouts.activation_bytes_per_layer(GPT3, 1, 8, "none", "bf16") == 358_612_992


def test_the_first_stage_holds_p_microbatches_and_interleaving_a_fraction_more():
    assert layouts.microbatches_in_flight("1f1b", 8, 96) == 8
    assert layouts.microbatches_in_flight("1f1b", 8, 5) == 5  # fewer than stages
    assert layouts.microbatches_in_flight("gpipe", 8, 96) == 96
    assert layouts.microbatches_in_flight("interleaved", 8, 96, 2) == 8 * (1 + 7 / 16)
    assert layouts.microbatches_in_flight("1f1b", 1, 96) == 1  # accumulation: one at a time


def test_the_bubble_is_p_minus_1_over_m_and_interleaving_divides_it_by_v():
    assert layouts.bubble_fraction("1f1b", 8, 96) == 7 / 96
    assert layouts.bubble_fraction("gpipe", 8, 96) == 7 / 96
    assert layouts.bubble_fraction("interleaved", 8, 96, 4) == 7 / 384
    assert layouts.bubble_fraction("1f1b", 1, 96) == 0


def test_flops_match_narayanans_formula_and_the_model_flops_of_mfu():
    b, s, l, h, v = 1536, 2048, 96, 12288, 51200
    full = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))  # [P3], with recompute
    model = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert GPT3.hardware_flops("full") == pytest.approx(full, rel=1e-12)
    assert GPT3.model_flops() == pytest.approx(model, rel=1e-12)
    assert GPT3.hardware_flops("selective") == pytest.approx(model + b * s * l * 4 * s * h)
    assert GPT3.params() == pytest.approx(175e9, rel=0.01)  # 174.6 B


def _price(t, p, d, opts, link=Link(2e-6, 100e9)):
    return layouts.price(GPT3, opts, t, p, d, rate=500e12, peak=1000e12, memory=80e9,
                         ranks_per_node=8, node_time=link.time, network_time=link.time)


def test_point_to_point_bytes_are_2vm_messages_of_bsh_over_t():
    opts = Options(precision="bf16", schedule="interleaved", virtual=2)
    cost = _price(8, 8, 16, opts)
    assert cost.microbatches == 96
    assert cost.p2p_bytes == 2 * 2 * 96 * 6 * 2**20  # 6 MiB a message with t = 8 and SP
    assert _price(8, 1, 128, Options(precision="bf16")).p2p_bytes == 0  # no pipeline


def test_each_stage_reduces_its_own_parameters_and_the_tied_table_crosses_stages():
    link = Link(2e-6, 100e9)
    cost = _price(8, 8, 16, Options(precision="bf16"), link)
    blocks = 12 * GPT3.layer_params() / 8
    stage = blocks + 51200 * 12288 / 8 + 2048 * 12288  # the first stage: the embeddings
    assert cost.dp_s == pytest.approx(link.time("allreduce", stage * 4, 16))  # fp32 grads
    assert cost.tied_s == pytest.approx(link.time("allreduce", 51200 * 12288 / 8 * 4, 2))
    assert cost.state_bytes == pytest.approx(stage * 18)  # bf16, no ZeRO


def test_memory_per_rank_is_the_heaviest_stage_with_its_microbatches_in_flight():
    opts = Options(precision="bf16", recompute="selective")
    cost = _price(8, 8, 16, opts)
    per_layer = layouts.activation_bytes_per_layer(GPT3, 1, 8, "selective", "bf16")
    assert cost.activation_bytes == pytest.approx(12 * per_layer * 8)  # 12 layers x p
    gpipe = _price(8, 8, 16, Options(precision="bf16", recompute="selective",
                                     schedule="gpipe"))
    assert gpipe.activation_bytes > 10 * cost.activation_bytes  # all 96 microbatches
    assert cost.memory_bytes == cost.state_bytes + cost.activation_bytes


@pytest.mark.parametrize("t, p, d, opts, words", [
    (16, 1, 64, Options(), None),
    (5, 1, 1, Options(), "does not divide the 96 heads"),
    (8, 128, 1, Options(), "128 stages for 96 layers"),
    (8, 64, 128, Options(), "12 microbatches for 64 stages"),
    (8, 1, 7, Options(), "not 7 data ranks"),
    (8, 16, 8, Options(schedule="interleaved", virtual=4), "do not split into 16 stages x 4")])
def test_impossible_layouts_say_why(t, p, d, opts, words):
    problem = layouts.layout_problem(GPT3, opts, t, p, d)
    assert problem is None if words is None else words in problem


def test_the_proposal_for_gpt3_on_1024_h100s_fits_and_is_a_valid_layout():
    device = load_device("h100")
    opts = Options(precision="bf16", recompute="selective", zero=1)
    rows = layouts.search(GPT3, opts, 1024, 8, rate=device.extra["bf16_tflops"] * 1e12,
                          peak=device.extra["bf16_peak_tflops"] * 1e12,
                          memory=device.memory_bytes,
                          node_time=load_network("nvlink").time,
                          network_time=load_network("ib-ndr").time)
    best = rows[0]
    assert best.fits and best.memory_bytes <= 80e9
    assert best.tensor * best.pipeline * best.data == 1024 and best.tensor <= 8
    assert layouts.layout_problem(GPT3, opts, best.tensor, best.pipeline, best.data) is None
    assert best.pipeline > 1  # 175 B does not train on tensor and data parallelism alone
    assert 0.2 < best.mfu < 0.6 and math.isfinite(best.step_s)
    assert all(r.step_s >= best.step_s for r in rows if r.fits)
    # without recomputation or ZeRO some layouts no longer fit: the planner says which
    none = layouts.search(GPT3, Options(precision="bf16"), 1024, 8, rate=1e15, peak=1e15,
                          memory=80e9, node_time=Link(5e-6, 230e9).time,
                          network_time=Link(1.5e-6, 45e9).time)
    assert any(not r.fits for r in none)


NODE, NETWORK = 1.0, 1000.0  # seconds a collective takes on each link: which one priced it


def _links_priced(t, p, d, ranks_per_node):
    """Which link (NODE or NETWORK) priced the tensor, data and pipeline exchanges of
    ``t x p x d`` with ``ranks_per_node`` (None where the layout has no such exchange)."""
    cost = layouts.price(GPT3, Options(), t, p, d, rate=500e12, peak=None, memory=0,
                         ranks_per_node=ranks_per_node, node_time=lambda *a: NODE,
                         network_time=lambda *a: NETWORK)
    m, per_stage = cost.microbatches, math.ceil(GPT3.layers / p)
    tensor = cost.tensor_comm_s / ((m + p - 1) * per_stage * 4) if t > 1 else None
    data = cost.dp_s if d > 1 else None
    pipeline = cost.p2p_s / (2 * m) if p > 1 else None
    return tensor, data, pipeline


@pytest.mark.parametrize("t, p, d, per_node, expected", [
    (8, 1, 1, 8, (NODE, None, None)),         # a tensor group that fills its node exactly
    (8, 2, 2, 8, (NODE, NETWORK, NETWORK)),   # data groups span 2 nodes, stages 4
    (2, 2, 2, 4, (NODE, NODE, NETWORK)),      # a stage's 4 ranks fill one node
    (3, 1, 1, 4, (NODE, None, None)),         # 3 ranks: the job fits in one node
    # Groups that do not divide the node: nodes fill in rank order, so a group straddles
    # two of them (ranks 3-5 of 6 at 4 a node) and the slowest group sets the pace.
    (3, 2, 1, 4, (NETWORK, None, NETWORK)),   # tensor groups of 3: ranks 3, 4, 5
    (1, 2, 3, 4, (None, NETWORK, NETWORK)),   # a stage's data group of 3: ranks 3, 4, 5
    (2, 1, 3, 4, (NODE, NETWORK, None)),      # 6 ranks of a data group over 2 nodes
])
def test_a_group_within_one_node_is_priced_on_the_node_link_and_one_across_nodes_on_the_network(
        t, p, d, per_node, expected):
    assert _links_priced(t, p, d, per_node) == expected


@pytest.mark.parametrize("ranks, per_node, tensors", [(6, 4, {1, 2}), (3, 4, {1, 3}),
                                                      (8, 4, {1, 2, 4}), (12, 6, {1, 2, 3, 6})])
def test_the_search_keeps_every_tensor_group_within_a_node(ranks, per_node, tensors):
    # 6 ranks at 4 a node: groups of 3 would put ranks 3-5 on two nodes; 3 ranks fit one.
    rows = layouts.search(GPT3, Options(), ranks, per_node, rate=1e15, peak=None,
                          memory=0, node_time=lambda *a: 1.0, network_time=lambda *a: 1.0)
    assert {row.tensor for row in rows} == tensors
