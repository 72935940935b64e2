"""The evaluation of a model on real ranks equals the evaluation in one process: the same
confusion matrix to the count, the same loss up to summation order; and a rank whose
share of a batch is empty still runs the model, whose forward is collective under ZeRO-3
(it hung there before: the other ranks waited in the gather). Run at 1, 2 and 3 ranks::

    mpiexec -n 3 python -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_evaluation_mpi.py
"""
from __future__ import annotations

import os

import numpy
import pytest

from mpidl import functions as F
from mpidl.comm.single import SingleCommunicator
from mpidl.data import ShardedDataset, write_shards
from mpidl.models import gpt, mlp
from mpidl.parallel import ProcessGrid, ShardedDataParallel, parallel_gpt
from mpidl.testing import assert_all_ranks
from mpidl.testing.collective import assert_allclose_all_ranks
from mpidl.train.evaluation import evaluate, evaluate_model, evaluation_loader
from mpidl.train.objective import (Classification, LanguageModel, ParallelLanguageModel,
                                   Regression)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

N, CLASSES = 1201, 5  # not a multiple of the global batch, nor of 2 or 3 ranks


def write_split(comm, root, n):
    """Rank 0 writes n rows of 3 features with labels in 5 classes, in shards of 300 rows;
    every rank opens the split."""
    if comm.rank == 0:
        rng = numpy.random.default_rng(5)
        x = rng.normal(size=(n, 3)).astype(numpy.float32)
        y = (numpy.abs(x).argmax(axis=1) + (x.sum(axis=1) > 0) * 2) % CLASSES
        write_shards(os.path.join(root, "d"), {"x": x, "y": y}, rows_per_shard=300,
                     num_classes=CLASSES)
    comm.barrier()
    return ShardedDataset(os.path.join(root, "d", "train"), comm=comm)


def test_the_confusion_matrix_is_the_same_at_any_number_of_ranks(comm, shared_dir):
    test_split = write_split(comm, shared_dir, N)
    model = mlp(sizes=(3, 8, CLASSES), seed=1)
    # five global batches, the last uneven
    loader = evaluation_loader(test_split, comm, numpy, global_batch=256)
    scores = evaluate_model(model, loader, comm)

    # One process, one batch of every row: the confusion matrix counted here directly.
    x = test_split.read("x", numpy.arange(N))
    y = test_split.read("y", numpy.arange(N))
    model.eval()
    logits = model(x)
    expected = numpy.zeros((CLASSES, CLASSES), numpy.int64)
    numpy.add.at(expected, (y, logits.data.argmax(axis=1)), 1)
    loss = float(F.softmax_cross_entropy(logits, y, reduction="sum").data)

    assert_all_ranks(comm, numpy.array_equal(scores.confusion, expected),
                     f"confusion {scores.confusion.tolist()} != {expected.tolist()}")
    # An informative comparison: the (untrained) model predicts several classes.
    assert_all_ranks(comm, scores.samples == N and (expected.sum(axis=0) > 0).sum() >= 3,
                     f"{scores.samples} samples, predictions {expected.sum(axis=0)}")
    assert_allclose_all_ranks(comm, numpy.float32(scores.loss_sum), numpy.float32(loss),
                              scale=10, what="loss sum")


def test_ranks_without_samples_take_part_and_agree(comm, shared_dir):
    # Two samples: at 3 ranks one rank's batch is always empty.
    loader = evaluation_loader(write_split(comm, shared_dir, 2), comm, numpy)
    scores = evaluate_model(mlp(sizes=(3, 8, CLASSES), seed=1), loader, comm)
    everyone = comm.allgather_obj(scores.confusion.tolist())
    assert_all_ranks(comm, scores.samples == 2 and all(c == everyone[0] for c in everyone),
                     f"{scores.samples} samples; confusion by rank {everyone}")


# Global batches of 4 over 5 samples: the last holds one, so at 2 and 3 ranks every rank
# but rank 0 has an empty share of it; a split of 1 sample leaves them empty throughout.
SMALL_BATCH = 4


def write_kind(comm, root, kind, n):
    """Rank 0 writes n rows for ``kind``: features and labels (classification), features
    and two float targets (regression), or 9 token ids (gpt); every rank opens them."""
    if comm.rank == 0:
        rng = numpy.random.default_rng(7)
        x = rng.normal(size=(n, 3))
        arrays = {"classification": {"x": x, "y": rng.integers(0, CLASSES, size=n)},
                  "regression": {"x": x, "y": rng.normal(size=(n, 2))},
                  "gpt": {"x": rng.integers(0, 23, size=(n, 9))}}[kind]
        write_shards(os.path.join(root, kind), arrays, rows_per_shard=3,
                     num_classes=CLASSES if kind == "classification" else None)
    comm.barrier()
    return ShardedDataset(os.path.join(root, kind, "train"), comm=comm)


