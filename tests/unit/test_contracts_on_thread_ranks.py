"""The multi-rank contracts of tests/mpi, run again on 2 and 3 ranks as threads.

tests/mpi runs on real MPI ranks, at whatever size the launch gives (CI: 1, 2 and 3).
The cases below are the ones a mutation run found only multi-rank runs catch (issue
#31); here the same test bodies run on :func:`mpidl.testing.run_ranks` ranks, so the
single-process tier catches those mistakes too, in milliseconds, and a rank that
diverges from the others' collectives fails loudly (the thread communicator compares
every call). Each body takes ``comm`` and its parameters, as under pytest-mpi.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from mpidl.testing import run_ranks

MPI_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi")
_loaded: dict = {}


def _module(name: str):
    """A tests/mpi module by file name, loaded once under a name of its own (so pytest
    does not collect its tests twice)."""
    if name not in _loaded:
        spec = importlib.util.spec_from_file_location(f"_threads_{name}",
                                                      os.path.join(MPI_TESTS, name + ".py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[name] = module
    return _loaded[name]


STAGES = (1, 2, 3)
ZERO = "test_zero_contracts"
DP = "test_data_parallel"
CASES = [
    *[(ZERO, "test_backward_without_global_count_averages_the_ranks_mean_losses",
       {"stage": s}) for s in STAGES],
    *[(ZERO, "test_accumulating_without_global_count_equals_one_big_batch", {"stage": s})
      for s in STAGES],
    *[(ZERO, "test_a_parameter_the_batch_did_not_reach_sums_zeros_not_the_last_steps_gradient",
       {"stage": s}) for s in STAGES],
    *[(ZERO, "test_each_stage_holds_exactly_its_promised_share_of_the_state",
       {"stage": s, "synced": synced}) for s in STAGES for synced in (True, False)],
    *[(ZERO, "test_clipping_scales_the_shards_to_the_global_norm_as_one_rank_does",
       {"stage": s}) for s in STAGES],
    *[(ZERO, "test_every_ranks_checkpoint_pieces_assemble_into_the_single_rank_state",
       {"stage": s}) for s in STAGES],
    *[(ZERO, "test_loading_a_full_state_restores_the_buffers_and_every_shard", {"stage": s})
      for s in STAGES],
    *[(ZERO, "test_plain_batch_norm_statistics_are_rank_0s_before_each_forward_as_data_parallel",
       {"stage": s}) for s in STAGES],
    (ZERO, "test_stage_3_reduces_in_one_order_when_a_rank_leaves_a_parameter_without_gradient",
     {}),
    (ZERO, "test_stage_3_prefetches_the_next_units_gather_in_forward_and_backward", {}),
    ("test_zero", "test_each_stage_equals_data_parallel_with_sgd_momentum_and_clipping",
     {"stage": 2}),
    ("test_zero", "test_accumulating_over_micro_batches_equals_one_big_batch", {"stage": 3}),
    *[(DP, "test_backward_without_global_count_averages_the_ranks_mean_losses",
       {"options": o}) for o in ({"overlap": False}, {"overlap": True})],
    (DP, "test_a_bucket_sent_in_several_messages_is_summed_whole", {"transport": "mpi"}),
    (DP, "test_data_parallel_sums_gradients_sent_in_several_messages", {}),
    (DP, "test_uneven_and_empty_rank_batches_give_the_global_gradient", {"global_batch": 2}),
    (DP, "test_rows_that_several_ranks_touch_are_summed_in_the_sparse_exchange",
     {"shared_memory": False}),
    (DP, "test_the_sparse_exchange_after_no_sync_sends_the_rows_of_every_micro_batch",
     {"shared_memory": False}),
    *[("test_model_parallel", "test_vocab_parallel_cross_entropy_equals_the_full_logits_loss_"
       "on_every_rank", {"reduction": r, "ignore_index": 2}) for r in ("mean", "sum")],
    # Tokens split unevenly over the tensor group (sequence parallelism): at 3 ranks a
    # rank's share starting at rank x the first share survived every tier but MPI's 3.
    ("test_model_parallel", "test_parallel_gpt_trains_like_the_single_rank_gpt",
     {"layout": "tensor-sequence-parallel"}),
]


def _id(case) -> str:
    module, name, kwargs = case
    return f"{module}::{name}" + "".join(f"[{k}={v}]" for k, v in kwargs.items())


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_the_multi_rank_contract_holds_on_thread_ranks(case, size):
    module, name, kwargs = case
    body = getattr(_module(module), name)
    run_ranks(size, lambda comm: body(comm, **kwargs), timeout=60)
