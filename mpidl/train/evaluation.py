"""Exact evaluation of a classifier over a whole split, on every rank.

The one evaluation of mpidl: the trainer's eval records (``metrics.jsonl``) and ``mpidl
eval`` both come from :func:`evaluate_model`, so they agree to the last count. Every
test sample is scored once on one rank (the exact sampler, no padding duplicates); the
per-class counts (:class:`~mpidl.data.evaluate.ClassCounts`) and the loss sum stay on
the device until the end and are summed over the ranks once, so the scores are the same
at any number of ranks::

    loader = evaluation_loader(test_set, comm, xp)
    scores = evaluate_model(model, loader, comm)       # collective
    scores.accuracy, scores.macro_f1, scores.confusion, scores.as_record()
"""
from __future__ import annotations

from typing import Any

from mpidl import functions as F
from mpidl.autograd import no_grad
from mpidl.data.evaluate import ClassCounts, Scores


def evaluation_loader(dataset: Any, comm: Any, xp: Any, prefetch: int = 2,
                      features: tuple[str, ...] = ("x", "y")) -> Any:
    """A loader of ``features`` of every sample of ``dataset`` once, in order, in global
    batches of :data:`~mpidl.train.trainer.EVAL_BATCH` split over the ranks of ``comm``."""
    from mpidl.data import DataLoader, DistributedSampler
    from mpidl.train.trainer import EVAL_BATCH

    sampler = DistributedSampler(len(dataset), EVAL_BATCH, comm.rank, comm.size, seed=0,
                                 shuffle="none")
    return DataLoader(dataset, sampler, features, xp=xp, prefetch=prefetch)


def output_width(model: Any, feature: Any, xp: Any) -> int:
    """The number of scores ``model`` gives a sample of ``feature`` (an
    :class:`~mpidl.data.format.Feature`): its output for a batch of no samples, the same
    on every rank without communication."""
    with no_grad():
        return int(model(xp.zeros((0, *feature.shape), dtype=feature.dtype)).shape[-1])


def evaluate_model(model: Any, loader: Any, comm: Any) -> Scores:
    """Scores of ``model`` over every sample of ``loader``'s split: loss, accuracy, recall,
    macro-F1, majority-class accuracy, confusion matrix (:class:`~mpidl.data.evaluate.Scores`).

    Collective: every rank calls it with its own loader of the same split (the same
    sampler settings), e.g. from :func:`evaluation_loader`. The model is put in
    evaluation mode (no dropout) for the pass and returned to the mode it was in.

    Args:
        model: a classifier: ``(B, ...)`` inputs ``x`` to ``(B, classes)`` logits.
        loader: yields ``(x, y, global_count)`` batches; ``loader.dataset`` is the split.
        comm: the communicator whose ranks share the split.
    """
    dataset, xp = loader.dataset, loader.xp
    was_training = getattr(model, "training", True)
    model.eval()  # before the probe too: batch norm in training mode needs samples
    # Counted over the model's outputs and the dataset's classes alike: a model with more
    # outputs than the dataset has classes (or fewer) still has every count in range.
    classes = max(output_width(model, dataset.features["x"], xp), dataset.num_classes or 0)
    counts = ClassCounts(classes, xp)
    loss_sum: Any = 0.0
    loader.set_epoch(0)
    try:
        with no_grad():
            for x, y, _ in loader:
                if len(y) == 0:
                    continue
                logits = model(x)
                loss = F.softmax_cross_entropy(logits, y, reduction="sum").data
                loss_sum = loss_sum + loss.astype(xp.float64)  # float32 sums drift over batches
                counts.update(logits.data, y)
    finally:
        model.train(was_training)
    return counts.scores(comm, loss_sum)
