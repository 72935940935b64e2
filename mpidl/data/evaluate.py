"""Exact distributed evaluation: integer counts summed over ranks, and the scores they give.

With the exact sampler every test sample is evaluated once on exactly one rank, so a
score over all ranks comes from counts summed over them: accuracy is
``sum(correct) / sum(total)``, not the mean of per-rank accuracies, which is wrong when
ranks hold different numbers of samples (and PyTorch's padded sampler counts some
samples twice). Counts are int64, so they are exact at any dataset size::

    counts = ClassCounts(num_classes)
    for x, y, _ in test_loader:
        counts.update(model(x).data, y)
    scores = counts.scores(comm, loss_sum)    # collective: the counts summed over ranks
    scores.accuracy, scores.recall, scores.macro_f1, scores.majority_accuracy

    acc = ExactAccuracy()                     # accuracy alone, for any number of classes
    acc.update(model(x).data, y)
    accuracy = acc.compute(comm)              # collective; correct / total

The rules, each owned by one function here:

- the predicted class is the argmax of the scores, the first of equal maxima
  (:func:`predicted_classes`);
- a share (accuracy, recall) of no samples is undefined: NaN, ``null`` in a record
  (:func:`share`);
- recall of class ``c``: samples of ``c`` predicted ``c`` / samples of ``c``;
- F1 of class ``c``: ``2 TP / (2 TP + FP + FN)``, the harmonic mean of precision and
  recall, and 0 for a class that has samples but is never predicted (precision's 0/0
  counts as 0, as scikit-learn's ``zero_division=0``); macro-F1 is the mean over the
  classes that occur among the labels or the predictions (scikit-learn's default label
  set): a class the test split lacks and the model never predicts has no F1;
- majority-class accuracy: the accuracy of always answering the most frequent true
  class, i.e. its share of the samples; the floor a classifier has to beat (0.5 on a
  balanced binary split, 0.9 when 90% of the samples are of one class).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy

from mpidl.backend import _unwrap, as_numpy, get_array_module

# Above this many classes the (K, K) confusion matrix is not kept: 1024 classes are
# 8 MiB of int64 counts, summed over the ranks once per evaluation; ImageNet-21k's
# matrix would be 3.8 GB. Recall, F1 and the majority class need only the three
# per-class count vectors, which are always kept.
MAX_CONFUSION_CLASSES = 1024


def predicted_classes(scores_or_predictions: Any) -> Any:
    """Class ids from ``(n, classes)`` scores (argmax; the first of equal maxima wins), or
    ``(n,)`` class ids as they are. A Tensor's array is used; NumPy or CuPy stays as it is."""
    pred = _unwrap(scores_or_predictions)
    return pred.argmax(axis=1) if pred.ndim == 2 else pred


def share(part: float, whole: float) -> float:
    """``part / whole``, or NaN for a share of nothing (``whole == 0``)."""
    return part / whole if whole else float("nan")


def evaluate_counts(comm: Any, correct: int, total: int) -> tuple[int, int]:
    """Sum ``(correct, total)`` over the ranks of ``comm`` (``None``: this process only).

    Collective: every rank calls it once, in the same order.
    """
    counts = numpy.array([int(correct), int(total)], dtype=numpy.int64)
    if comm is not None:
        comm.allreduce_(counts, op="sum")
    return int(counts[0]), int(counts[1])


