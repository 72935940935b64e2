"""The one evaluation loop of mpidl: exact scores of a model over a whole split.

The trainer's eval records (``metrics.jsonl``) and ``mpidl eval`` both come from
:func:`evaluate`, so they agree to the last count. It owns what every objective shares:
the eval batch (:data:`EVAL_BATCH` samples over all ranks), each rank's share of it (the
exact sampler: every test sample scored once, on one rank, no padding duplicates), the
rule for an empty share, and the sums. The objective
(:mod:`mpidl.train.objective`) scores one batch and says what its sums reduce to::

    loader = evaluation_loader(test_set, comm, xp, features=objective.features)
    result = evaluate(objective, model, loader, comm)     # collective
    result.record, result.line, result.scores             # scores: a classifier's

An empty share is scored like any other: a rank whose share of the last batch has no
samples still runs the model on its zero rows, because the forward is collective in
some layouts (ZeRO-3 gathers each unit's parameters from every rank, tensor parallel
reduces over its group); skipping it left the other ranks waiting in that collective
for ever. Zero rows add nothing to the sums, so the scores are the same at any number
of ranks.
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.autograd import no_grad
from mpidl.data import DataLoader, DistributedSampler
from mpidl.data.evaluate import Scores
from mpidl.train.objective import Classification, Evaluation, Objective

EVAL_BATCH = 512  # samples per evaluation step over all ranks (no gradients kept)


def evaluation_loader(dataset: Any, comm: Any, xp: Any, prefetch: int = 2,
                      features: tuple[str, ...] = ("x", "y"),
                      global_batch: int = EVAL_BATCH) -> DataLoader:
    """A loader of ``features`` of every sample of ``dataset`` once, in order, in global
    batches of ``global_batch`` samples split over the ranks of ``comm``."""
    sampler = DistributedSampler(len(dataset), global_batch, comm.rank, comm.size, seed=0,
                                 shuffle="none")
    return DataLoader(dataset, sampler, features, xp=xp, prefetch=prefetch)


def evaluate(objective: Objective, model: Any, loader: DataLoader, comm: Any) -> Evaluation:
    """The scores of ``model`` over every sample of ``loader``'s split, as ``objective``
    counts them: the eval record's fields, a line saying them, and for a classifier the
    :class:`~mpidl.data.evaluate.Scores` (confusion matrix and all).

    Collective: every rank calls it with its own loader of the same split (the same
    sampler settings, e.g. from :func:`evaluation_loader`), and runs the model on every
    batch, its share empty or not. The model is put in evaluation mode (no dropout,
    batch norm's running statistics) for the pass and returned to the mode it was in.

    Args:
        objective: scores a batch and reduces the sums (:mod:`mpidl.train.objective`).
        model: the model itself (not a data-parallel wrapper): under ZeRO-3 its hooks
            gather the parameters, under a process grid it is the split model.
        loader: yields this rank's share of each batch: ``(x, y, global_count)``, or
            ``(x, global_count)`` for a language model; ``loader.dataset`` is the split.
        comm: the ranks that share the split, over which the sums are reduced.
    """
    xp = loader.xp
    labelled = len(loader.features) > 1  # a language model reads x alone
    was_training = model.training
    model.eval()  # before the sums: a classifier's probe of its width runs the model
    loader.set_epoch(0)
    try:
        # A diverged model's overflow shows once, in its record (a null loss), not as a
        # NumPy RuntimeWarning per batch (CuPy warns of none).
        with no_grad(), numpy.errstate(over="ignore", invalid="ignore", divide="ignore"):
            sums = objective.eval_sums(model, loader.dataset, xp)
            for batch in loader:
                x, y = batch[0], batch[1] if labelled else None
                sums.add(objective.score(model, x, y, xp))  # zero rows too (see above)
    finally:
        model.train(was_training)
    return sums.reduce(comm)


def evaluate_model(model: Any, loader: DataLoader, comm: Any) -> Scores:
    """A classifier's :class:`~mpidl.data.evaluate.Scores` over ``loader``'s split: loss,
    accuracy, recall, macro-F1, majority-class accuracy, confusion matrix. Collective, as
    :func:`evaluate` (``model``: ``(B, ...)`` inputs to ``(B, classes)`` logits)."""
    scores = evaluate(Classification(), model, loader, comm).scores
    assert scores is not None  # Classification always gives them
    return scores
