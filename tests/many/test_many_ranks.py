"""The many-rank tier: what only shows at size, at 8 and 16 ranks on a 2-core machine
(oversubscribed: tiny models and datasets, float64, against one rank).

tests/run.py runs this file once per size (``--many-sizes``, default 8,16)::

    mpiexec --oversubscribe -n 16 python -m pytest --with-mpi -p no:cacheprovider -q tests/many

At 1-7 ranks they skip: tests/mpi covers those sizes. The watchdog at 16 ranks is
test_watchdog_at_16_ranks.py (single-process: it launches its own ranks).

- the sampler: every sample once, global batches as on one rank (tests/mpi's bodies);
- evaluation under ZeRO-3, equal to one rank, with global batches that leave every
  possible number of ranks (0 to size-1) an empty share of a split's last batch, and
  the 513-sample split that hung `mpidl train --zero=3` at 2 ranks;
- ZeRO 1-3 equal one rank (tests/mpi's bodies; 13 samples a step, so at 16 ranks three
  ranks train on empty shares);
- a tensor x sequence x data grid of the GPT (2 x 2 x size/4) trains like one rank;
- a ZeRO-3 checkpoint of every rank resumes on 3 ranks and on 1, as one rank would.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy
import pytest

from mpidl.comm.single import SingleCommunicator
from mpidl.data import ShardedDataset
from mpidl.parallel import ShardedDataParallel
from mpidl.testing import assert_all_ranks
from mpidl.train import checkpoint as ckpt
from mpidl.train.checkpointer import choose_checkpointer
from mpidl.train.evaluation import evaluate, evaluation_loader

MANY = 8  # below this, tests/mpi's sizes


def world_size() -> int:
    """The launcher's size, read from its variables: MPI is not started in a process that
    runs the single-process tiers (their tests launch mpiexec)."""
    from hpc.env import detect

    return detect().size


pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120),
              pytest.mark.skipif(world_size() < MANY, reason=f"the many-rank tier runs at "
                                 f"{MANY} ranks or more (tests/run.py)")]

if world_size() >= MANY:
    # tests/mpi's bodies, called here at other sizes; only where they run: the
    # single-process launch, which collects this file too, has tests/unit modules of
    # the same names (test_sharded_checkpoint).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))


@pytest.mark.parametrize("mode", ["block", "full"])
def test_the_sampler_gives_every_sample_once_and_the_single_rank_batches(comm, mode):
    import test_sampler_mpi

    # fewer samples than ranks, a step of fewer than the ranks, blocks, a larger set
    for n, g, block in [(7, 4, 2), (101, 8, 3), (257, 16, 5), (1000, 64, 32)]:
        test_sampler_mpi.test_ranks_together_see_every_sample_once(comm, mode, n, g, block)
    # the old order (a window as large as the set) and windows of 16 blocks (64 ids)
    for window in (16384, 64) if mode == "block" else (16384,):
        test_sampler_mpi.test_global_batches_equal_the_single_rank_batches(comm, mode, window)


@pytest.mark.parametrize("kind,stage", [("mlp", 1), ("mlp", 2), ("mlp", 3), ("gpt", 3)])
def test_zero_equals_the_single_rank_model_with_ranks_of_empty_batches(comm, kind, stage):
    """13 samples a step: at 16 ranks three train on none."""
    import test_zero

    test_zero.test_each_stage_equals_the_single_rank_model(comm, stage, kind)


def batches(size):
    """Global batches over a split of 2 x size - 1 rows whose last batch holds r rows,
    r = 0 .. size-1: size - r ranks (every number from 1 to size-1, and none) have an
    empty share of it. One batch when r = 0."""
    rows = 2 * size - 1
    return rows, [rows] + [rows - r for r in range(1, size)]


def write_split(comm, root, rows):
    """Rank 0 writes ``rows`` rows of 3 features and a class of 5, in shards of 128 rows
    (few files: 16 ranks opening many small ones crawl on 2 cores); every rank opens it."""
    from mpidl.data import write_shards

    if comm.rank == 0:
        rng = numpy.random.default_rng(7)
        write_shards(root, {"x": rng.normal(size=(rows, 3)), "y": rng.integers(0, 5, rows)},
                     rows_per_shard=128, num_classes=5)
    comm.barrier()
    return ShardedDataset(os.path.join(root, "train"), comm=comm)


def evaluations(comm, split, batches):
    """(batch, ours, one rank's) of every global batch size whose results differ; one
    rank's results are rank 0's, alone, sent to every rank."""
    from test_evaluation_mpi import model_and_objective

    model, objective = model_and_objective("classification")
    sdp = ShardedDataParallel(model, comm, stage=3)
    bad = []
    try:
        for batch in batches:
            loader = evaluation_loader(split, comm, numpy, prefetch=0,
                                       features=objective.features, global_batch=batch)
            ours = evaluate(objective, model, loader, comm)  # a hang: the test's timeout
            one = None
            if comm.rank == 0:
                alone = SingleCommunicator()
                result = evaluate(objective, model_and_objective("classification")[0],
                                  evaluation_loader(ShardedDataset(split.path), alone, numpy,
                                                    prefetch=0, features=objective.features,
                                                    global_batch=batch), alone)
                one = (result.scores.samples, result.scores.confusion, result.record)
            samples, confusion, record = comm.bcast_obj(one)
            if not (ours.scores.samples == samples
                    and numpy.array_equal(ours.scores.confusion, confusion)
                    and numpy.isclose(ours.record["test_loss"], record["test_loss"],
                                      rtol=1e-12)):
                bad.append((batch, ours.record, record))
    finally:
        sdp.close()
    return bad


def test_evaluation_with_every_number_of_empty_shares_equals_one_rank_under_zero_3(
        comm, shared_dir):
    rows, sizes = batches(comm.size)
    bad = evaluations(comm, write_split(comm, os.path.join(shared_dir, "every"), rows), sizes)
    # 513 rows in batches of 512: what hung `mpidl train --zero=3 --data.num-test=513`
    bad += evaluations(comm, write_split(comm, os.path.join(shared_dir, "513"), 513), [512])
    assert_all_ranks(comm, not bad, f"evaluation differs from one rank at (batch, ours, "
                                    f"one rank's): {bad[:2]}")


def test_a_tensor_x_sequence_x_data_grid_trains_like_one_rank(comm, monkeypatch):
    import test_model_parallel

    layout = "tensor-x-ring-x-data"
    monkeypatch.setitem(test_model_parallel.LAYOUTS, layout,
                        lambda n: (2, 2, {"attention": "ring"}))  # data = n / 4
    test_model_parallel.check_exact(comm, layout)


def test_a_checkpoint_of_every_rank_resumes_on_three_and_on_one(comm, shared_dir):
    from test_sharded_checkpoint import build, reference, save_at

    from mpidl.testing.models import full_parameters

    path = save_at(comm, os.path.join(shared_dir, "ckpt"), layout=3)  # ZeRO-3, every rank
    expected, _ = reference(comm, 2)
    few = comm.split(0 if comm.rank < 3 else 1)
    bad = []
    for group, layout in ((few, 2), (SingleCommunicator(), 1)):
        if (group is few and comm.rank >= 3) or (group is not few and comm.rank != 0):
            continue
        try:  # an error on these ranks alone must not leave the others waiting
            model, wrapper, opt = build(group, layout, seed=9)  # other weights: overwritten
            checkpointer = choose_checkpointer(group, None, wrapper, model, opt)
            checkpointer.load(ckpt.load_checkpoint(path, "none"))
            got = full_parameters(wrapper)
            wrapper.close()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            bad.append((group.size, f"{type(e).__name__}: {e}"))
            continue
        bad += [(group.size, name) for name, q in expected.named_parameters()
                if not numpy.allclose(got[name], q.data, rtol=1e-12, atol=1e-14)]
    few.free()
    assert_all_ranks(comm, not bad, f"(ranks, parameter) that differ from one rank's: {bad}")