class ExactAccuracy:
    """Counts correct predictions on this rank; ``counts``/``compute`` sum over ranks.

    The per-batch counts stay on the device (no host synchronisation per batch with CuPy).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._correct: Any = 0
        self._total = 0

    def update(self, scores_or_predictions: Any, target: Any) -> None:
        """Add a batch: ``(n, classes)`` scores (argmax is taken) or ``(n,)`` class ids."""
        xp = get_array_module(scores_or_predictions, target)
        pred = predicted_classes(scores_or_predictions)
        if pred.shape[0] != target.shape[0]:
            raise ValueError(f"{pred.shape[0]} predictions for {target.shape[0]} targets")
        self._correct = self._correct + xp.count_nonzero(pred == target)
        self._total += int(target.shape[0])

    def counts(self, comm: Any = None) -> tuple[int, int]:
        """``(correct, total)`` over all ranks. Collective when ``comm`` is given."""
        return evaluate_counts(comm, int(as_numpy(self._correct)), self._total)

    def compute(self, comm: Any = None) -> float:
        """Accuracy over all ranks (``nan`` for no samples). Collective when ``comm`` is given."""
        return share(*self.counts(comm))


def _defined(value: float) -> float | None:
    # Records are strict JSON, which has no NaN: an undefined score is null.
    return float(value) if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class Scores:
    """Classification scores over a whole split, derived from exact integer counts.

    Attributes:
        true_counts: ``(K,)`` int64, the samples of each true class (the support).
        predicted_counts: ``(K,)`` int64, the samples predicted as each class.
        correct_counts: ``(K,)`` int64, the samples of each class predicted as it.
        confusion: ``(K, K)`` int64, rows the true class, columns the predicted one;
            None above :data:`MAX_CONFUSION_CLASSES` classes.
        loss_sum: the summed loss of every sample (NaN when not measured).
    """

    true_counts: numpy.ndarray
    predicted_counts: numpy.ndarray
    correct_counts: numpy.ndarray
    confusion: numpy.ndarray | None = None
    loss_sum: float = float("nan")

    @property
    def num_classes(self) -> int:
        return int(self.true_counts.shape[0])

    @property
    def samples(self) -> int:
        return int(self.true_counts.sum())

    @property
    def correct(self) -> int:
        return int(self.correct_counts.sum())

    @property
    def accuracy(self) -> float:
        return share(self.correct, self.samples)

    @property
    def loss(self) -> float:
        """The mean loss per sample."""
        return share(self.loss_sum, self.samples)

    @property
    def recall(self) -> numpy.ndarray:
        """``(K,)`` recall per class; NaN for a class with no samples."""
        support = self.true_counts
        return numpy.where(support > 0, self.correct_counts / numpy.maximum(support, 1),
                           numpy.nan)

    @property
    def f1(self) -> numpy.ndarray:
        """``(K,)`` F1 per class, ``2 TP / (2 TP + FP + FN)``; NaN for a class that neither
        occurs nor is predicted."""
        tp = self.correct_counts
        # 2 TP + FP + FN = (TP + FN) + (TP + FP): samples of c plus predictions of c.
        denominator = self.true_counts + self.predicted_counts
        return numpy.where(denominator > 0, 2 * tp / numpy.maximum(denominator, 1), numpy.nan)

    @property
    def macro_f1(self) -> float:
        """The mean F1 over the classes present among the labels or the predictions."""
        f1 = self.f1
        defined = f1[~numpy.isnan(f1)]
        return float(defined.mean()) if defined.size else float("nan")

    @property
    def majority_class(self) -> int | None:
        """The most frequent true class (the lowest id of equally frequent ones)."""
        return int(self.true_counts.argmax()) if self.samples else None

    @property
    def majority_accuracy(self) -> float:
        """The accuracy of always predicting :attr:`majority_class`."""
        return share(int(self.true_counts.max(initial=0)), self.samples)

    def as_record(self) -> dict[str, Any]:
        """The fields of an evaluation record (``metrics.jsonl``, ``mpidl eval --json``):
        ``test_loss``, ``test_accuracy``, ``majority_accuracy``, ``macro_f1`` and ``recall``
        (a list by class id); undefined values are None."""
        return {"test_loss": _defined(self.loss), "test_accuracy": _defined(self.accuracy),
                "majority_accuracy": _defined(self.majority_accuracy),
                "macro_f1": _defined(self.macro_f1),
                "recall": [_defined(r) for r in self.recall.tolist()]}


class ClassCounts:
    """Per-class counts of predictions on this rank; :meth:`scores` sums them over ranks.

    Args:
        num_classes: K; labels and predictions must lie in ``[0, K)``.
        xp: the array module of the batches (the counts stay on its device: no host
            synchronisation per batch with CuPy).
    """

    def __init__(self, num_classes: int, xp: Any = numpy) -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes {num_classes} must be >= 1")
        self.num_classes = int(num_classes)
        self.xp = xp
        self.reset()

    def reset(self) -> None:
        k, xp = self.num_classes, self.xp
        self._true = xp.zeros(k, dtype=xp.int64)
        self._predicted = xp.zeros(k, dtype=xp.int64)
        self._correct = xp.zeros(k, dtype=xp.int64)
        self._confusion = (xp.zeros((k, k), dtype=xp.int64)
                           if k <= MAX_CONFUSION_CLASSES else None)

    def _bincount(self, ids: Any, what: str) -> Any:
        counts = self.xp.bincount(ids, minlength=self.num_classes)
        if counts.shape[0] > self.num_classes:
            raise ValueError(f"a {what} of {counts.shape[0] - 1} is outside the "
                             f"{self.num_classes} classes [0, {self.num_classes})")
        return counts

    def update(self, scores_or_predictions: Any, target: Any) -> None:
        """Add a batch: ``(n, classes)`` scores (argmax is taken) or ``(n,)`` class ids,
        and the ``(n,)`` true class ids."""
        xp, k = self.xp, self.num_classes
        scores = _unwrap(scores_or_predictions)
        if scores.ndim == 2 and scores.shape[1] > k:
            raise ValueError(f"scores of {scores.shape[1]} classes, but the counts are of {k}: "
                             "count with ClassCounts(num_classes=the model's output width)")
        pred = predicted_classes(scores)
        if pred.shape != target.shape:
            raise ValueError(f"{pred.shape[0]} predictions for {target.shape[0]} targets")
        if not target.shape[0]:
            return
        true = target.astype(xp.int64, copy=False)
        pred = pred.astype(xp.int64, copy=False)
        self._true += self._bincount(true, "label")
        self._predicted += self._bincount(pred, "prediction")
        # A wrong prediction is counted in the extra bin k, then dropped.
        self._correct += xp.bincount(xp.where(pred == true, true, k), minlength=k + 1)[:k]
        if self._confusion is not None:
            self._confusion += xp.bincount(true * k + pred, minlength=k * k).reshape(k, k)

    def scores(self, comm: Any = None, loss_sum: Any = float("nan")) -> Scores:
        """The :class:`Scores` of every rank's samples together.

        Collective when ``comm`` is given: every rank calls it once, with counts of the
        same number of classes; one allreduce sums the int64 counts, one the loss sums.
        """
        k = self.num_classes
        parts = [self._true, self._predicted, self._correct]
        if self._confusion is not None:
            parts.append(self._confusion.reshape(-1))
        flat = numpy.concatenate([as_numpy(p) for p in parts]).astype(numpy.int64)
        loss = numpy.array([float(as_numpy(loss_sum))], dtype=numpy.float64)
        if comm is not None:
            comm.allreduce_(flat, op="sum")
            comm.allreduce_(loss, op="sum")
        confusion = flat[3 * k:].reshape(k, k) if self._confusion is not None else None
        return Scores(true_counts=flat[:k], predicted_counts=flat[k:2 * k],
                      correct_counts=flat[2 * k:3 * k], confusion=confusion,
                      loss_sum=float(loss[0]))
