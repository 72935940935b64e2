"""What every objective gives the trainer: the contract of :mod:`mpidl.train.objective`.

:class:`Objective` is the base of the objectives (classification, regression, language
models): the loss of a batch for the step, the global count of what the loss is
averaged over, one batch's :class:`BatchScores` for the one evaluation loop
(:func:`mpidl.train.evaluation.evaluate`), and the :class:`EvalSums` that add the
batches up and reduce them over the ranks to an :class:`Evaluation`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

from mpidl.data.evaluate import Scores


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Scores over a whole split, the same on every rank.

    Attributes:
        record: the eval record's fields (``metrics.jsonl``, ``mpidl eval --json``).
        line: the scores in words, for the log.
        scores: a classifier's counts and scores (the confusion matrix), else None.
    """

    record: dict[str, Any]
    line: str
    scores: Scores | None = None


class BatchScores(NamedTuple):
    """One rank's scores of its share of one evaluation batch (possibly of no rows)."""

    loss: Any          # the summed loss, an xp scalar
    outputs: Any = None  # the model's outputs, where the sums need them (B, ...)
    targets: Any = None  # the labels or targets they are counted against
    count: int = 0     # targets counted (a language model's real tokens)
    correct: Any = 0   # of them predicted right (a language model's next-token hits)


class EvalSums(Protocol):
    """One rank's running sums of an evaluation."""

    def add(self, batch: BatchScores) -> None:
        """Add one batch's scores (zero rows add nothing). Not collective."""

    def reduce(self, comm: Any) -> Evaluation:
        """The sums over every rank, and the scores they give. Collective."""


class Objective:
    """What every objective shares: the features it reads, whether its records carry an
    accuracy, how a window's sums (loss, correct, targets) add up over the ranks, and
    what evaluation asks of it (:meth:`score`, :meth:`eval_sums`)."""

    features: tuple[str, ...] = ("x", "y")
    accuracy = True  # train records carry one
    # The eval record's keys a run's summary ends with, and how it names them.
    final_scores: tuple[tuple[str, str], ...] = (("test_accuracy", "test accuracy"),)

    def targets(self, x: Any, y: Any) -> int:
        """The targets this rank's share ``x``, ``y`` counts, without a forward (what
        :meth:`step` returns as its count): before the first microbatch's backward the
        step needs the global count. Not collective."""
        return int(y.size)

    def global_count(self, comm: Any, samples: int, local: int) -> int:
        """Targets in the global batch: the sampler's sample count."""
        return samples

    def sum_totals(self, comm: Any, totals: Any) -> None:
        """Sum ``[loss, correct, targets]`` (float64, in place) over the ranks. Collective."""
        comm.allreduce_(totals)

    def extra(self, loss: float) -> dict[str, Any]:
        """Fields a train record adds for a mean loss ``loss``."""
        return {}

    def score(self, model: Any, x: Any, y: Any, xp: Any) -> BatchScores:
        """Score one evaluation batch: ``model`` (in evaluation mode, no gradients kept) on
        inputs ``x`` against ``y`` (None for a language model). ``x`` may have no rows;
        the model runs anyway (its forward may be collective). Collective as the model."""
        raise NotImplementedError

    def eval_sums(self, model: Any, dataset: Any, xp: Any) -> EvalSums:
        """Zeroed sums of an evaluation of ``model`` (in evaluation mode) over the split
        ``dataset``. Collective as the model (a classifier's width is probed with it)."""
        raise NotImplementedError


__all__ = ["Evaluation", "BatchScores", "EvalSums", "Objective"]