def model_and_objective(kind):
    if kind == "gpt":  # no parameter count divides 2 or 3 ranks evenly
        return (gpt(vocab=23, seq_len=8, dim=6, layers=2, heads=2, seed=3, dtype="float64"),
                LanguageModel(pad_id=None))
    outputs = CLASSES if kind == "classification" else 2
    objective = Classification() if kind == "classification" else Regression(outputs=2)
    return mlp(sizes=(3, 7, outputs), seed=4, dtype="float64"), objective


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("kind", ["classification", "regression", "gpt"])
def test_zero_3_evaluation_with_an_empty_share_completes_and_equals_one_rank(
        comm, shared_dir, kind, n):
    split = write_kind(comm, shared_dir, kind, n)
    model, objective = model_and_objective(kind)
    sdp = ShardedDataParallel(model, comm, stage=3)
    loader = evaluation_loader(split, comm, numpy, prefetch=0, features=objective.features,
                               global_batch=SMALL_BATCH)
    result = evaluate(objective, model, loader, comm)  # hung at 2-3 ranks before the fix
    sdp.close()

    # The same model whole, in this process alone: the scores of one rank.
    alone = SingleCommunicator()
    reference, _ = model_and_objective(kind)
    one = evaluate(objective, reference, evaluation_loader(
        ShardedDataset(split.path), alone, numpy, prefetch=0, features=objective.features,
        global_batch=SMALL_BATCH), alone)

    assert_all_ranks(comm, sorted(result.record) == sorted(one.record),
                     f"fields {sorted(result.record)} != {sorted(one.record)}")
    for key, expected in one.record.items():
        got = result.record[key]
        if expected is None or got is None:
            assert_all_ranks(comm, got is None and expected is None, f"{key}: {got} != {expected}")
        else:
            assert_allclose_all_ranks(comm, numpy.asarray(got, numpy.float64),
                                      numpy.asarray(expected, numpy.float64), scale=10,
                                      what=key)
    if kind == "classification":
        assert_all_ranks(comm, result.scores.samples == n and numpy.array_equal(
            result.scores.confusion, one.scores.confusion),
            f"{result.scores.samples} samples, confusion {result.scores.confusion.tolist()} "
            f"!= {one.scores.confusion.tolist()}")
    assert_all_ranks(comm, model.training, "the model is back in training mode")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("axis", ["tensor", "sequence"])
def test_a_split_gpt_scores_a_batch_of_no_rows_as_nothing(comm, axis):
    grid = ProcessGrid(comm, **{axis: comm.size})
    # A head and at least a token per rank, at any size (the many-rank tier runs 16).
    model = parallel_gpt(grid, vocab=max(23, comm.size), seq_len=max(8, comm.size),
                         dim=2 * comm.size, layers=1, heads=comm.size, seed=3, dtype="float64")
    objective = ParallelLanguageModel(None, grid)
    model.eval()
    scores = objective.score(model, numpy.zeros((0, 9), numpy.int64), None, numpy)
    assert_all_ranks(comm, float(scores.loss) == 0 and scores.count == 0
                     and float(scores.correct) == 0, f"scores of no rows: {scores}")


def test_regression_scores_are_numpy_s_over_every_row_at_any_number_of_ranks(comm, shared_dir):
    # 1201 rows in global batches of 256: the last uneven, and no rank count divides them.
    if comm.rank == 0:
        rng = numpy.random.default_rng(11)
        x = rng.normal(size=(N, 3))
        y = numpy.stack([x[:, 0] * 2.0, rng.normal(size=N) * 3.0], axis=1)
        write_shards(os.path.join(shared_dir, "r"), {"x": x, "y": y}, rows_per_shard=300)
    comm.barrier()
    split = ShardedDataset(os.path.join(shared_dir, "r", "train"), comm=comm)
    model = mlp(sizes=(3, 7, 2), seed=4, dtype="float64")
    loader = evaluation_loader(split, comm, numpy, global_batch=256)
    record = evaluate(Regression(outputs=2), model, loader, comm).record

    # One process, every row at once, the scores by their definitions.
    x, y = split.read("x", numpy.arange(N)), split.read("y", numpy.arange(N))
    model.eval()
    e = model(x).data - y
    mse, mae = (e ** 2).mean(axis=0), numpy.abs(e).mean(axis=0)
    r2 = 1 - mse / y.var(axis=0)
    for key, want in [("test_mse_per_output", mse), ("test_mae_per_output", mae),
                      ("test_r2_per_output", r2), ("test_mse", mse.mean()),
                      ("test_mae", mae.mean()), ("test_r2", r2.mean())]:
        assert_allclose_all_ranks(comm, numpy.asarray(record[key]), want, scale=100, what=key)
    # An informative comparison: the signed errors nearly cancel, the absolute ones do not.
    assert_all_ranks(comm, (abs(e.mean(axis=0)) < 0.5 * mae).all(),
                     f"mean errors {e.mean(axis=0)} against MAE {mae}")
