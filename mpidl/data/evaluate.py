"""Exact distributed evaluation: integer counts summed over ranks.

With the exact sampler every test sample is evaluated once on exactly one rank, so the
accuracy over all ranks is ``sum(correct) / sum(total)`` — not the mean of per-rank
accuracies, which is wrong when ranks hold different numbers of samples (and PyTorch's
padded sampler counts some samples twice). Counts are int64, so they are exact at any
dataset size::

    acc = ExactAccuracy()
    for x, y, _ in test_loader:
        acc.update(model(x).data, y)
    correct, total = acc.counts(comm)     # collective
    accuracy = acc.compute(comm)          # collective; correct / total
"""

from __future__ import annotations

from typing import Any

import numpy

from mpidl.backend import _unwrap, as_numpy, get_array_module


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
        pred = scores_or_predictions
        pred = _unwrap(pred)  # a Tensor's array; an array (NumPy or CuPy) as it is
        if pred.ndim == 2:
            pred = pred.argmax(axis=1)
        if pred.shape[0] != target.shape[0]:
            raise ValueError(f"{pred.shape[0]} predictions for {target.shape[0]} targets")
        self._correct = self._correct + xp.count_nonzero(pred == target)
        self._total += int(target.shape[0])

    def counts(self, comm: Any = None) -> tuple[int, int]:
        """``(correct, total)`` over all ranks. Collective when ``comm`` is given."""
        return evaluate_counts(comm, int(as_numpy(self._correct)), self._total)

    def compute(self, comm: Any = None) -> float:
        """Accuracy over all ranks (``nan`` for no samples). Collective when ``comm`` is given."""
        correct, total = self.counts(comm)
        return correct / total if total else float("nan")
