"""The evaluation of a model on real ranks equals the evaluation in one process: the same
confusion matrix to the count, the same loss up to summation order. Run at 1, 2 and 3
ranks::

    mpiexec -n 3 python -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_evaluation_mpi.py
"""
from __future__ import annotations

import os

import numpy
import pytest

from mpidl import functions as F
from mpidl.data import ShardedDataset, write_shards
from mpidl.models import mlp
from mpidl.testing import assert_all_ranks
from mpidl.testing.collective import assert_allclose_all_ranks
from mpidl.train import trainer
from mpidl.train.evaluation import evaluate_model, evaluation_loader

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


def test_the_confusion_matrix_is_the_same_at_any_number_of_ranks(comm, shared_dir,
                                                                 monkeypatch):
    monkeypatch.setattr(trainer, "EVAL_BATCH", 256)  # five global batches, the last uneven
    test_split = write_split(comm, shared_dir, N)
    model = mlp(sizes=(3, 8, CLASSES), seed=1)
    scores = evaluate_model(model, evaluation_loader(test_split, comm, numpy), comm)

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
