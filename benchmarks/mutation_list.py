"""The mutations that ``benchmarks/mutations.py`` plants, and the tests that must catch them.

Each one is a mistake someone could plausibly make in the library, written as an exact
text replacement. ``tests`` are the narrowest fast tests that catch it (pytest node ids
or files under ``tests/unit`` or ``tests/mpi``); an MPI test runs at 2 and 3 ranks
unless ``sizes`` says otherwise. Grouped by the part of the library they hit.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    """One planted mistake.

    Attributes:
        name: a short unique id (``--only NAME``).
        file: the library file, relative to the repository root.
        original: text that occurs exactly once in ``file`` (else the mutation is stale).
        mutated: what replaces it.
        why: the mistake it stands for, one line.
        tests: the tests that must fail with it (``tests/unit/...`` or ``tests/mpi/...``).
        sizes: the MPI sizes to run ``tests/mpi`` at; None: the run's (2 and 3).
    """

    name: str
    file: str
    original: str
    mutated: str
    why: str
    tests: tuple[str, ...]
    sizes: tuple[int, ...] | None = None


DP = "tests/mpi/test_data_parallel.py::"
COMM = "tests/mpi/test_comm.py::"
SEQ = "tests/mpi/test_sequence_attention.py::"
MODEL_PARALLEL = "tests/mpi/test_model_parallel.py::"
SAMPLER = "tests/unit/test_data_sampler.py::"
PLAN_COSTS = "tests/unit/test_plan_costs.py::"
OPTIM = "tests/unit/test_optim.py::"
ZERO_CONTRACTS = "tests/mpi/test_zero_contracts.py::"
ZC = "test_zero_contracts::"
SHARDED_UNIT = "tests/unit/test_sharded_checkpoint.py::"
DEVICE_CKPT = "tests/unit/test_checkpoint_device.py::"
RECOMPUTE = "tests/unit/test_recompute.py::"
MICRO = "tests/unit/test_microbatches.py::"
LAYOUTS = "tests/unit/test_layouts.py::"
PIPE = "tests/unit/test_pipeline.py::"
SCHED = "tests/unit/test_pipeline_schedule.py::"
TRAIN_PIPE = "tests/unit/test_train_pipeline.py::"
PSHARD = "tests/unit/test_data_parallel_shard.py::"
CONV = "tests/unit/test_functions_conv.py::"
POOL = "tests/unit/test_functions_pool.py::"
WRITTEN = "tests/unit/test_written_files_load.py::"
STORAGE = "tests/unit/test_storage.py::"
FAKE = "tests/unit/test_fake_device.py::"
BUDGETS = "tests/unit/test_device_budgets.py::"
# A tests/mpi body run on thread ranks in one process (tests/unit): case id, thread ranks.
THREADS = ("tests/unit/test_contracts_on_thread_ranks.py::"
           "test_the_multi_rank_contract_holds_on_thread_ranks[{}-{}]")

MUTATIONS: list[Mutation] = [
    # -- data parallelism ------------------------------------------------------------------
    Mutation(
        name="dp-seed-drops-loss-scale",
        file="mpidl/parallel/data.py",
        original="seed = (scale / global_count) if global_count else scale",
        mutated="seed = (1.0 / global_count) if global_count else scale",
        why="backward's seed forgets the loss scale when global_count is given",
        tests=(DP + "test_a_loss_scale_multiplies_the_averaged_gradients_exactly",),
    ),
    Mutation(
        name="dp-seed-per-rank-mean",
        file="mpidl/parallel/data.py",
        original="seed = (scale / global_count) if global_count else scale",
        mutated="seed = (scale / global_count * self.comm.size) if global_count else scale",
        why="the seed normalises by the per-rank count (global / size), not the global one",
        tests=(DP + "test_uneven_and_empty_rank_batches_give_the_global_gradient",),
    ),
    Mutation(
        name="overlap-bucket-started-before-full",
        file="mpidl/parallel/overlap.py",
        original="            if b.pending > 0:\n                return\n",
        mutated="            if b.pending > 1:\n                return\n",
        why="with overlap a bucket's allreduce starts while one of its gradients is still "
            "being accumulated: that gradient's last part is never summed",
        tests=(DP + "test_n_ranks_match_one_rank_with_the_global_batch",),
    ),
    Mutation(
        name="overlap-unstarted-bucket-skipped",
        file="mpidl/parallel/overlap.py",
        original="for b in self.buckets[self.next:]:",
        mutated="for b in self.buckets[self.next + 1:]:",
        why="after backward the first bucket no hook started is never allreduced",
        # The window transport sums all buckets at once: only MPI's allreduce loops.
        tests=(DP + "test_backward_without_global_count_averages_the_ranks_mean_losses",),
    ),
    Mutation(
        name="sparse-own-rows-not-cleared",
        file="mpidl/parallel/sparse.py",
        original="    grad[rows] = 0\n",
        mutated="",
        why="the row exchange adds every rank's rows onto the local gradient, ours twice",
        tests=(DP + "test_sparse_embedding_exchange_matches_dense",),
    ),
    Mutation(
        name="compression-decode-swapped",
        file="mpidl/parallel/compression.py",
        original='    if wire_dtype == "float16":\n        values = wire.view(numpy.float16)',
        mutated='    if wire_dtype == "bfloat16":\n        values = wire.view(numpy.float16)',
        why="the summed wire buffer is decoded as the other 16-bit format",
        tests=(DP + "test_compressed_gradients_stay_close_to_full_precision",),
    ),
    Mutation(
        name="compression-bfloat16-nan-rounded",
        file="mpidl/parallel/compression.py",
        original="    xp.copyto(r, quiet, where=nan)\n",
        mutated="",
        why="a NaN is rounded like a number, and its payload carries into inf or 0.0",
        tests=("tests/unit/test_compression.py::"
               "test_every_nan_pattern_stays_a_nan_of_its_sign_and_infinities_stay_infinite",),
    ),
    Mutation(
        name="compression-bfloat16-ties-down",
        file="mpidl/parallel/compression.py",
        original="    r &= 1\n",
        mutated="    r &= 0\n",
        why="bfloat16 rounding sends every tie down instead of to the even neighbour",
        tests=("tests/unit/test_compression.py::test_finite_values_round_to_nearest_even",),
    ),
    # -- collectives -----------------------------------------------------------------------
    Mutation(
        name="split-counts-extra-to-last-ranks",
        file="mpidl/comm/base.py",
        original="return [base + (1 if r < extra else 0) for r in range(parts)]",
        mutated="return [base + (1 if r >= parts - extra else 0) for r in range(parts)]",
        why="the one splitting rule gives the extra items to the last ranks, not the first",
        # Every user follows split_counts, so a consistent change passes the MPI tests;
        # the sampler's own copies of the rule are held to it by the second test.
        tests=("tests/unit/test_cli.py::test_split_counts_gives_the_first_ranks_one_more",
               SAMPLER + "test_rank_range_and_runs_between_split_each_batch_as_split_counts_does"),
    ),
    Mutation(
        name="reduce-scatter-counts-in-rows",
        file="mpidl/comm/mpi.py",
        original="[n * row_items for n in rows], op=_mpi_op(mop))",
        mutated="rows, op=_mpi_op(mop))",
        why="uneven reduce_scatter passes MPI row counts where it wants element counts",
        tests=(COMM + "test_reduce_scatter_gives_each_rank_its_block_of_the_sum",),
    ),
    Mutation(
        name="allgatherv-displacements",
        file="mpidl/comm/mpi.py",
        original="displs = [sum(counts[:r]) for r in range(self.size)]",
        mutated="displs = [r * counts[r] for r in range(self.size)]",
        why="allgatherv places each block as if every block were as long as its own",
        tests=(COMM + "test_allgatherv_concatenates_uneven_blocks_including_empty",),
    ),
    Mutation(
        name="shared-window-share-rounds-down",
        file="mpidl/comm/shared.py",
        original="step = -(-n // self.size)",
        mutated="step = n // self.size",
        why="each rank's share of the node-shared sum rounds down: the tail is summed by none",
        tests=(COMM + "test_node_shared_arrays_sum_every_rank_in_place",),
    ),
    # -- optimizers --------------------------------------------------------------------
    Mutation(
        name="adam-bias-correction",
        file="mpidl/optim/adam.py",
        original="self._step_size = lr / (1.0 - b1 ** t)",
        mutated="self._step_size = lr",
        why="Adam forgets the first moment's bias correction",
        tests=(OPTIM + "test_adam_matches_reference_formulas",),
    ),
    Mutation(
        name="adam-second-moment-correction-not-sqrt",
        file="mpidl/optim/adam.py",
        original="self._bias_correction2_sqrt = math.sqrt(1.0 - b2 ** t)",
        mutated="self._bias_correction2_sqrt = 1.0 - b2 ** t",
        why="sqrt(v) is divided by 1 - beta2^t instead of its square root",
        tests=(OPTIM + "test_adam_matches_reference_formulas",),
    ),
    Mutation(
        name="adamw-decay-without-lr",
        file="mpidl/optim/adam.py",
        original="param *= 1.0 - lr * self.weight_decay",
        mutated="param *= 1.0 - self.weight_decay",
        why="AdamW's decoupled decay is not scaled by the learning rate",
        tests=(OPTIM + "test_adamw_decays_decoupled_from_the_gradient",),
    ),
    Mutation(
        name="clip-scales-small-gradients-up",
        file="mpidl/optim/clip.py",
        original="coef = xp.minimum(max_norm / (norm + eps), 1.0)",
        mutated="coef = xp.asarray(max_norm / (norm + eps))",
        why="clip_grad_norm_ rescales every gradient to max_norm, small ones included",
        tests=("tests/unit/test_optim_schedule.py::"
               "test_clip_grad_norm_leaves_small_gradients_alone",),
    ),
    Mutation(
        name="grad-norm-replicated-counted-per-rank",
        file="mpidl/optim/clip.py",
        original="sq[0 if split else 1] += xp.dot(flat, flat)",
        mutated="sq[0] += xp.dot(flat, flat)",
        why="a parameter replicated over the tensor group counts once per rank in the norm",
        tests=("tests/mpi/test_model_parallel_costs.py::"
               "test_the_gradient_norm_counts_every_shard_once",),
    ),
    Mutation(
        name="loss-scale-no-floor",
        file="mpidl/optim/scaler.py",
        original="old, self.scale = self.scale, max(self.scale / self.factor, self.min_scale)",
        mutated="old, self.scale = self.scale, self.scale / self.factor",
        why="the dynamic loss scale backs off below its minimum",
        tests=(OPTIM + "test_the_dynamic_loss_scale_backs_off_on_overflow_and_grows_after_"
                       "good_steps",),
    ),
    # -- model parallelism -------------------------------------------------------------
    Mutation(
        name="megatron-f-backward-identity",
        file="mpidl/parallel/mappings.py",
        original="    def backward(self, gy):\n        return _allreduce(self.comm, gy)",
        mutated="    def backward(self, gy):\n        return gy",
        why="Megatron's f (copy to the region) does not sum the input gradient in backward",
        tests=(MODEL_PARALLEL + "test_parallel_gpt_trains_like_the_single_rank_gpt[tensor]",),
    ),
    Mutation(
        name="megatron-g-backward-allreduce",
        file="mpidl/parallel/mappings.py",
        original="    def backward(self, gy):\n        return gy\n",
        mutated="    def backward(self, gy):\n        return self.comm.allreduce(gy)\n",
        why="Megatron's g (reduce from the region) sums the gradient in backward as well",
        tests=(MODEL_PARALLEL + "test_parallel_gpt_trains_like_the_single_rank_gpt[tensor]",),
    ),
    Mutation(
        name="ring-merge-weight-swapped",
        file="mpidl/parallel/ring.py",
        original="xp.exp(_logsigmoid(xp, -d))",
        mutated="xp.exp(_logsigmoid(xp, d))",
        why="the online softmax merge weights the running output by the block's share",
        tests=(SEQ + "test_ring_attention_matches_full_attention[12-False-False]",),
    ),
    Mutation(
        name="ring-causal-hides-the-diagonal",
        file="mpidl/parallel/ring.py",
        original="layout.positions(src)[None, :] <= layout.positions(me)[:, None]",
        mutated="layout.positions(src)[None, :] < layout.positions(me)[:, None]",
        why="causal ring attention lets a query see only earlier keys, not itself",
        tests=(SEQ + "test_ring_attention_matches_full_attention[12-False-True]",),
    ),
    Mutation(
        name="ring-backward-without-delta",
        file="mpidl/parallel/ring.py",
        original="    dp -= delta[..., None]\n",
        mutated="",
        why="ring attention's backward leaves out rowsum(dO O) from dS",
        tests=(SEQ + "test_ring_attention_matches_full_attention[12-False-False]",),
    ),
    Mutation(
        name="ulysses-token-order",
        file="mpidl/parallel/sequence.py",
        original="y = y.transpose(1, 2, 3, 0, 4, 5).reshape(3, b, hs, s * t, dh)",
        mutated="y = y.transpose(1, 2, 3, 4, 0, 5).reshape(3, b, hs, s * t, dh)",
        why="Ulysses' all-to-all interleaves the ranks' tokens instead of concatenating them",
        tests=(SEQ + "test_ulysses_attention_matches_full_attention[12-True]",),
    ),
    Mutation(
        name="syncbn-backward-local-sums",
        file="mpidl/functions/batchnorm.py",
        original="            sums = self.allreduce(sums)  # global sums for the input gradient\n",
        mutated="            pass\n",
        why="SyncBatchNorm's backward uses this rank's gradient sums, not the global ones",
        tests=("tests/mpi/test_syncbn.py::"
               "test_sync_batchnorm_equals_batchnorm_on_the_global_batch[0.1-ascending-BC]",),
    ),
    Mutation(
        name="batchnorm-running-var-biased",
        file="mpidl/functions/batchnorm.py",
        original="unbiased = var * (n / xp.maximum(n - 1, 1))",
        mutated="unbiased = var",
        why="the running variance takes the biased batch variance (PyTorch's is unbiased)",
        # Not a SyncBatchNorm test: its reference, BatchNorm, shares this code.
        tests=("tests/unit/test_functions_batchnorm.py::test_training_forward_normalises_"
               "over_batch_and_space_and_updates_running_stats[numpy-BC]",),
    ),
    # -- data -----------------------------------------------------------------------------
    Mutation(
        name="sampler-epoch-ignored",
        file="mpidl/data/sampler.py",
        original="key = splitmix64(splitmix64(self.seed & _M64) ^ (self.epoch & _M64))",
        mutated="key = splitmix64(splitmix64(self.seed & _M64))",
        why="the shuffle is a function of the seed only: every epoch has the same order",
        tests=(SAMPLER + "test_epochs_and_seeds_give_different_orders",),
    ),
    Mutation(
        name="sampler-rank-offset",
        file="mpidl/data/sampler.py",
        original="lo = a + self.rank * base + min(self.rank, extra)\n",
        mutated="lo = a + self.rank * base\n",
        why="a rank's slice of an uneven batch ignores the larger shares before it",
        tests=(SAMPLER + "test_every_sample_once_per_epoch_at_1_2_3_ranks",),
    ),
    Mutation(
        name="sampler-planned-rank-offset",
        file="mpidl/data/sampler.py",
        original="lo = a + self.rank * base + numpy.minimum(self.rank, extra)",
        mutated="lo = a + self.rank * base",
        why="the loader's planned runs (runs_between) ignore the larger shares before a rank",
        tests=(SAMPLER + "test_runs_between_equals_runs_step_by_step",),
    ),
    Mutation(
        name="sampler-drop-last-swapped",
        file="mpidl/data/sampler.py",
        original="self._steps = n // g if drop_last else -(-n // g)",
        mutated="self._steps = -(-n // g) if drop_last else n // g",
        why="drop_last keeps the partial batch and the default drops it",
        tests=(SAMPLER + "test_drop_last_leaves_out_the_partial_batch",),
    ),
    Mutation(
        name="eval-wrong-predictions-counted-correct",
        file="mpidl/data/evaluate.py",
        original="xp.bincount(xp.where(pred == true, true, k), minlength=k + 1)[:k]",
        mutated="xp.bincount(xp.where(pred == true, true, 0), minlength=k + 1)[:k]",
        why="a wrong prediction lands in class 0's correct count instead of the extra bin",
        tests=("tests/unit/test_data_evaluate.py::test_accuracy_recall_and_macro_f1_by_hand",),
    ),
    Mutation(
        name="eval-loss-sum-not-reduced",
        file="mpidl/data/evaluate.py",
        original='            comm.allreduce_(loss, op="sum")\n',
        mutated="",
        why="the evaluation's loss sum stays per rank while the counts are global",
        tests=("tests/mpi/test_evaluation_mpi.py::"
               "test_the_confusion_matrix_is_the_same_at_any_number_of_ranks",),
    ),
    # -- checkpoints and the sampler position ------------------------------------------
    Mutation(
        name="loader-state-at-epoch-end",
        file="mpidl/data/loader.py",
        original="        if step >= len(self):\n            epoch, step = epoch + 1, 0",
        mutated="        if step > len(self):\n            epoch, step = epoch + 1, 0",
        why="a checkpoint after an epoch's last step resumes into the finished epoch",
        tests=("tests/unit/test_data_loader.py::test_resume_and_state_dict_continue_exactly",),
    ),
    Mutation(
        name="loader-resume-from-epoch-start",
        file="mpidl/data/loader.py",
        original='self.resume(int(state["epoch"]), int(state["step"]))',
        mutated='self.resume(int(state["epoch"]), 0)',
        why="a resumed run starts its epoch over, repeating the samples already seen",
        tests=("tests/unit/test_data_loader.py::test_resume_and_state_dict_continue_exactly",),
    ),
    Mutation(
        name="checkpoint-oldest-first",
        file="mpidl/train/checkpoint.py",
        original="for _, path in reversed(_listed(os.fspath(directory))):",
        mutated="for _, path in _listed(os.fspath(directory)):",
        why="resume picks the oldest loadable checkpoint instead of the newest",
        tests=("tests/unit/test_checkpoint.py::"
               "test_latest_ignores_tmp_and_skips_truncated_files_with_a_warning",),
    ),
    Mutation(
        name="checkpoint-keep-last-off-by-one",
        file="mpidl/train/retention.py",
        original="listed[: max(0, len(listed) - k)]",
        mutated="listed[: max(0, len(listed) - k + 1)]",
        why="keep_last(k) keeps k - 1 checkpoints",
        tests=("tests/unit/test_checkpoint.py::test_keep_last_keeps_the_newest_k",),
    ),
    Mutation(
        name="checkpoint-set-aside-includes-resumed",
        file="mpidl/train/retention.py",
        original="newer = [path for s, path in _listed(directory) if s > step]",
        mutated="newer = [path for s, path in _listed(directory) if s >= step]",
        why="resuming an older checkpoint moves that checkpoint aside too",
        tests=("tests/unit/test_checkpoint.py::"
               "test_resuming_an_older_checkpoint_sets_the_newer_ones_aside",),
    ),
    # -- hpc --------------------------------------------------------------------------------
    Mutation(
        name="hpc-allreduce-bus-factor",
        file="hpc/costmodel.py",
        original="return 2.0 * (ranks - 1) / ranks",
        mutated="return (ranks - 1) / ranks",
        why="allreduce's bus factor is taken as an allgather's, halving busbw and cost",
        tests=("tests/unit/test_bench.py::test_bus_factor_follows_nccl_tests",),
    ),
    Mutation(
        name="hpc-job-size-before-step-size",
        file="hpc/env.py",
        original='"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"',
        mutated='"SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NPROCS"',
        why="inside a Slurm step the job's task count wins over the step's",
        tests=("tests/unit/test_env.py::test_step_size_wins_over_job_size_inside_a_step",),
    ),
    Mutation(
        name="hpc-tasks-per-node-repeat",
        file="hpc/env.py",
        original="counts += [int(m.group(1))] * int(m.group(2) or 1)",
        mutated="counts += [int(m.group(1))]",
        why="Slurm's compressed '2(x3)' is read as one node of 2 tasks",
        tests=("tests/unit/test_env.py::test_parse_tasks_per_node_expands_compressed_lists",),
    ),
    # -- the gaps the hand mutation run of issue #31 found, and their tests ---------------
    Mutation(
        name="dp-no-global-count-divides-by-n-plus-1",
        file="mpidl/parallel/data.py",
        original="p.grad *= 1.0 / self.comm.size",
        mutated="p.grad *= 1.0 / (self.comm.size + 1)",
        why="without global_count the summed gradient is divided by N + 1, not N",
        tests=(THREADS.format("test_data_parallel::test_backward_without_global_count_averages_"
                              "the_ranks_mean_losses[options={'overlap': False}]", 2),
               DP + "test_backward_without_global_count_averages_the_ranks_mean_losses"),
    ),
    Mutation(
        name="zero-no-global-count-divides-by-n-plus-1",
        file="mpidl/parallel/zero.py",
        original="self._block_scale = (1.0 / self.comm.size",
        mutated="self._block_scale = (1.0 / (self.comm.size + 1)",
        why="ZeRO without global_count divides each reduced block by N + 1",
        tests=(THREADS.format(ZC + "test_backward_without_global_count_averages_the_ranks_mean_"
                              "losses[stage=1]", 2),
               ZERO_CONTRACTS + "test_backward_without_global_count_averages_the_ranks_mean_"
               "losses"),
    ),
    Mutation(
        name="transport-pieces-drop-last-element",
        file="mpidl/parallel/transport.py",
        original="allreduce_(flat[i:i + step], op=op)",
        mutated="allreduce_(flat[i:i + step - 1], op=op)",
        why="a bucket sent in several messages leaves each piece's last element unsummed",
        tests=(THREADS.format("test_data_parallel::test_a_bucket_sent_in_several_messages_is_"
                              "summed_whole[transport=mpi]", 2),
               DP + "test_a_bucket_sent_in_several_messages_is_summed_whole"),
    ),
    Mutation(
        name="zero-stage-1-keeps-an-unreached-gradient",
        file="mpidl/parallel/units.py",
        original="                view = self.grad_flat[a:b].reshape(shape)\n"
                 "                view[...] = 0\n",
        mutated="                view = self.grad_flat[a:b].reshape(shape)\n",
        why="stage 1 sums the last step's gradient of a parameter this batch did not reach",
        tests=(THREADS.format(ZC + "test_a_parameter_the_batch_did_not_reach_sums_zeros_not_the_"
                              "last_steps_gradient[stage=1]", 2),
               ZERO_CONTRACTS + "test_a_parameter_the_batch_did_not_reach_sums_zeros_not_the_"
               "last_steps_gradient"),
    ),
    Mutation(
        name="zero-no-sync-reduces-nothing",
        file="mpidl/parallel/zero.py",
        original="self._syncing = self.stage > 1  # stages 2-3 always reduce into the shards",
        mutated="self._syncing = False",
        why="stages 2-3 hold the full gradient under no_sync (the memory promise broken)",
        tests=(THREADS.format(ZC + "test_each_stage_holds_exactly_its_promised_share_of_the_"
                              "state[stage=2][synced=False]", 2),
               ZERO_CONTRACTS + "test_each_stage_holds_exactly_its_promised_share_of_the_state"),
    ),
    Mutation(
        name="zero-full-state-skips-the-buffers",
        file="mpidl/parallel/zero_state.py",
        original="b[...] = xp.asarray(v)  # in place: the module keeps its array",
        mutated="pass",
        why="loading a full state into ZeRO restores the parameters but not the buffers",
        tests=(THREADS.format(ZC + "test_loading_a_full_state_restores_the_buffers_and_every_"
                              "shard[stage=1]", 2),
               ZERO_CONTRACTS + "test_loading_a_full_state_restores_the_buffers_and_every_shard"),
    ),
    Mutation(
        name="zero-clipping-never-scales",
        file="mpidl/parallel/zero.py",
        original="                s.grad *= coef.astype(s.grad.dtype)",
        mutated="                s.grad * coef.astype(s.grad.dtype)",
        why="ZeRO's clipping computes the coefficient and never applies it",
        tests=(THREADS.format(ZC + "test_clipping_scales_the_shards_to_the_global_norm_as_one_"
                              "rank_does[stage=1]", 2),
               ZERO_CONTRACTS + "test_clipping_scales_the_shards_to_the_global_norm_as_one_rank_"
               "does"),
    ),
    Mutation(
        name="zero-member-slices-from-the-parameter-start",
        file="mpidl/parallel/units.py",
        original="out.append((k, x - a, x - lo, y - lo))",
        mutated="out.append((k, x - a, x - a, y - a))",
        why="a member's piece of a block is sliced from the parameter's offset, not the block's",
        tests=(THREADS.format(ZC + "test_every_ranks_checkpoint_pieces_assemble_into_the_single_"
                              "rank_state[stage=2]", 2),
               ZERO_CONTRACTS + "test_every_ranks_checkpoint_pieces_assemble_into_the_single_"
               "rank_state"),
    ),
    Mutation(
        name="zero-3-reduces-each-unit-when-final",
        file="mpidl/parallel/zero.py",
        original="        while self._next_reduce < len(order) and order[self._next_reduce].pending == 0:\n"
                 "            self._reduce(order[self._next_reduce])\n"
                 "            self._next_reduce += 1\n",
        mutated="        if u.pending == 0 and u.module is not self.module:\n"
                "            self._reduce(u)\n",
        why="stage 3 reduces a unit as soon as it is final: a rank that left a parameter "
            "without gradient reduces in another order",
        tests=(THREADS.format(ZC + "test_stage_3_reduces_in_one_order_when_a_rank_leaves_a_"
                              "parameter_without_gradient", 2),
               ZERO_CONTRACTS + "test_stage_3_reduces_in_one_order_when_a_rank_leaves_a_"
               "parameter_without_gradient"),
    ),
    Mutation(
        name="zero-drifting-buffers-not-broadcast",
        file="mpidl/parallel/zero.py",
        original="if self._drifting and self.module.training:",
        mutated="if False:",
        why="ZeRO lets plain batch norm's running statistics differ per rank",
        tests=(THREADS.format(ZC + "test_plain_batch_norm_statistics_are_rank_0s_before_each_"
                              "forward_as_data_parallel[stage=1]", 2),
               ZERO_CONTRACTS + "test_plain_batch_norm_statistics_are_rank_0s_before_each_"
               "forward_as_data_parallel"),
    ),
    Mutation(
        name="checkpoint-crc-not-checked",
        file="mpidl/train/checkpoint.py",
        original="verify = version >= 2",
        mutated="verify = False",
        why="a checkpoint's CRC-32s are written but never checked on load",
        tests=("tests/unit/test_checkpoint.py::test_a_changed_array_element_fails_its_checksum_"
               "naming_file_and_dataset",),
    ),
    Mutation(
        name="vocab-cross-entropy-local-max",
        file="mpidl/parallel/vocab.py",
        original="        m = x.max(axis=1)  # (N,)\n        if comm.size > 1:\n"
                 "            comm.allreduce_(m, op=\"max\")\n",
        mutated="        m = x.max(axis=1)  # (N,)\n",
        why="the split cross-entropy shifts each rank's logits by its own maximum",
        tests=(THREADS.format("test_model_parallel::test_vocab_parallel_cross_entropy_equals_the_"
                              "full_logits_loss_on_every_rank[reduction=mean][ignore_index=2]", 2),
               MODEL_PARALLEL + "test_vocab_parallel_cross_entropy_equals_the_full_logits_loss_on_"
               "every_rank"),
    ),
    Mutation(
        name="vocab-cross-entropy-float16-not-widened",
        file="mpidl/parallel/vocab.py",
        original="        if x.dtype.itemsize < 4:\n            x = x.astype(numpy.float32)\n",
        mutated="",
        why="16-bit logits split over the vocabulary reach MPI's max, which refuses float16",
        tests=(MODEL_PARALLEL + "test_vocab_parallel_cross_entropy_of_float16_logits_works_in_"
               "float32",),
    ),
    Mutation(
        name="held-bytes-counts-views-again",
        file="mpidl/parallel/wrapper.py",
        original="if id(buffer) not in self._seen:",
        mutated="if True:",
        why="a bucket or unit is counted once per view of it: the memory report inflates",
        tests=("tests/unit/test_wrapper.py::test_held_bytes_counts_a_buffer_once_through_all_"
               "its_views",),
    ),
    # -- gaps a later mutation run found (rows no two ranks shared, a chunked path, a
    #    counter, the resume, the sampler's copy of the splitting rule), and their tests --
    Mutation(
        name="sparse-rows-assigned-not-added",
        file="mpidl/parallel/sparse.py",
        original="grad[ids[start:start + n]] += values[start:start + n]",
        mutated="grad[ids[start:start + n]] = values[start:start + n]",
        why="a row several ranks touched keeps the last rank's gradient instead of the sum",
        # Test data over a 5000-row table almost never has two ranks touch one row.
        tests=(THREADS.format("test_data_parallel::test_rows_that_several_ranks_touch_are_"
                              "summed_in_the_sparse_exchange[shared_memory=False]", 2),
               DP + "test_rows_that_several_ranks_touch_are_summed_in_the_sparse_exchange"),
    ),
    Mutation(
        name="sparse-rows-not-accumulated-over-no-sync",
        file="mpidl/parallel/sparse.py",
        original="self._rows[id(p)] = touched if seen is None else xp.logical_or(seen, touched)",
        mutated="self._rows[id(p)] = touched",
        why="the sync after a no_sync cycle sends only the last micro-batch's rows",
        tests=(THREADS.format("test_data_parallel::test_the_sparse_exchange_after_no_sync_"
                              "sends_the_rows_of_every_micro_batch[shared_memory=False]", 2),
               DP + "test_the_sparse_exchange_after_no_sync_sends_the_rows_of_every_micro_"
               "batch"),
    ),
    Mutation(
        name="reduce-scatter-chunked-block-offset",
        file="mpidl/comm/mpi.py",
        original="start = sum(rows[: self.rank])",
        mutated="start = self.rank * rows[self.rank]",
        why="a reduce_scatter above max_message_bytes keeps rows as if every block were "
            "as long as this rank's",
        tests=(COMM + "test_a_large_reduce_scatter_gives_each_rank_its_block_of_uneven_rows",),
    ),
    Mutation(
        name="loss-scale-keeps-good-steps-after-overflow",
        file="mpidl/optim/scaler.py",
        original="        if not finite:\n            self.good_steps = 0\n",
        mutated="        if not finite:\n",
        why="the dynamic loss scale counts good steps from before an overflow and grows early",
        tests=(OPTIM + "test_an_overflow_starts_the_count_of_good_steps_again",),
    ),
    Mutation(
        name="trainer-resume-forgets-sampler-position",
        file="mpidl/train/checkpointing.py",
        original="            run.loader.load_state_dict(state.sampler)\n",
        mutated="            pass\n",
        why="a resumed run reads its epoch from the first batch again, not from where it "
            "stopped",
        tests=("tests/unit/test_train_resume.py::test_a_run_stopped_mid_epoch_resumes_at_the_"
               "next_batch_of_the_epoch",),
    ),
    Mutation(
        name="sampler-rank-range-extra-to-last-ranks",
        file="mpidl/data/sampler.py",
        original="        lo = a + self.rank * base + min(self.rank, extra)\n"
                 "        return lo, lo + base + (self.rank < extra)\n",
        mutated="        lo = a + self.rank * base + max(0, self.rank - (self.size - extra))\n"
                "        return lo, lo + base + (self.rank >= self.size - extra)\n",
        why="the sampler's own copy of the splitting rule gives the extra samples to the last "
            "ranks, unlike split_counts (each sample still read once)",
        tests=(SAMPLER + "test_rank_range_and_runs_between_split_each_batch_as_split_counts_"
                         "does",),
    ),
    # -- sharded checkpoints (format 3): the run arithmetic of mpidl/parallel/holdings.py,
    #    the records of each layout, the parts' block CRCs and the loader ----------------
    Mutation(
        name="holdings-overlap-end-off-by-one",
        file="mpidl/parallel/holdings.py",
        original="lo, hi = max(a0, b0), min(a0 + an, b0 + bn)",
        mutated="lo, hi = max(a0, b0), min(a0 + an, b0 + bn) - 1",
        why="two runs' shared elements stop one short of their common end: the last "
            "element of each overlap is never loaded",
        tests=(SHARDED_UNIT + "test_overlap_maps_shared_elements_between_two_orders",),
    ),
    Mutation(
        name="holdings-merge-drops-adjacent-run",
        file="mpidl/parallel/holdings.py",
        original="lengths = numpy.add.reduceat(runs[:, 1], starts)",
        mutated="lengths = runs[starts, 1]",
        why="joining a run to the one before keeps the first run's length: the runs "
            "after it are dropped",
        tests=(SHARDED_UNIT + "test_merge_joins_adjacent_runs_only",),
    ),
    Mutation(
        name="holdings-clip-end-off-by-one",
        file="mpidl/parallel/holdings.py",
        original="over = ends[keep][-1] - hi",
        mutated="over = ends[keep][-1] - hi + 1",
        why="a ZeRO block's runs end one element early where the block ends inside a run",
        tests=(SHARDED_UNIT + "test_clip_takes_local_elements_across_run_boundaries",),
    ),
    Mutation(
        name="sharded-block-crc-not-checked",
        file="mpidl/train/sharded.py",
        original="if zlib.crc32(data) != int(crcs[b]):",
        mutated="if False:",
        why="a part's blocks are read without checking their CRC-32: a damaged part "
            "loads silently",
        tests=(SHARDED_UNIT + "test_a_corrupt_piece_is_named_with_its_part_and_tensor",),
    ),
    Mutation(
        name="sharded-loader-reads-whole-piece",
        file="mpidl/train/sharded.py",
        original="blocks = sorted({b for _, at, n in segments\n"
                 "                         for b in range(at // block, (at + n - 1) // block + 1)})",
        mutated="blocks = range(len(crcs))",
        why="the loader reads (and checks) every block of a piece it overlaps, not only "
            "the blocks holding the overlap: a reshard reads more than its share",
        tests=(SHARDED_UNIT + "test_a_rank_reads_only_the_blocks_of_a_piece_that_hold_its_"
                              "elements",),
    ),
    Mutation(
        name="replicated-checkpoint-every-rank-writes",
        file="mpidl/train/checkpointer.py",
        original="writes = self.comm.rank == 0",
        mutated="writes = True",
        why="every data-parallel replica writes the whole state: N copies on disk, each "
            "element in the index N times",
        tests=(SHARDED_UNIT + "test_only_one_replica_writes_replicated_state",),
    ),
    Mutation(
        name="grid-checkpoint-every-replica-writes",
        file="mpidl/train/checkpointer.py",
        original="tensor.holdings(self.model, self.optimizer, self.layout.replicas.rank == 0,",
        mutated="tensor.holdings(self.model, self.optimizer, True,",
        why="every replica of a tensor-parallel grid writes its slices: pieces duplicated "
            "in the index",
        tests=(SHARDED_UNIT + "test_a_tensor_parallel_grid_and_a_grid_with_zero_save_the_"
                              "single_rank_model",),
    ),
    Mutation(
        name="zero-holdings-runs-from-block-start",
        file="mpidl/parallel/zero_state.py",
        original="runs, name, part = clip(runs, x - a, y - a), names[id(p)], slice(x - lo, y - lo)",
        mutated="runs, name, part = clip(runs, x - lo, y - lo), names[id(p)], slice(x - lo, y - lo)",
        why="a ZeRO member's runs count from the rank's block start, not the parameter's "
            "first element: a reshard puts elements in the wrong places",
        tests=(SHARDED_UNIT + "test_a_checkpoint_reshards_to_another_rank_count_and_stage_"
                              "reading_only_its_share",),
    ),
    Mutation(
        name="shard-runs-split-axis-as-rows",
        file="mpidl/parallel/tensor_state.py",
        original="full[shard.axis] = shard.groups * n",
        mutated="full[0] = shard.groups * n",
        why="a column-split parameter's full shape is widened along the rows: its "
            "records name another tensor's shape",
        tests=(SHARDED_UNIT + "test_a_tensor_parallel_shard_runs_name_exactly_the_elements_"
                              "take_keeps",),
    ),
    Mutation(
        name="holdings-bounds-last-inclusive",
        file="mpidl/parallel/holdings.py",
        original="return int(self.runs[0, 0]), int(self.runs[-1, 0] + self.runs[-1, 1])",
        mutated="return int(self.runs[0, 0]), int(self.runs[-1, 0] + self.runs[-1, 1] - 1)",
        why="the index's [first, last) range ends one element early: the loader skips a "
            "piece whose last element is the first one this rank needs",
        # The reshards' ZeRO blocks never start on a piece's last element: none caught it.
        tests=(SHARDED_UNIT + "test_a_record_of_any_runs_loads_exactly_those_elements",),
    ),
    # -- #38: what the checkpoint writers store, resuming across precisions, a full disk --
    Mutation(
        name="checkpoint-bfloat16-stored-opaque",
        file="mpidl/train/checkpoint_file.py",
        original='if array.dtype.name == "bfloat16":\n        return array.view(numpy.uint16), '
                 '"bfloat16"',
        mutated='if False:\n        return array.view(numpy.uint16), "bfloat16"',
        why="bfloat16 is handed to h5py as it is: stored as an opaque |V2 with no name",
        tests=(WRITTEN + "test_a_bfloat16_tensor_is_stored_as_its_bits_and_named",),
    ),
    Mutation(
        name="checkpoint-restored-ignores-the-dtype-name",
        file="mpidl/train/checkpoint_file.py",
        original="return array.view(bfloat16()) if _holds_bfloat16(array.dtype, name) else array",
        mutated="return array",
        why="a bfloat16 tensor reads back as its uint16 bits: eval says another model",
        tests=(WRITTEN + "test_a_single_file_checkpoint_loads_every_dtype_it_writes[bfloat16]",),
    ),
    Mutation(
        name="file-source-keys-the-stored-dtype",
        file="mpidl/train/pieces.py",
        original="self.shape, self.dtype = dataset.shape, ckpt.restored_dtype(dataset)",
        mutated="self.shape, self.dtype = dataset.shape, dataset.dtype",
        why="a single file read as a resume reads it names a bfloat16 tensor uint16: its "
            "values are cast, not reinterpreted",
        tests=(WRITTEN + "test_a_sharded_checkpoint_and_its_consolidated_file_load_every_"
                         "dtype[bfloat16]",),
    ),
    Mutation(
        name="resume-in-fp32-ignores-the-masters",
        file="mpidl/train/pieces.py",
        original="    if has and not wants:\n",
        mutated="    if False:\n",
        why="a half run resumed in fp32 is refused (the masters are unexpected keys)",
        tests=("tests/unit/test_precision_train.py::test_a_run_resumes_in_another_precision_"
               "from_the_fp32_values[bf16-fp32]",),
    ),
    Mutation(
        name="resume-in-half-makes-masters-from-the-half-values",
        file="mpidl/train/pieces.py",
        original="    if wants and not has:\n",
        mutated="    if False:\n",
        why="an fp32 run resumed in bf16 loses its fp32 values: the masters are made from "
            "the rounded half parameters",
        tests=("tests/unit/test_precision_train.py::test_a_run_resumes_in_another_precision_"
               "from_the_fp32_values[fp32-bf16]",),
    ),
    Mutation(
        name="checkpoint-save-catches-only-oserror",
        file="mpidl/train/checkpointer.py",
        original='except (OSError, RuntimeError) as e:\n                error = _storage_error(e, '
                 'part, "a checkpoint part")',
        mutated='except OSError as e:\n                error = _storage_error(e, part, '
                '"a checkpoint part")',
        why="HDF5's RuntimeError for a full disk escapes one rank: the job aborts with a "
            "traceback",
        tests=(STORAGE + "test_a_full_disk_while_saving_is_said_on_every_rank_and_leaves_no_"
                         "part[raised0]",),
    ),
    Mutation(
        name="storage-failure-misses-hdf5-errno",
        file="mpidl/storage.py",
        original="if isinstance(seen, (OSError, RuntimeError)):",
        mutated="if False:",
        why="an HDF5 RuntimeError carrying errno 28 is taken for a bug",
        tests=(STORAGE + "test_a_failure_of_storage_is_told_with_its_errno_and_the_file",),
    ),
    Mutation(
        name="failed-save-keeps-the-other-parts",
        file="mpidl/train/checkpointer.py",
        original="        if part is not None and os.path.exists(part):\n            os.remove(part)",
        mutated="        pass",
        why="a save that failed on one rank leaves the other ranks' parts: no checkpoint, "
            "and the space a full disk lacks",
        tests=(STORAGE + "test_a_full_disk_while_saving_is_said_on_every_rank_and_leaves_no_"
                         "part[raised1]",),
    ),
    # -- checkpoints of device arrays (#24): the host copy before a part is written, the
    #    device of state made on a load; caught with the fake-CuPy kit on thread ranks --
    Mutation(
        name="sharded-part-implicit-host-copy",
        file="mpidl/train/sharded.py",
        original="ckpt.stored(numpy.ascontiguousarray(as_numpy(values)).reshape(-1))",
        mutated="ckpt.stored(numpy.ascontiguousarray(values).reshape(-1))",
        why="a part is written from numpy.asarray of the rank's arrays: CuPy refuses the "
            "implicit copy, so no GPU run can checkpoint",
        tests=(DEVICE_CKPT + "test_a_grid_with_zero_on_the_device_saves_and_resumes_as_"
                             "the_host_run",),
    ),
    Mutation(
        name="holdings-optimizer-state-made-on-host",
        file="mpidl/parallel/holdings.py",
        original="            xp = get_array_module(optimizer.params[i].data)\n",
        mutated="            xp = numpy\n",
        why="a load makes the optimizer state it lacks on the host: a GPU run resumes "
            "with host moments beside device parameters",
        tests=(DEVICE_CKPT + "test_a_grid_with_zero_on_the_device_saves_and_resumes_as_"
                             "the_host_run",),
    ),
    # -- activation recomputation (#26, mpidl/nn/recompute.py): the recomputed forward's
    #    dropout masks, the generators' states, what each mode keeps; tests/unit, seconds --
    Mutation(
        name="recompute-finds-no-generators",
        file="mpidl/nn/recompute.py",
        original="        if rng is None or any(rng is g for g in found):",
        mutated="        if True:",
        why="the block's dropout generators go unnoticed (an attribute renamed): the "
            "recomputed forward redraws every mask, the classic silent bug",
        tests=(RECOMPUTE + "test_gpt_with_recomputation_has_the_gradients_masks_and_"
                           "generator_states_of_none[full-float32]",),
    ),
    Mutation(
        name="recompute-skips-setting-generators-back",
        file="mpidl/nn/recompute.py",
        original="            for g, state in zip(self.generators, self.before):\n"
                 "                _set_state(g, state)\n",
        mutated="",
        why="backward recomputes from the generators as they are now, not as the first "
            "forward found them",
        tests=(RECOMPUTE + "test_gpt_with_recomputation_has_the_gradients_masks_and_"
                           "generator_states_of_none[full-float64]",),
    ),
    Mutation(
        name="recompute-leaves-generators-at-first-forward-end",
        file="mpidl/nn/recompute.py",
        original="            for g, state in zip(self.generators, now):",
        mutated="            for g, state in zip(self.generators, self.after):",
        why="after recomputing, the generators go back to where the block's own forward "
            "left them, losing the draws of forwards run since (a pipeline's)",
        tests=(RECOMPUTE + "test_gpt_with_recomputation_has_the_gradients_masks_and_"
                           "generator_states_of_none[full-float64]",),
    ),
    Mutation(
        name="recompute-drops-parameter-gradients",
        file="mpidl/nn/recompute.py",
        original="    return Recompute.apply(x, *block.parameters(), fn=fn,",
        mutated="    return Recompute.apply(x, fn=fn,",
        why="the recomputed block's parameters are not inputs of its Function: only the "
            "input's gradient flows back",
        tests=(RECOMPUTE + "test_a_block_fed_data_that_needs_no_gradient_still_gives_its_"
                           "parameters_theirs",),
    ),
    Mutation(
        name="recompute-hooks-fire-in-the-inner-pass",
        file="mpidl/autograd.py",
        original="        x.grad, x.grad_buffer, x._post_accumulate_hooks = None, None, []",
        mutated="        x.grad, x.grad_buffer = None, None",
        why="the recomputing backward keeps the parameters' hooks: data parallelism "
            "reduces a bucket before the gradient it holds is final",
        tests=(RECOMPUTE + "test_data_parallel_and_zero_3_reduce_the_recomputed_gradients_"
                           "as_the_kept_ones[0]",),
    ),
    Mutation(
        name="recompute-inner-backward-is-a-new-pass",
        file="mpidl/autograd.py",
        original='    if getattr(_state, "in_backward", False):',
        mutated="    if False:",
        why="the recomputing backward counts as a pass of its own: the tied token table's "
            "dense gradient looks row-sparse to the sparse exchange",
        tests=(RECOMPUTE + "test_the_recomputing_backward_is_one_pass_so_the_tied_table_"
                           "stays_dense",),
    ),
    Mutation(
        name="selective-keeps-the-probabilities",
        file="mpidl/functions/attention.py",
        original="        self.p = p if self.keep_probs else None",
        mutated="        self.p = p",
        why="selective recomputation keeps P anyway: no memory saved",
        tests=(RECOMPUTE + "test_the_bytes_kept_per_block_are_the_documented_formula_in_each_"
                           "mode[0.1]",),
    ),
    Mutation(
        name="set-recompute-forgets-a-block",
        file="mpidl/nn/recompute.py",
        original="    for block in blocks:\n        block.recompute = mode",
        mutated="    for block in blocks[1:]:\n        block.recompute = mode",
        why="switching a built model misses its first block, which keeps everything",
        tests=(RECOMPUTE + "test_set_recompute_switches_a_built_model_and_the_gradients_stay",),
    ),
    # -- pipeline parallelism (mpidl/parallel/pipeline*.py, grid.py, point-to-point) -------
    Mutation(
        name="pipeline-loss-divided-per-microbatch",
        file="mpidl/parallel/pipeline.py",
        original="wrapped.backward(out, global_count=global_count, scale=scale)",
        mutated="wrapped.backward(out, global_count=global_count, scale=scale / self.m)",
        why="the loss is divided by the microbatches on top of the global count",
        tests=(PIPE + "test_gpipe_and_1f1b_equal_single_rank_accumulation_bit_for_bit",),
    ),
    Mutation(
        name="pipeline-reduces-every-microbatch",
        file="mpidl/parallel/pipeline.py",
        original="sync = contextlib.nullcontext() if index == self._last_backward else "
                 "wrapped.no_sync()",
        mutated="sync = contextlib.nullcontext()",
        why="data-parallel gradients are reduced after every microbatch, not once per step",
        tests=(PIPE + "test_a_data_axis_reduces_each_stage_over_its_replicas",),
    ),
    Mutation(
        name="pipeline-tied-gradient-dropped",
        file="mpidl/parallel/pipeline.py",
        original="                        surrogate = F.add(surrogate, "
                 "self._tied_gradient_term())\n",
        mutated="                        pass\n",
        why="the last stage's gradient of the tied embedding never reaches part 0",
        tests=(PIPE + "test_tied_embeddings_stay_one_parameter_across_the_first_and_last_stage",),
    ),
    Mutation(
        name="pipeline-tied-gradient-sent-early",
        file="mpidl/parallel/pipeline.py",
        original="                    and action.microbatch == self.m - 1:",
        mutated="                    and action.microbatch == 0:",
        why="the tied weight's gradient goes back after the first microbatch, not the last",
        tests=(PIPE + "test_tied_embeddings_stay_one_parameter_across_the_first_and_last_stage",),
    ),
    Mutation(
        name="pipeline-loss-keeps-last-microbatch",
        file="mpidl/parallel/pipeline.py",
        original="                    loss_sum = loss_sum + out.data\n",
        mutated="                    loss_sum = out.data\n",
        why="the step reports the last microbatch's loss, not the batch's sum",
        tests=(PIPE + "test_gpipe_and_1f1b_equal_single_rank_accumulation_bit_for_bit",),
    ),
    Mutation(
        name="pipeline-clip-norm-of-one-stage",
        file="mpidl/parallel/pipeline.py",
        original="        norm = xp.sqrt(self.grid.pipeline.allreduce_(squares)[0])",
        mutated="        norm = xp.sqrt(squares[0])",
        why="each stage clips by its own norm, not the whole model's",
        tests=(PIPE + "test_clipping_takes_the_norm_of_the_whole_model_over_the_stages",),
    ),
    Mutation(
        name="schedule-1f1b-one-more-warmup",
        file="mpidl/parallel/pipeline_schedule.py",
        original="        warmup = min(p - r - 1, m)\n",
        mutated="        warmup = min(p - r, m)\n",
        why="1F1B warms up p - r forwards, holding one microbatch more on every stage",
        tests=(SCHED + "test_1f1b_warms_up_p_minus_rank_minus_1_forwards_and_holds_p_minus_rank",),
    ),
    Mutation(
        name="schedule-interleaved-backward-chunks-not-reversed",
        file="mpidl/parallel/pipeline_schedule.py",
        original="return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p",
        mutated="return chunk, (k // (p * v)) * p + k % p",
        why="interleaved backwards walk the chunks forwards: a backward before its forward",
        tests=(SCHED + "test_interleaved_idles_p_minus_1_over_v_m",),
    ),
    Mutation(
        name="simulator-sends-never-block",
        file="mpidl/parallel/pipeline_schedule.py",
        original='                elif what == "send" and not blocking_sends:',
        mutated='                elif what == "send":',
        why="the simulator posts blocking sends too, so it cannot show the naive deadlock",
        tests=(SCHED + "test_blocking_sends_deadlock_1f1b_and_the_engines_posted_sends_do_not",),
    ),
    Mutation(
        name="grid-pipeline-inside-data",
        file="mpidl/parallel/grid.py",
        original="        self.data_rank = (w // (tensor * sequence)) % self.data_size\n"
                 "        self.pipeline_rank = w // (tensor * sequence * self.data_size)\n",
        mutated="        self.pipeline_rank = (w // (tensor * sequence)) % pipeline\n"
                "        self.data_rank = w // (tensor * sequence * pipeline)\n",
        why="the pipeline axis is placed inside the data axis: neighbouring stages share a node",
        tests=("tests/unit/test_pipeline_grid.py",),
    ),
    Mutation(
        name="p2p-byte-count-unchecked",
        file="mpidl/comm/mpi.py",
        original="            if got != self._expect[2]:",
        mutated="            if False:",
        why="a shorter message than the receive buffer passes silently (MPI allows it)",
        tests=("tests/mpi/test_point_to_point.py::"
               "test_a_message_of_another_size_is_an_error_naming_both_ranks",),
        sizes=(2,),
    ),
    Mutation(
        name="p2p-numbered-with-collectives",
        file="mpidl/comm/ledger.py",
        original="        if peer is not None:\n            self.p2p_seq += 1",
        mutated="        if False:\n            self.p2p_seq += 1",
        why="point-to-point calls advance the collective numbers, which then differ by rank",
        tests=("tests/unit/test_point_to_point.py::"
               "test_point_to_point_calls_are_numbered_apart_from_the_collectives",),
    ),
    # -- gradient accumulation (mpidl/train/step.py, --microbatches) ---------------------
    Mutation(
        name="accumulate-reduces-every-microbatch",
        file="mpidl/train/step.py",
        original="with contextlib.nullcontext() if last else run.dp.no_sync():",
        mutated="with contextlib.nullcontext():",
        why="every microbatch's backward reduces the gradients accumulated so far: earlier "
            "microbatches are summed over the ranks again and again",
        tests=(MICRO + "test_microbatches_equal_one_batch_on_data_parallel_and_zero",),
    ),
    Mutation(
        name="accumulate-divides-by-m-twice",
        file="mpidl/train/step.py",
        original="run.dp.backward(loss, global_count=count, scale=scale)",
        mutated="run.dp.backward(loss, global_count=count * m, scale=scale)",
        why="the loss, already divided by the whole batch's count, is divided by m again",
        tests=(MICRO + "test_microbatches_equal_one_batch_on_data_parallel_and_zero",),
    ),
    Mutation(
        name="microbatch-check-takes-the-largest-share",
        file="mpidl/train/build.py",
        original="    share = config.global_batch // data_ranks\n",
        mutated="    share = -(-config.global_batch // data_ranks)\n",
        why="the check lets through more microbatches than the smallest share has samples",
        tests=(MICRO + "test_more_microbatches_than_samples_is_a_config_error_naming_the_"
                       "values",),
    ),
    # -- the layouts planner (mpidl/layouts.py) --------------------------------------------
    Mutation(
        name="layouts-bubble-forgets-interleaving",
        file="mpidl/layouts.py",
        original='return (p - 1) / ((v if schedule == "interleaved" else 1) * m)',
        mutated="return (p - 1) / m",
        why="the interleaved schedule's bubble is priced as 1F1B's",
        tests=(LAYOUTS + "test_the_bubble_is_p_minus_1_over_m_and_interleaving_divides_it_by_v",),
    ),
    Mutation(
        name="layouts-selective-keeps-the-scores",
        file="mpidl/layouts.py",
        original='        if recompute == "none":\n',
        mutated='        if recompute != "full":\n',
        why="selective recomputation still counts the 5as^2b attention scores",
        tests=(LAYOUTS + "test_activation_bytes_per_layer_are_korthikantis",),
    ),
    Mutation(
        name="layouts-first-stage-holds-one-microbatch",
        file="mpidl/layouts.py",
        original="    held = float(min(p, m))\n",
        mutated="    held = 1.0\n",
        why="1F1B's first stage is priced with one microbatch in flight, not p",
        tests=(LAYOUTS + "test_the_first_stage_holds_p_microbatches_and_interleaving_a_"
                         "fraction_more",
               LAYOUTS + "test_memory_per_rank_is_the_heaviest_stage_with_its_microbatches_"
                         "in_flight"),
    ),
    Mutation(
        name="layouts-p2p-message-not-split-by-t",
        file="mpidl/layouts.py",
        original="    message = act_bytes / (t if opts.sequence_parallel and t > 1 else 1)\n",
        mutated="    message = act_bytes\n",
        why="the sequence-split activation is sent whole between stages",
        tests=(LAYOUTS + "test_point_to_point_bytes_are_2vm_messages_of_bsh_over_t",),
    ),
    Mutation(
        name="layouts-bf16-gradients-in-bf16",
        file="mpidl/layouts.py",
        original='"bf16": (6, 4 + 4 * copies)',
        mutated='"bf16": (4, 4 + 4 * copies)',
        why="bf16 training is priced with bf16 gradients, not Megatron's fp32 ones",
        tests=(LAYOUTS + "test_model_state_bytes_per_parameter_follow_megatrons_table",),
    ),
    # -- layer-wise optimizers (#27: mpidl/optim/layerwise.py, lamb.py, lars.py, the
    #    norms of each layout in mpidl/parallel/layerwise.py, train/optimizer_defaults.py) --
    Mutation(
        name="layerwise-replicated-counted-per-rank",
        file="mpidl/optim/layerwise.py",
        original=("                sums[:, self.on_device(\"replicated\", "
                  "get_array_module(sums))] = 0"),
        mutated="                pass",
        why="a tensor replicated over the tensor group adds its squares once per rank",
        tests=("tests/unit/test_optim_layerwise.py::"
               "test_a_replicated_tensor_counts_once_and_a_split_one_adds_up",),
    ),
    Mutation(
        name="layerwise-trust-not-clipped",
        file="mpidl/optim/layerwise.py",
        original="        ratio = xp.minimum(ratio, max_trust)",
        mutated="        ratio = ratio",
        why="LAMB's trust ratio is never clipped (the paper's phi)",
        tests=("tests/unit/test_optim_layerwise.py::"
               "test_lamb_ratio_is_clipped_and_a_zero_tensor_moves_by_its_direction",),
    ),
    Mutation(
        name="lamb-decays-biases",
        file="mpidl/optim/lamb.py",
        original="                if not self.norms.excluded[s.tensor]:",
        mutated="                if True:",
        why="LAMB decays biases and norm parameters, which the paper leaves out",
        tests=("tests/unit/test_optim_layerwise.py::test_the_update_is_the_papers",),
    ),
    Mutation(
        name="lars-decay-outside-the-ratio",
        file="mpidl/optim/lars.py",
        original="return trust(self.eta * w, g + self.weight_decay * w, excluded, self.max_trust)",
        mutated="return trust(self.eta * w, g, excluded, self.max_trust)",
        why="LARS's local rate ignores the weight decay term of its denominator",
        tests=("tests/unit/test_optim_layerwise.py::test_the_update_is_the_papers",),
    ),
    Mutation(
        name="layerwise-zero-segments-one-tensor-early",
        file="mpidl/parallel/layerwise.py",
        original="segments.append([Segment(start, stop, first + k)",
        mutated="segments.append([Segment(start, stop, first + k - (k > 0))",
        why="a ZeRO shard's parts are credited to the tensor before their own",
        tests=("tests/unit/test_layerwise_layouts.py",),
    ),
    Mutation(
        name="layout-norms-forget-the-tensor-group",
        file="mpidl/train/layout.py",
        original="return wrapper.tensor_norms(None if self.grid is None else self.grid.tensor)",
        mutated="return wrapper.tensor_norms(None)",
        why="mpidl train gives LAMB shard norms on a tensor-parallel grid",
        tests=("tests/unit/test_layerwise_layouts.py",),
    ),
    Mutation(
        name="lamb-scaled-linearly",
        file="mpidl/train/optimizer_defaults.py",
        original='"lamb": OptimizerDefaults(6e-3, "sqrt",',
        mutated='"lamb": OptimizerDefaults(6e-3, "linear",',
        why="LAMB's default rate grows linearly with the batch, not as its paper's sqrt",
        tests=("tests/unit/test_optimizer_defaults.py",),
    ),
    Mutation(
        name="preset-rate-kept-for-another-optimizer",
        file="mpidl/train/config.py",
        original="                setattr(config, key, None)",
        mutated="                pass",
        why="--optimizer lars keeps the preset's AdamW rate and decay",
        tests=("tests/unit/test_optimizer_defaults.py",),
    ),
    # -- half precision with fp32 master weights (#26: mpidl/optim/master.py, fp32
    # gradient buckets and units, bfloat16 at the NumPy and MPI boundaries) ---------------
    Mutation(
        name="master-not-copied-back",
        file="mpidl/optim/master.py",
        original="                p.data[...] = m.data  # in place: buckets and ZeRO shards view p.data",
        mutated="                pass",
        why="the fp32 masters are updated but the half parameters forward uses never move",
        tests=("tests/unit/test_master_weights.py",),
    ),
    Mutation(
        name="master-load-keeps-the-half-values",
        file="mpidl/optim/master.py",
        original="            self.inner.state[i][MASTER] = to_device(value, xp).astype(numpy.float32)",
        mutated="            pass",
        why="a resumed run's masters restart from the rounded half parameters",
        tests=("tests/unit/test_master_weights.py",),
    ),
    Mutation(
        name="buckets-keep-half-gradients",
        file="mpidl/parallel/buckets.py",
        original="        dtype = first.dtype if grad_dtype is None else grad_dtype",
        mutated="        dtype = first.dtype",
        why="half parameters' gradients accumulate and are allreduced in half precision",
        tests=("tests/unit/test_mixed_precision_ranks.py",),
    ),
    Mutation(
        name="zero-units-keep-half-gradients",
        file="mpidl/parallel/zero.py",
        original="                u.grad_dtype = numpy.dtype(grad_dtype)",
        mutated="                u.grad_dtype = u.dtype",
        why="ZeRO reduce-scatters half gradients though fp32 ones were asked for",
        tests=("tests/unit/test_mixed_precision_ranks.py",),
    ),
    Mutation(
        name="bfloat16-matmul-left-float32",
        file="mpidl/backend.py",
        original="        return y.astype(a.dtype)",
        mutated="        return y",
        why="NumPy's float32 product of bfloat16 operands leaks into the activations",
        tests=("tests/unit/test_master_weights.py",),
    ),
    Mutation(
        name="linear-bias-gradient-summed-in-bfloat16",
        file="mpidl/nn/linear.py",
        original="            gb = gy2.sum(axis=0, out=out, dtype=compute_dtype(gy2.dtype))",
        mutated="            gb = gy2.sum(axis=0, out=out)",
        why="a bfloat16 column sum stops growing at 256",
        tests=("tests/unit/test_master_weights.py",),
    ),
    Mutation(
        name="half-loss-rounded",
        file="mpidl/functions/loss.py",
        original="@functools.partial(widened, keep_float32=(0,))",
        mutated="@functools.partial(widened, keep_float32=())",
        why="the loss of half logits is rounded to half precision",
        tests=("tests/unit/test_master_weights.py",),
    ),
    Mutation(
        name="bfloat16-handed-to-mpi-as-is",
        file="mpidl/comm/datatypes.py",
        original="    return x.view(numpy.uint16) if is_float16(x) or is_bfloat16(x) else x",
        mutated="    return x.view(numpy.uint16) if is_float16(x) else x",
        why="a bfloat16 buffer goes to MPI, which has no type for it",
        tests=("tests/mpi/test_half_precision.py",),
    ),
    Mutation(
        name="half-functions-keep-widened-inputs",
        file="mpidl/functions/half.py",
        original="        setattr(f, name, x)\n",
        mutated="        pass\n",
        why="the float32 functions keep float32 copies of their half inputs for backward",
        tests=("tests/unit/test_master_weights.py",),
    ),
    # -- mpidl train with pipeline stages and recomputation (train/*.py, #26) ---------------
    Mutation(
        name="train-pipeline-step-bypassed",
        file="mpidl/train/step.py",
        original="        if run.layout.pipeline is not None:\n            return self._pipelined(",
        mutated="        if False:\n            return self._pipelined(",
        why="the trainer's step runs the accumulation loop on a pipelined model",
        tests=(TRAIN_PIPE + "test_a_pipelined_run_equals_single_rank_gradient_accumulation",),
    ),
    Mutation(
        name="train-pipeline-counts-sequences",
        file="mpidl/train/step.py",
        original="        return loss, self._counts[1], pipeline.hits",
        mutated="        return loss, len(x), pipeline.hits",
        why="a pipelined step counts its sequences, not their targets, under its loss sum",
        tests=(TRAIN_PIPE + "test_a_pipelined_run_equals_single_rank_gradient_accumulation",),
    ),
    Mutation(
        name="train-pipeline-clips-each-stage-alone",
        file="mpidl/train/layout.py",
        original="        if self.pipeline is not None:\n            return self.pipeline.clip_grad_norm_",
        mutated="        if False:\n            return self.pipeline.clip_grad_norm_",
        why="clipping takes each stage's norm for the model's (no sum over the stages)",
        tests=(TRAIN_PIPE + "test_a_pipelined_run_equals_single_rank_gradient_accumulation",),
    ),
    Mutation(
        name="train-pipeline-checkpoint-keeps-stage-names",
        file="mpidl/train/checkpointer.py",
        original="    return pipeline.module.parts[int(i)].full_name(rest)",
        mutated="    return rest",
        why="a stage writes its parts' own names: the stages' blocks.0 collide",
        tests=(TRAIN_PIPE + "test_a_pipeline_checkpoint_resumes_at_its_layout_bit_for_bit",
               TRAIN_PIPE + "test_a_pipeline_checkpoint_resumes_at_other_layouts"),
    ),
    Mutation(
        name="train-pipeline-generators-of-one-stage",
        file="mpidl/train/checkpointing.py",
        original="            ranks.setdefault(str(d), {}).update(s)",
        mutated="            ranks[str(d)] = s",
        why="a data rank's dropout generators are saved from one stage, the others lost",
        tests=(TRAIN_PIPE + "test_a_pipeline_checkpoint_resumes_at_its_layout_bit_for_bit",
               TRAIN_PIPE + "test_a_pipeline_checkpoint_resumes_at_other_layouts"),
    ),
    Mutation(
        name="train-pipeline-zero-blocks-not-refreshed",
        file="mpidl/train/checkpointer.py",
        original="        if self.zero:\n            zero_state.refresh_after_load(self.pipeline.wrapped)",
        mutated="        if False:\n            zero_state.refresh_after_load(self.pipeline.wrapped)",
        why="a resumed ZeRO stage trains on its parameters from before the load",
        tests=(TRAIN_PIPE + "test_a_pipeline_checkpoint_resumes_at_its_layout_bit_for_bit",),
    ),
    Mutation(
        name="train-pipeline-schedule-unchecked",
        file="mpidl/train/layout.py",
        original="        check_schedule(config.pipeline_schedule, p, m, v)",
        mutated="        pass",
        why="fewer microbatches than stages reach the engine instead of exit 2",
        tests=(TRAIN_PIPE + "test_an_impossible_pipeline_layout_is_a_config_error_saying_what_works",),
    ),
    Mutation(
        name="train-recompute-flag-ignored",
        file="mpidl/train/build.py",
        original="        set_recompute(model, config.recompute)",
        mutated="        set_recompute(model, \"none\")",
        why="--recompute never reaches the model's blocks",
        tests=(TRAIN_PIPE + "test_the_recompute_key_sets_every_block",),
    ),
    # -- parallel sharding (#28: mpidl/data/parallel.py, partition.py, the mergeable
    # statistics of stats.py and text.py): what N ranks must merge to equal one process --
    Mutation(
        name="shard-parallel-vocab-of-one-rank",
        file="mpidl/data/parallel.py",
        original="    vocab = agreed(comm, text_mod.vocab_from_counts, total, vocab_size, min_freq)",
        mutated="    vocab = agreed(comm, text_mod.vocab_from_counts, words, vocab_size, min_freq)",
        why="each rank's vocabulary from its own texts' word counts, not the sum over ranks",
        tests=(PSHARD + "test_two_and_three_ranks_write_one_process_dataset[csv]",),
    ),
    Mutation(
        name="shard-csv-cut-inside-quotes",
        file="mpidl/data/partition.py",
        original="                          quoted and before_q % 2 == 1, quoted, size)",
        mutated="                          False, quoted, size)",
        why="a rank's CSV range starts at any newline, even one inside a quoted field",
        tests=(PSHARD + "test_csv_spans_tile_the_file_at_record_boundaries",),
    ),
    Mutation(
        name="stats-merge-drops-between-part-variance",
        file="mpidl/data/stats.py",
        original="        out[\"m2\"] += p[\"m2\"] + delta * delta * out[\"n\"] * p[\"n\"] / total",
        mutated="        out[\"m2\"] += p[\"m2\"]",
        why="merged parts' std leaves out the spread between the parts' means",
        tests=(PSHARD + "test_two_and_three_ranks_write_one_process_dataset[npz]",),
    ),
    Mutation(
        name="histogram-percentile-one-too-high",
        file="mpidl/data/text.py",
        original="    return int(numpy.searchsorted(numpy.cumsum(counts), need, side=\"left\"))",
        mutated="    return int(numpy.searchsorted(numpy.cumsum(counts), need, side=\"right\"))",
        why="a percentile from summed histograms one value past NumPy's inverted CDF",
        tests=(PSHARD + "test_covering_counts_is_numpys_inverted_cdf_percentile",),
    ),
    Mutation(
        name="shard-parallel-test-split-one-row-more",
        file="mpidl/data/parallel.py",
        original="    orders = {\"train\": _order(positions, positions < n - n_test, shuffle)}",
        mutated="    orders = {\"train\": _order(positions, positions <= n - n_test, shuffle)}",
        why="the ranks' train split takes a row of the test split too",
        tests=(PSHARD + "test_two_and_three_ranks_write_one_process_dataset[npz]",),
    ),
    # -- ZeRO's gathers and their stage-3 schedule (mpidl/parallel/zero_gather.py, #24) -----
    Mutation(
        name="zero-3-never-prefetches",
        file="mpidl/parallel/zero_gather.py",
        original="        if u.request is None and u.flat is None:\n"
                 "            u.request = self.comm.iallgather(u.shard.data)",
        mutated="        if False:\n"
                "            u.request = self.comm.iallgather(u.shard.data)",
        why="stage 3 gathers every unit only when it is reached: the numbers hold, the "
            "overlap of the next unit's gather with this one's compute is lost",
        tests=(THREADS.format(ZC + "test_stage_3_prefetches_the_next_units_gather_in_forward_"
                              "and_backward", 2),
               ZERO_CONTRACTS + "test_stage_3_prefetches_the_next_units_gather_in_forward_"
               "and_backward"),
    ),
    Mutation(
        name="zero-3-keeps-units-gathered-after-forward",
        file="mpidl/parallel/zero_gather.py",
        original="            if u.module is not self.model:\n                u.release_params()",
        mutated="            if False:\n                u.release_params()",
        why="stage 3 keeps each unit's full parameters from its forward to its backward: "
            "the whole model gathered at once, the memory promise broken",
        tests=("tests/mpi/test_zero.py::test_bytes_per_step_match_the_theory",),
    ),
    # -- mpidl launch after a lost node (hpc/launch.py, #32) ---------------------------------
    Mutation(
        name="launch-trusts-mpiexecs-zero-after-a-lost-daemon",
        file="hpc/launch.py",
        original="        if code != 0 or not self.lost:\n            return code",
        mutated="        if True:\n            return code",
        why="mpidl launch passes on Open MPI 5.0.11's exit 0 after it lost a node's daemon: "
            "a job that lost a node reads as a success",
        tests=("tests/unit/test_launch.py::test_a_job_that_lost_a_node_never_exits_0",),
    ),
    Mutation(
        name="launch-sees-a-lost-daemon-only-on-the-last-line",
        file="hpc/launch.py",
        original="            self.lost = self.lost or LOST_DAEMON in line",
        mutated="            self.lost = LOST_DAEMON in line",
        why="the lost daemon is forgotten when mpiexec writes anything after it",
        tests=("tests/unit/test_launch.py::test_a_job_that_lost_a_node_never_exits_0",),
    ),
    Mutation(
        name="launch-a-lost-node-without-an-abort-exits-0",
        file="hpc/launch.py",
        original="        status = int(found.group(1)) if found else 1",
        mutated="        status = int(found.group(1)) if found else 0",
        why="a job that lost a node but had no MPI_Abort still reads as a success",
        tests=("tests/unit/test_launch.py::test_a_job_that_lost_a_node_never_exits_0",),
    ),
    # -- mpidl launch on every MPI (hpc/launch.py, #39) ------------------------------------
    Mutation(
        name="launch-never-sends-a-lost-preemption-again",
        file="hpc/launch.py",
        original="        if (self.preempted and not self.landed and self.terms < 2 and self.child is not None",
        mutated="        if (False and not self.landed and self.terms < 2 and self.child is not None",
        why="a SIGTERM that Hydra loses before its proxies connect is never sent again: the "
            "job trains to its end and exits 0",
        tests=("tests/unit/test_launch.py::"
               "test_a_preemption_the_launcher_lost_is_sent_again_until_it_lands",),
    ),
    Mutation(
        name="launch-takes-any-hydra-failure-for-the-preemption",
        file="hpc/launch.py",
        original="            status in family.died and (family.died_says is None or said.died or errors.died)):",
        mutated="            status in family.died):",
        why="Intel MPI's 255 after a preemption reads as 75 whatever failed: a crash during "
            "the checkpoint looks like a clean preemption",
        tests=("tests/unit/test_launch.py::"
               "test_hydras_report_of_a_rank_killed_by_the_preemption_counts_as_preempted",),
    ),
    Mutation(
        name="launch-aborts-hydra-as-open-mpi",
        file="hpc/launch.py",
        original='MPICH = Family("MPICH", ("HYDRA",), signal.SIGTERM, (signal.SIGINT, signal.SIGINT),',
        mutated='MPICH = Family("MPICH", ("HYDRA",), signal.SIGTERM, (signal.SIGTERM,),',
        why="the second SIGTERM is passed on to MPICH's mpiexec, which forwards it to the "
            "ranks as one more request: the promised abort never comes",
        tests=("tests/unit/test_launch.py::test_a_second_sigterm_aborts_as_the_family_aborts",),
    ),
    # -- data past the page cache (#28): windows, read-ahead groups, descriptors ---------
    Mutation(
        name="loader-readahead-advises-one-group-ahead-only-at-the-start",
        file="mpidl/data/loader.py",
        original="        while upto < end and upto <= step + group:",
        mutated="        while upto < end and upto < step + group:",
        why="read-ahead stops one group short: later steps are read without advice",
        tests=("tests/unit/test_data_loader.py::"
               "test_readahead_advises_each_step_once_a_group_at_a_time_in_file_order",),
    ),
    Mutation(
        name="loader-readahead-not-in-file-order",
        file="mpidl/data/loader.py",
        original='    a = a[numpy.argsort(a[:, 0], kind="stable")]\n',
        mutated="",
        why="a group's runs are advised in batch order: random reads, none merged",
        tests=("tests/unit/test_data_loader.py::"
               "test_readahead_advises_each_step_once_a_group_at_a_time_in_file_order",),
    ),
    Mutation(
        name="windowed-permutation-last-window-shifted",
        file="mpidl/data/permutation.py",
        original="        last = n - (self._windows - 1) * self.window  # positions of the last window",
        mutated="        last = n - self._windows * self.window + self.window - 1",
        why="the last window is one position short: a sample is never read",
        tests=(SAMPLER + "test_windowed_permutation_is_a_bijection_whose_windows_read_few_chunks",),
    ),
    Mutation(
        name="windowed-permutation-same-inside-every-window",
        file="mpidl/data/permutation.py",
        original="        inner[full] = self._inside(j[full], w[full].astype(numpy.uint64))",
        mutated="        inner[full] = self._inside(j[full])",
        why="every window orders its chunks' blocks alike (the inverse still tweaks)",
        tests=(SAMPLER + "test_windowed_permutation_is_a_bijection_whose_windows_read_few_chunks",),
    ),
    Mutation(
        name="sampler-windows-ignored",
        file="mpidl/data/sampler.py",
        original="        if blocks < _CHUNKS_PER_WINDOW:  # windows off, or too small to hold chunks",
        mutated="        if True:",
        why="the block order is never windowed: past the page cache every read is random",
        tests=(SAMPLER + "test_windowed_block_order_reads_whole_chunks_in_a_window_of_steps",),
    ),
    Mutation(
        name="shard-reopen-ignores-a-replaced-file",
        file="mpidl/data/shard.py",
        original="            if _identity(os.fstat(fd)) != layout.identity or \\\n",
        mutated="            if False or \\\n",
        why="a shard replaced on disk is reopened with the old file's offsets, unchecked",
        tests=("tests/unit/test_data_loader.py::"
               "test_an_open_shard_holds_one_descriptor_and_reopens_without_hdf5",),
    ),
    Mutation(
        name="shard-keeps-hdf5-open",
        file="mpidl/data/shard.py",
        original="        if not keep_hdf5 and all(o is not None for o in self.offsets.values()):",
        mutated="        if False:",
        why="an open shard keeps HDF5's descriptor: half as many shards stay open",
        tests=("tests/unit/test_data_loader.py::"
               "test_an_open_shard_holds_one_descriptor_and_reopens_without_hdf5",),
    ),
    # -- the fixed cost of a small step (#30): embedding tables summed in the node's
    #    shared window by their touched rows (mpidl/comm/shared.py), marked by DataParallel
    #    (parallel/data.py, sparse.py), written in place by backward (functions/embedding.py)
    Mutation(
        name="window-rows-union-misses-other-ranks",
        file="mpidl/comm/shared.py",
        original="        for m in masks[1:]:\n            union |= m\n",
        mutated="",
        why="the owner sums only the rows its own rank marked: rows only another rank "
            "touched keep that rank's gradient alone",
        tests=(COMM + "test_node_shared_tables_sum_the_marked_rows_to_the_whole_sum",),
    ),
    Mutation(
        name="window-rows-share-offset-dropped",
        file="mpidl/comm/shared.py",
        original="        return ids + s.start\n",
        mutated="        return ids\n",
        why="the marked rows of a share are taken as rows of the first share",
        tests=(COMM + "test_node_shared_tables_sum_the_marked_rows_to_the_whole_sum",),
    ),
    Mutation(
        name="window-rows-sum-written-to-own-copy-only",
        file="mpidl/comm/shared.py",
        original="        for t in tables:\n            t[ids] = total\n",
        mutated="        tables[self.rank][ids] = total\n",
        why="the rows' sum reaches the owner's copy, not the other ranks'",
        tests=(COMM + "test_node_shared_tables_sum_the_marked_rows_to_the_whole_sum",),
    ),
    Mutation(
        name="window-rows-decision-inverted",
        file="mpidl/comm/shared.py",
        original="        if ids.size > DENSE_ROWS_ABOVE * union.size:",
        mutated="        if ids.size < DENSE_ROWS_ABOVE * union.size:",
        why="few touched rows are summed whole and many row by row (exact, but slow)",
        tests=(COMM + "test_node_shared_tables_sum_the_marked_rows_to_the_whole_sum",),
    ),
    Mutation(
        name="window-dense-table-marked-by-its-rows",
        file="mpidl/parallel/sparse.py",
        original="            if id(p) in self._dense:\n                mask[...] = True\n",
        mutated="            if False:\n                mask[...] = True\n",
        why="a table whose gradient went dense (a penalty in the loss) is summed by the "
            "rows the lookups touched alone",
        tests=(DP + "test_a_weight_penalty_in_the_loss_makes_the_table_gradient_dense",),
    ),
    Mutation(
        name="window-table-rows-never-marked",
        file="mpidl/parallel/data.py",
        original="            self.sparse_tables.mark(self._table_masks)\n",
        mutated="",
        why="the tables' masks keep their first value (every row): the window always sums "
            "them whole (exact, but the row sum never runs)",
        tests=(DP + "test_sparse_embedding_exchange_matches_dense",),
    ),
    Mutation(
        name="embedding-grad-ignores-the-buffer",
        file="mpidl/functions/embedding.py",
        original="grad = xp.empty((vocab, dim), dtype=rows.dtype) if out is None else out",
        mutated="grad = xp.empty((vocab, dim), dtype=rows.dtype)",
        why="the table's gradient goes to a fresh array and is copied into its buffer "
            "(10 MB per step for bow)",
        tests=("tests/unit/test_functions_embedding.py::"
               "test_segment_sum_writes_the_table_gradient_into_the_given_buffer",),
    ),
    # -- convolutions at PyTorch's speed (#30: functions/conv.py's heap thresholds and
    #    kept unfolding, functions/pool.py's cropped odd maps); tests/unit, seconds -------
    Mutation(
        name="conv-heap-raise-above-glibc-ceiling",
        file="mpidl/functions/conv.py",
        original="_HEAP_RAISE_BYTES = 31 << 20",
        mutated="_HEAP_RAISE_BYTES = 33 << 20",
        why="the chunk freed at start is above glibc's 32 MiB ceiling: the thresholds stay, "
            "and every step's freed activations are faulted in again",
        tests=(CONV + "test_the_first_convolution_keeps_freed_activations_from_being_"
               "faulted_in_again",),
    ),
    Mutation(
        name="conv-kept-unfolding-read-twice",
        file="mpidl/functions/conv.py",
        original="        kept, self.cols = self.cols, None\n",
        mutated="        kept = self.cols\n",
        why="backward writes the input's unfolded gradient over the kept unfolding and a "
            "second backward (retain_graph) reads it as the input",
        tests=(CONV + "test_a_second_backward_through_the_graph_gives_the_same_gradients",),
    ),
    Mutation(
        name="pool-crop-gradient-at-the-far-end",
        file="mpidl/functions/pool.py",
        original="            gx[(slice(None),) * 2 + tuple(slice(n) for n in self.used)] = g\n",
        mutated="            gx[(slice(None),) * 2 + tuple(slice(-n, None) for n in self.used)] = g\n",
        why="the cropped map's gradient is written over the last rows/columns instead of "
            "the first",
        tests=(POOL + "test_max_pool_matches_the_definition_and_finite_differences"
               "[numpy-k2-sNone-p0-d1-2]",),
    ),
    Mutation(
        name="pool-crop-ignores-the-stride",
        file="mpidl/functions/pool.py",
        original="    if any(st != k or dl != 1 or any(p) for k, st, p, dl in",
        mutated="    if any(st < k or dl != 1 or any(p) for k, st, p, dl in",
        why="windows with gaps between them (stride > kernel) are cropped to kernel x "
            "outputs, cutting the last windows short",
        tests=(POOL + "test_max_pool_with_a_stride_beyond_the_window_reads_every_window",),
    ),
    # -- the planner against a network and the fixed cost (#32, #30: hpc/costmodel.py's
    #    measured curves, mpidl/plan_step.py, plan_probe.py); tests/unit, seconds -----------
    Mutation(
        name="costmodel-curve-interpolated-linearly",
        file="hpc/costmodel.py",
        original="    w = math.log(nbytes / n0) / math.log(n1 / n0)",
        mutated="    w = (nbytes - n0) / (n1 - n0)",
        why="a measured curve is interpolated linearly in bytes, not in log-log: between "
            "64 KB and 256 KB the price leans on the far end",
        tests=(PLAN_COSTS + "test_a_measured_curve_gives_its_own_times_at_its_sizes_and_rank_count",),
    ),
    Mutation(
        name="costmodel-curve-ignores-the-rank-count",
        file="hpc/costmodel.py",
        original="        if ranks == at:\n            return measured",
        mutated="        if True:\n            return measured",
        why="a curve measured at 2 ranks prices 3 ranks as if they were 2",
        tests=(PLAN_COSTS + "test_at_another_rank_count_the_curve_scales_by_the_lines_ratio",),
    ),
    Mutation(
        name="costmodel-save-drops-the-other-rank-counts",
        file="hpc/costmodel.py",
        original="            kept[op] = [(r, c) for r, c in link.curves if r != ranks]",
        mutated="            kept[op] = []",
        why="saving the 3-node sweep loses the 2-node curve of the same profile",
        tests=(PLAN_COSTS + "test_a_saved_sweep_is_loaded_back_as_its_curve_beside_those_at_"
               "other_rank_counts",),
    ),
    Mutation(
        name="plan-fixed-cost-on-one-rank",
        file="mpidl/plan.py",
        original="    fixed = costs.fixed_s if r > 1 else 0.0",
        mutated="    fixed = costs.fixed_s",
        why="the fixed cost of a distributed step is charged to the single-process step too",
        tests=(PLAN_COSTS + "test_predict_adds_the_fixed_cost_to_distributed_rows_and_shares_cores",),
    ),
    Mutation(
        name="plan-shared-cores-leave-the-exchange-alone",
        file="mpidl/plan.py",
        original="    comm = shared_cores(comm_seconds(work, r, nodes, network, node_link), r, "
                 "costs.cores)",
        mutated="    comm = comm_seconds(work, r, nodes, network, node_link)",
        why="ranks beyond the cores stretch compute but not the exchange's protocol work",
        tests=(PLAN_COSTS + "test_predict_adds_the_fixed_cost_to_distributed_rows_and_shares_cores",),
    ),
    Mutation(
        name="plan-achieved-overlap-goes-negative",
        file="mpidl/plan_step.py",
        original="    return min(max((comm_s - waited_s) / backward, 0.0), 1.0)",
        mutated="    return min((comm_s - waited_s) / backward, 1.0)",
        why="a run that waited longer than the priced exchange gives a negative overlap",
        tests=(PLAN_COSTS + "test_the_achieved_share_is_what_the_run_did_not_wait_for_over_its_"
               "backward",),
    ),
    Mutation(
        name="probe-counts-one-node",
        file="mpidl/plan_probe.py",
        original="    nodes = sum(comm.allgather_obj(comm.local_rank == 0))",
        mutated="    nodes = 1",
        why="the probe says one node when its ranks span several, and the fixed cost is "
            "priced against the node's link",
        tests=(PLAN_COSTS + "test_the_probe_takes_its_steps_on_every_rank_and_agrees_on_one_"
               "result[3-2-2-6]",),
    ),
    # -- #26's last gaps: a stage built alone, pipelined accuracy, 16-bit sums widened ----
    Mutation(
        name="stage-build-skips-no-draws",
        file="mpidl/nn/init.py",
        original='    if mode == "draw":',
        mutated="    if False:",
        why="a layer another stage keeps is built without drawing its values: every layer "
            "after it differs from the whole build's",
        tests=("tests/unit/test_pipeline_build.py::test_a_stage_built_gpt_keeps_the_whole_"
               "builds_values_and_nothing_else",),
    ),
    Mutation(
        name="pipeline-hits-not-from-the-last-stage",
        file="mpidl/parallel/pipeline.py",
        original="        self.hits = int(total[1])",
        mutated="        self.hits = hits",
        why="each stage reports its own next-token hits (none but the last's), not the "
            "last stage's broadcast",
        tests=("tests/unit/test_train_pipeline.py::test_pipelined_records_carry_the_single_"
               "rank_next_token_accuracy",),
    ),
    Mutation(
        name="tensor-parallel-sums-half-activations-in-half",
        file="mpidl/parallel/mappings.py",
        original="    if is_half(x.dtype):\n        return comm.allreduce(",
        mutated="    if False:\n        return comm.allreduce(",
        why="a row-parallel layer's 16-bit partial sums are reduced in 16 bits (bfloat16: "
            "no MPI type)",
        tests=("tests/unit/test_precision_layouts.py::test_half_precision_on_a_split_model_"
               "equals_one_rank",),
    ),
    # -- 9d300fb's FlatPlanes unfolding ('same', stride 1, whole samples) -------------------
    Mutation(
        name="conv-flat-planes-padding-left-in",
        file="mpidl/functions/conv.py",
        original="            self._zero_padding(cols[(slice(None),) + offset], edges)\n"
                 "        return cols",
        mutated="            pass\n        return cols",
        why="the positions a shift takes from the neighbouring row or sample are not "
            "zeroed: the unfolding reads the next row's values where the padding is",
        tests=(CONV + "test_every_unfolding_geometry_and_gemm_gives_the_same_results",
               CONV + "test_conv_forward_matches_the_definition"),
    ),
    Mutation(
        name="conv-flat-planes-shift-ignores-the-padding",
        file="mpidl/functions/conv.py",
        original="move = k * dl - lo  # output index i reads input index i + move",
        mutated="move = k * dl  # output index i reads input index i + move",
        why="a kernel offset's shift forgets the low padding: every output reads the input "
            "one kernel radius off",
        tests=(CONV + "test_every_unfolding_geometry_and_gemm_gives_the_same_results",
               CONV + "test_conv_forward_matches_the_definition"),
    ),
    # -- mpidl info's BLAS kernel note ----------------------------------------------------------
    Mutation(
        name="info-blas-hint-ignores-the-kernel",
        file="mpidl/info.py",
        original='"avx512f" not in flags or kernel.lower() in _AVX512_KERNELS:',
        mutated='"avx512f" not in flags:',
        why="the note warns on every AVX-512 CPU, also where OpenBLAS already runs its "
            "AVX-512 kernels",
        tests=("tests/unit/test_info.py::test_blas_kernel_hint_names_an_avx2_kernel_on_an_"
               "avx512_cpu_and_who_chose_it",),
    ),
    # -- the overwrite rule (hpc.files.check_output) and consolidate's fallback -------------
    Mutation(
        name="check-output-forgets-the-files-read",
        file="hpc/files.py",
        original="        if _is_read(path, os.fspath(read)):",
        mutated="        if False:",
        why="--force writes over the checkpoint or dataset the command reads",
        tests=("tests/unit/test_files.py::test_a_file_the_command_reads_is_refused_even_"
               "with_force",
               SHARDED_UNIT + "test_consolidate_never_writes_over_a_file_of_the_checkpoints_"
               "it_reads"),
    ),
    Mutation(
        name="check-output-compares-names-not-files",
        file="hpc/files.py",
        original="        return os.path.samefile(path, read)",
        mutated="        return False",
        why="a hard link to the file read passes as another file and is written over",
        tests=("tests/unit/test_files.py::test_a_link_or_a_hard_link_to_a_file_read_is_the_"
               "file_read",),
    ),
    Mutation(
        name="check-output-ignores-force",
        file="hpc/files.py",
        original="    if os.path.lexists(path) and not force:",
        mutated="    if False:",
        why="an existing file the user did not name for writing is written over",
        tests=("tests/unit/test_files.py::test_an_existing_file_needs_force_and_the_message_"
               "names_it_and_the_flag",
               SHARDED_UNIT + "test_consolidate_writes_over_an_existing_file_only_with_force"),
    ),
    Mutation(
        name="consolidate-stops-at-a-damaged-newest-checkpoint",
        file="mpidl/train/consolidate.py",
        original="                bad.append((path, str(e)))  # a damaged part: the next older one",
        mutated="                raise",
        why="consolidate refuses a run whose newest checkpoint has a damaged part instead "
            "of falling back to the next older one, as training does",
        tests=(SHARDED_UNIT + "test_consolidate_falls_back_past_a_newest_checkpoint_that_"
               "does_not_load",),
    ),
    # -- output paths checked before any work; input errors named where they are (#38) -------
    Mutation(
        name="out-dir-check-misses-a-file-on-the-way",
        file="hpc/argtypes.py",
        original="    if not os.path.isdir(existing):\n",
        mutated="    if not os.path.exists(existing):\n",
        why="OUT_DIR or a run directory under a regular file is taken for a directory: "
            "the message blames permissions instead of naming the file in the way",
        tests=("tests/unit/test_argtypes.py::test_an_output_directory_under_or_at_a_file_is_"
               "a_problem_naming_it",),
    ),
    Mutation(
        name="shard-checks-out-dir-after-the-conversion",
        file="mpidl/data/command.py",
        original="        agreed(comm, _check_out_dir, args.out_dir)\n",
        mutated="",
        why="mpidl shard converts the whole input before it finds that OUT_DIR cannot be "
            "made, and fails with a traceback (exit 1)",
        tests=(PSHARD + "test_an_out_dir_under_a_file_is_refused_before_the_input_is_read",),
    ),
    Mutation(
        name="train-checks-run-dir-after-the-work",
        file="mpidl/train/command.py",
        original="    if _config_error(comm, _run_dir_problem(run_dir, comm)):\n"
                 "        return EXIT_CONFIG\n",
        mutated="",
        why="a --run-dir that is a file is found only when the run directory is claimed, "
            "after the data and the model, as exit 1 advising to free space",
        tests=("tests/unit/test_train_resume.py::test_a_run_directory_at_or_under_a_file_is_"
               "bad_input_before_the_data_is_made",),
    ),
    Mutation(
        name="csv-bad-byte-offset-forgets-held-bytes",
        file="mpidl/data/csv_source.py",
        original="at = offset - held + e.start",
        mutated="at = offset + e.start",
        why="a character cut by the search's block boundary shifts the reported offset of "
            "a byte that is not UTF-8",
        tests=("tests/unit/test_data_errors.py::test_a_byte_that_is_not_utf8_is_named_by_its_"
               "file_offset_and_line",),
    ),
    Mutation(
        name="csv-bad-byte-line-from-the-block",
        file="mpidl/data/csv_source.py",
        original='lines += e.object[:e.start].count(b"\\n")',
        mutated="pass",
        why="the line of a byte that is not UTF-8 is the line where its block starts",
        tests=("tests/unit/test_data_errors.py::test_a_byte_that_is_not_utf8_is_named_by_its_"
               "file_offset_and_line",
               PSHARD + "test_a_byte_that_is_not_utf8_is_named_alike_at_any_rank_count"),
    ),
    Mutation(
        name="plan-time-unit-stops-at-hours",
        file="mpidl/plan.py",
        original='return ("h", 1) if hours < 48 else ("days", 1 / 24)',
        mutated='return "h", 1',
        why="a training of weeks is drawn and told in hundreds of hours",
        tests=("tests/unit/test_plan.py::test_time_unit_is_chosen_from_the_longest_time",),
    ),
    Mutation(
        name="plan-plot-time-axis-in-hours",
        file="mpidl/plan.py",
        original="ax_t.plot(r, [row.train_hours * per_hour for row in rows], marker=\"o\")",
        mutated="ax_t.plot(r, [row.train_hours for row in rows], marker=\"o\")",
        why="the plot's time axis names seconds but draws hours (0.0003 for a 1-second "
            "training)",
        tests=("tests/unit/test_plan.py::test_the_plots_time_axis_takes_its_unit_from_the_"
               "times",),
    ),
    Mutation(
        name="plot-image-suffix-case-sensitive",
        file="mpidl/train/plot.py",
        original='suffix = os.path.splitext(out)[1].lower().lstrip(".")',
        mutated='suffix = os.path.splitext(out)[1].lstrip(".")',
        why="mpidl plot --out RUN.SVG makes a directory of that name instead of one image",
        tests=("tests/unit/test_plot.py::test_out_naming_an_image_writes_one_file_of_the_three_"
               "panels",),
    ),
    Mutation(
        name="plot-directory-with-image-suffix-becomes-a-file",
        file="mpidl/train/plot.py",
        original="and not os.path.isdir(out)",
        mutated="",
        why="an existing directory named like an image (old.png/, as mpidl plot made "
            "before) is written as a file over: savefig fails on the directory",
        tests=("tests/unit/test_plot.py::test_out_naming_an_existing_directory_with_an_image_"
               "suffix_writes_into_it",),
    ),
    # -- launchers: PALS, the world-size refusal, srun's plugin ------------------------------
    Mutation(
        name="env-pals-not-read",
        file="hpc/env.py",
        original='    ("pals", ("PALS_RANKID",), ("PMI_SIZE",)',
        mutated='    ("pals", ("PALS_RANKID_",), ("PMI_SIZE",)',
        why="PALS's variables are not read: under PBS's mpiexec the process looks like a "
            "Hydra launch with no local rank, and every rank is assumed on one node",
        tests=("tests/unit/test_env.py::test_pals_variables_describe_the_process_and_pbs_"
               "gives_the_job",),
    ),
    Mutation(
        name="world-mismatch-never-refuses",
        file="hpc/env.py",
        original="    if world_size != 1 or not is_mpi_launch(environ):",
        mutated="    if world_size != 2 or not is_mpi_launch(environ):",
        why="a world of size 1 under an srun of N is not refused: N copies train alone",
        tests=("tests/unit/test_env.py::test_a_world_of_one_under_an_srun_of_two_is_refused_"
               "with_the_plugin_to_use",),
    ),
    Mutation(
        name="world-mismatch-refuses-a-batch-shell",
        file="hpc/env.py",
        original="    if job.size <= 1:\n        return None\n    seen =",
        mutated="    if job.size < 1:\n        return None\n    seen =",
        why="a launch of one (mpiexec -n 1, a one-task step) is refused as if MPI had not "
            "joined it",
        tests=("tests/unit/test_env.py::test_worlds_that_match_their_launch_are_not_refused",),
    ),
    Mutation(
        name="sbatch-profile-srun-mpi-not-exported",
        file="hpc/sbatch.py",
        original='                    "MPIDL_SRUN_MPI": profile.srun_mpi,',
        mutated='                    "MPIDL_SRUN_MPI": "",',
        why="a profile's srun_mpi is not rendered: Cray MPICH is started with --mpi=pmix",
        tests=("tests/unit/test_sbatch.py::test_a_rendered_job_runs_srun_with_its_profiles_"
               "plugin_and_pmi_library",),
    ),
    # -- #38's blind spots: a metric no test read, node counts that divided evenly, a
    # checkpoint read whole without its buffers -------------------------------------------
    Mutation(
        name="regression-mae-of-signed-errors",
        file="mpidl/train/objective.py",
        original="numpy.abs(e).sum(0), numpy.full(k, float(batch.loss) / k)]",
        mutated="e.sum(0), numpy.full(k, float(batch.loss) / k)]",
        why="the regression MAE sums the signed errors, which cancel: test_mae reads 0.0 "
            "where it is 1.0",
        tests=("tests/unit/test_evaluation.py::test_regression_scores_are_the_hand_worked_"
               "mse_mae_and_r2_of_each_output",
               "tests/mpi/test_evaluation_mpi.py::test_regression_scores_are_numpy_s_over_"
               "every_row_at_any_number_of_ranks"),
    ),
    Mutation(
        name="plan-nodes-rounded-down",
        file="mpidl/plan.py",
        original="nodes = -(-r // max(1, ranks_per_node))",
        mutated="nodes = max(1, r // max(1, ranks_per_node))",
        why="the planner's node count rounds down: 6 ranks at 4 a node price shared memory "
            "instead of the network",
        tests=("tests/unit/test_plan.py::test_ranks_that_do_not_fill_the_last_node_still_"
               "count_it_and_cross_the_network",),
    ),
    Mutation(
        name="plan-run-nodes-rounded-down",
        file="mpidl/plan_command.py",
        original='nodes = -(-run["ranks"] // args.ranks_per_node)',
        mutated='nodes = max(1, run["ranks"] // args.ranks_per_node)',
        why="--from-run's node count rounds down: a 3-rank run at 2 a node seems one node, "
            "so its achieved overlap is ignored",
        tests=("tests/unit/test_plan_costs.py::test_a_run_whose_last_node_is_not_full_spans_"
               "the_network_and_its_overlap_counts",),
    ),
    Mutation(
        name="sharded-whole-read-drops-buffers",
        file="mpidl/train/sharded.py",
        original='for n in order + buffers\n',
        mutated='for n in order\n',
        why="a sharded checkpoint read whole (consolidate, eval, predict) leaves out the "
            "buffers: BatchNorm's running statistics lost",
        tests=(SHARDED_UNIT + "test_batch_norm_statistics_come_back_from_a_sharded_checkpoint_"
               "on_thread_ranks",
               "tests/mpi/test_sharded_checkpoint.py::test_batch_norm_statistics_come_back_"
               "from_a_sharded_checkpoint_whole_and_resharded"),
    ),
    Mutation(
        name="layouts-group-within-a-node-by-size-alone",
        file="mpidl/layouts.py",
        original="    return ranks <= per_node or per_node % span == 0\n",
        mutated="    return span <= per_node\n",
        why="a group no larger than a node is priced on the node link, though groups of 3 at "
            "4 a node put ranks 3-5 on two nodes",
        tests=(LAYOUTS + "test_a_group_within_one_node_is_priced_on_the_node_link_and_one_"
                         "across_nodes_on_the_network",
               LAYOUTS + "test_the_search_keeps_every_tensor_group_within_a_node"),
    ),
    Mutation(
        name="layouts-full-node-priced-on-the-network",
        file="mpidl/layouts.py",
        original="    return ranks <= per_node or per_node % span == 0\n",
        mutated="    return ranks < per_node or (span < per_node and per_node % span == 0)\n",
        why="a group that fills its node exactly is priced on the network",
        tests=(LAYOUTS + "test_a_group_within_one_node_is_priced_on_the_node_link_and_one_"
                         "across_nodes_on_the_network",),
    ),
    Mutation(
        name="layouts-data-group-spans-d-ranks",
        file="mpidl/layouts.py",
        original="    data_link = _span_link(t * d, n, ranks_per_node, node_time, network_time)\n",
        mutated="    data_link = _span_link(d, n, ranks_per_node, node_time, network_time)\n",
        why="a data group is taken as d consecutive ranks, not d ranks strided by t: t8 x d2 "
            "at 8 a node seems one node",
        tests=(LAYOUTS + "test_a_group_within_one_node_is_priced_on_the_node_link_and_one_"
                         "across_nodes_on_the_network",),
    ),
    Mutation(
        name="eval-record-macro-f1-over-absent-classes",
        file="mpidl/data/evaluate.py",
        original='"macro_f1": _defined(self.macro_f1),',
        mutated='"macro_f1": _defined(float(self.f1.mean())),',
        why="the record's macro-F1 averages every class id, an absent class's NaN too: null "
            "in metrics.jsonl whenever a class has neither samples nor predictions",
        tests=("tests/unit/test_data_evaluate.py::test_a_class_neither_present_nor_predicted_"
               "is_left_out_of_macro_f1",),
    ),
    Mutation(
        name="lm-perplexity-of-the-summed-loss",
        file="mpidl/train/objective.py",
        original='"test_perplexity": _perplexity(loss)',
        mutated='"test_perplexity": _perplexity(totals[0])',
        why="the eval record's perplexity exponentiates the summed loss, not the loss per "
            "real target",
        tests=("tests/unit/test_evaluation.py::test_language_model_scores_are_per_real_target_"
               "over_every_batch_and_rank",),
    ),
    Mutation(
        name="predict-round-offset-assumes-equal-shares",
        file="mpidl/train/predict.py",
        original="first = start + sum(counts[:comm.rank])",
        mutated="first = start + comm.rank * counts[0]",
        why="a rank's rows of a predict round start at rank x the first share: with an "
            "uneven round (4 rows over 3 ranks) rank 2 scores past the round and an input "
            "is never scored",
        tests=("tests/unit/test_predict_inputs.py::test_every_input_is_scored_once_and_"
               "written_in_order_when_rounds_split_unevenly",),
    ),
    Mutation(
        name="tokens-shard-offset-assumes-equal-shares",
        file="mpidl/parallel/transformer.py",
        original="            start = sum(counts[:tensor.rank])\n",
        mutated="            start = tensor.rank * counts[0]\n",
        why="a tensor rank's tokens under sequence parallelism start at rank x the first "
            "share: with an uneven split (3 ranks) the last rank reads the wrong positions",
        tests=(THREADS.format("test_model_parallel::test_parallel_gpt_trains_like_the_single_"
                              "rank_gpt[layout=tensor-sequence-parallel]", 3),),
    ),
    Mutation(
        name="plan-noise-step-cut-not-per-rank",
        file="mpidl/plan_noise.py",
        original='"step_cut_efficiency": (1 / ratio) / r})',
        mutated='"step_cut_efficiency": 1 / ratio})',
        why="plan --json's share of the added ranks the steps' cut returns forgets to divide "
            "by the ranks",
        tests=("tests/unit/test_noise_train.py::test_the_noise_rows_give_the_steps_and_the_"
               "share_of_the_added_ranks_they_return",),
    ),
    Mutation(
        name="eval-confusion-table-shows-f1-as-recall",
        file="mpidl/train/inference.py",
        original="for name, counts, recall in zip(short, scores.confusion, scores.recall)]",
        mutated="for name, counts, recall in zip(short, scores.confusion, scores.f1)]",
        why="mpidl eval's confusion table shows each class's F1 under the heading recall",
        tests=("tests/unit/test_data_evaluate.py::test_mpidl_eval_reports_the_hand_worked_"
               "scores_and_the_confusion_matrix_by_class",),
    ),
    Mutation(
        name="regression-r2-mean-over-undefined-outputs",
        file="mpidl/train/objective.py",
        original='"test_r2": float(numpy.nanmean(r2))',
        mutated='"test_r2": float(r2.mean())',
        why="test_r2 averages every output's R², an output of constant targets (no R²) too: "
            "NaN for the whole run",
        tests=("tests/unit/test_evaluation.py::test_an_output_whose_targets_are_constant_has_"
               "no_r2_and_the_mean_skips_it",),
    ),
    # -- mpidl export / import (#44) ----------------------------------------------------------
    Mutation(
        name="gpt2-export-forgets-the-transpose",
        file="mpidl/interop/hf_gpt2.py",
        original="        if transposed:\n            shape = tuple(reversed(shape))",
        mutated="        if False:\n            shape = tuple(reversed(shape))",
        why="GPT-2's Conv1D weights are (in, out): a square projection untransposed loads "
            "into transformers and computes another function",
        tests=("tests/unit/test_interop.py::test_hf_gpt2_export_writes_a_config_and_weights_"
               "that_import_back_exactly",),
    ),
    Mutation(
        name="safetensors-offsets-skip-a-gap",
        file="mpidl/interop/safetensors.py",
        original="        offset += size",
        mutated="        offset += size + 8",
        why="the header's offsets leave gaps the data does not have: another reader takes "
            "the wrong bytes",
        tests=("tests/unit/test_interop.py::test_the_header_follows_the_published_layout",),
    ),
    Mutation(
        name="safetensors-reader-accepts-a-truncated-file",
        file="mpidl/interop/safetensors.py",
        original="    if 8 + n + end != size:",
        mutated="    if False:",
        why="a truncated or padded file loads as if whole",
        tests=("tests/unit/test_interop.py::test_a_damaged_file_is_an_error_naming_it",),
    ),
    Mutation(
        name="export-writes-into-the-runs-checkpoints",
        file="mpidl/interop/command.py",
        original='    reads = [checkpoint, os.path.join(run_dir_of(checkpoint), "checkpoints")]',
        mutated="    reads = []",
        why="--force writes the export over the checkpoint it reads",
        tests=("tests/unit/test_interop.py::test_bad_export_input_exits_2_before_writing",),
    ),
    Mutation(
        name="device-matmul-widens-half-operands",
        file="mpidl/backend.py",
        original="    if is_cupy(xp):\n        a_dtype = a.dtype",
        mutated="    if False:\n        a_dtype = a.dtype",
        why="16-bit GEMMs on the GPU widened to float32: fp32 speed plus two casts (#48)",
        tests=(FAKE + "test_16_bit_operands_reach_the_device_gemm_as_16_bit",),
    ),
    Mutation(
        name="pipeline-reads-loss-per-microbatch",
        file="mpidl/parallel/pipeline.py",
        original="                    loss_sum = loss_sum + out.data\n",
        mutated="                    loss_sum = loss_sum + float(out.data)\n",
        why="the last stage waits for the device at every microbatch (#48 point 3)",
        tests=(FAKE + "test_a_pipeline_step_reads_the_host_once_not_per_microbatch",),
    ),
    Mutation(
        name="pipeline-state-gathers-device-arrays",
        file="mpidl/parallel/pipeline_state.py",
        original="        mine.update({n: as_numpy(a) for n, a in part_full_state(part).items()})",
        mutated="        mine.update(part_full_state(part))",
        why="every rank allocates every stage's parameters on its GPU (#48 point 7)",
        tests=(FAKE + "test_a_pipelines_full_state_is_gathered_on_the_host_not_on_every_"
               "device",),
    ),
    Mutation(
        name="bf16-allowed-on-cupy-13",
        file="mpidl/backend.py",
        original="    if major >= CUPY_BFLOAT16:",
        mutated="    if major >= 12:",
        why="bf16 on CuPy 13 fails mid-build instead of exit 2 before any work (#48 point 1)",
        tests=(FAKE + "test_bf16_on_cupy_13_is_refused_by_mpidl_train_before_any_work",),
    ),
    Mutation(
        name="planner-prices-fp32-at-tf32",
        file="mpidl/plan_layouts.py",
        original="        if device.kind != \"gpu\" or tf32:",
        mutated="        if True:",
        why="fp32 GEMMs priced at the TF32 rate CuPy does not run by default (#48 point 2)",
        tests=(FAKE + "test_tf32_is_the_jobs_choice_and_the_planner_prices_what_runs",),
    ),
    Mutation(
        name="step-reads-each-finite-check-apart",
        file="mpidl/train/step.py",
        original="        values = read_values(run.xp, run.xp.isfinite(loss), "
                 "grads_finite(params), *noise)",
        mutated="        values = [float(run.xp.isfinite(loss)), float(grads_finite(params)),\n"
                "                  *(float(v) for v in noise)]",
        why="a host read per value instead of one a step (#48 point 5)",
        tests=(BUDGETS + "test_a_step_of_each_model_and_mode_keeps_its_device_budgets",),
    ),
    # -- PowerSGD (#43: mpidl/parallel/powersgd.py, powersgd_state.py) -----------------------
    Mutation(
        name="powersgd-no-orthogonalisation",
        file="mpidl/parallel/powersgd.py",
        original="            p[...] = basis\n",
        mutated="",
        why="the summed P is used without its orthonormal basis: the approximation is scaled",
        tests=("tests/mpi/test_powersgd.py::test_at_full_rank_the_transport_sums_exactly_"
               "every_step",),
    ),
    Mutation(
        name="powersgd-error-not-divided-by-ranks",
        file="mpidl/parallel/powersgd.py",
        original="                e -= m / size",
        mutated="                e -= m",
        why="each rank's error subtracts the whole sum's approximation: their sum loses N-1 of it",
        tests=("tests/mpi/test_powersgd.py::test_at_rank_one_the_errors_hold_exactly_what_the_"
               "approximation_lost",),
    ),
    Mutation(
        name="powersgd-state-not-checkpointed",
        file="mpidl/train/checkpointer.py",
        original="        chosen.compression = compression\n",
        mutated="        chosen.compression = None\n",
        why="a resumed PowerSGD run starts with zero errors and new Qs: not bit-exact",
        tests=("tests/mpi/test_powersgd.py::test_resuming_a_compressed_run_continues_bit_for_"
               "bit",),
    ),
    Mutation(
        name="powersgd-step-of-the-least-bucket",
        file="mpidl/parallel/powersgd.py",
        original="return max(self.steps) if self.steps else 0",
        mutated="return min(self.steps) if self.steps else 0",
        why="an embedding table's bucket (summed apart) holds the step count at 0: a resume "
            "repeats the uncompressed first steps",
        tests=("tests/mpi/test_powersgd.py::test_an_embedding_table_travelling_apart_does_not_"
               "hold_back_the_step_count",),
    ),
    Mutation(
        name="powersgd-small-matrix-compressed",
        file="mpidl/parallel/powersgd.py",
        original="size > options.min_compression_rate * (n + m) * rank",
        mutated="size >= 0",
        why="every matrix is compressed, however few elements it would save",
        tests=("tests/unit/test_powersgd_plan.py::test_biases_and_small_matrices_travel_"
               "uncompressed_together",),
    ),
    # -- issue #47: the linear model, the data's choices, the baseline ------------------------
    Mutation(
        name="linear-tokens-count-padding",
        file="mpidl/models/linear.py",
        original='            return F.add(bag_pool(self.embed, x, self.pad_id, "sum"), self.bias)',
        mutated='            return F.add(bag_pool(self.embed, x, None, "sum"), self.bias)',
        why="the linear model counts the padding id as a word: every short text gets the "
            "padding row's weight times its padding",
        tests=("tests/unit/test_models.py::test_the_linear_model_on_tokens_is_counts_times_a_"
               "table_plus_a_bias",),
    ),
    Mutation(
        name="bag-sum-pooling-is-the-mean",
        file="mpidl/models/textclf.py",
        original='    if pooling == "mean":\n        return pooled',
        mutated='    if pooling:\n        return pooled',
        why="sum pooling returns the mean: the linear model's logits shrink with the text's "
            "length",
        tests=("tests/unit/test_models.py::test_sum_pooling_is_the_mean_times_the_real_tokens",
               "tests/unit/test_models.py::test_the_linear_model_on_tokens_is_counts_times_a_"
               "table_plus_a_bias"),
    ),
    Mutation(
        name="data-fit-epochs-ignore-min-steps",
        file="mpidl/train/data_fit.py",
        original="return max(at_least, min(MAX_EPOCHS, math.ceil(MIN_STEPS / per_epoch)))",
        mutated="return at_least",
        why="a small dataset keeps the preset's 2 epochs: 86 steps on the UCI sentences, "
            "0.67-0.69 test accuracy instead of 0.82-0.85",
        tests=("tests/unit/test_data_fit.py::test_epochs_give_at_least_min_steps_within_the_"
               "bounds",
               "tests/unit/test_data_fit.py::test_token_ids_get_the_bag_of_words_and_enough_"
               "epochs"),
    ),
    Mutation(
        name="data-fit-overrides-a-given-model",
        file="mpidl/train/data_fit.py",
        original='    if not sets(overrides, "model"):',
        mutated='    if True:',
        why="the data's choice of model wins over the user's --model",
        tests=("tests/unit/test_data_fit.py::test_a_model_given_on_the_command_line_wins",),
    ),
    Mutation(
        name="baseline-runs-on-any-size",
        file="mpidl/train/baseline.py",
        original="    return len(train_set) * max(math.prod(x.shape), 1) <= MAX_VALUES",
        mutated="    return True",
        why="the baseline fits however large the dataset: minutes added to a large run",
        tests=("tests/unit/test_baseline.py::test_the_baseline_runs_where_asked_on_small_"
               "data_only",),
    ),
]
