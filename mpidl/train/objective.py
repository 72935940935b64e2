"""What a run optimises: classify samples, or predict each next token (a language model).

The trainer's step and evaluation ask the run's objective, chosen from the task:

- :class:`Classification` (every task but ``gpt``): logits ``(B, classes)`` of inputs
  ``x`` against labels ``y``; the loss is summed over samples and averaged over the
  global batch (the sampler's count); evaluation is the exact per-class count of
  :func:`mpidl.train.evaluation.evaluate_model`.
- :class:`LanguageModel` (task ``gpt``): the model reads ``x[:, :-1]`` and predicts
  ``x[:, 1:]``; padded targets count nothing, so the global count of real targets takes
  one small allreduce per step (the mean is over every rank's real tokens, exactly);
  records add the perplexity ``exp(loss)``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy

from mpidl import functions as F


class Classification:
    """Softmax cross-entropy of ``model(x)`` against integer labels ``y``."""

    features = ("x", "y")

    def inputs(self, x: Any) -> Any:
        return x

    def loss(self, logits: Any, x: Any, y: Any, xp: Any) -> tuple[Any, int, Any]:
        """This rank's summed loss, the number of targets in it, and the correct count."""
        loss = F.softmax_cross_entropy(logits, y, reduction="sum")
        correct = xp.count_nonzero(logits.data.argmax(-1) == y) if len(y) else 0
        return loss, len(y), correct

    def global_count(self, comm: Any, samples: int, local: int) -> int:
        """Targets in the global batch: the sampler's sample count."""
        return samples

    def evaluate(self, model: Any, loader: Any, comm: Any) -> dict[str, Any]:
        """The eval record's fields and a line saying them. Collective."""
        from mpidl.train.evaluation import evaluate_model

        scores = evaluate_model(model, loader, comm)
        record = scores.as_record()
        line = (f"test loss {scores.loss:.4f}, test accuracy {scores.accuracy:.4f}, macro-F1 "
                f"{scores.macro_f1:.4f} (always guessing the majority class: "
                f"{scores.majority_accuracy:.4f})")
        return {"record": record, "line": line, "scores": scores}

    def extra(self, loss: float) -> dict[str, Any]:
        return {}


class LanguageModel:
    """Next-token cross-entropy; ``pad_id`` targets (padding) count nothing."""

    features = ("x",)

    def __init__(self, pad_id: int | None) -> None:
        self.pad_id = pad_id

    def inputs(self, x: Any) -> Any:
        return x[:, :-1]

    def _targets(self, x: Any) -> Any:
        return x[:, 1:]

    def loss(self, logits: Any, x: Any, y: Any, xp: Any) -> tuple[Any, int, Any]:
        targets = self._targets(x)
        loss = F.softmax_cross_entropy(logits, targets, ignore_index=self.pad_id,
                                       reduction="sum")
        if self.pad_id is None:
            real = xp.ones(targets.shape, dtype=bool)
        else:
            real = targets != self.pad_id
        correct = xp.count_nonzero((logits.data.argmax(-1) == targets) & real)
        return loss, int(xp.count_nonzero(real)), correct

    def global_count(self, comm: Any, samples: int, local: int) -> int:
        """Real targets over every rank (one 8-byte allreduce)."""
        counts = numpy.array([local], dtype=numpy.int64)
        comm.allreduce_(counts)
        return max(int(counts[0]), 1)

    def evaluate(self, model: Any, loader: Any, comm: Any) -> dict[str, Any]:
        """Loss per real target, next-token accuracy and perplexity over the test split,
        exact over the ranks (sums, then one allreduce). Collective."""
        from mpidl.autograd import no_grad

        totals = numpy.zeros(3)  # loss sum, correct, targets
        model.eval()
        loader.set_epoch(0)
        with no_grad():
            for batch in loader:
                x = batch[0]
                if len(x) == 0:
                    continue
                xp = _xp(x)
                loss, count, correct = self.loss(model(self.inputs(x)), x, None, xp)
                totals += [float(loss.data), float(correct), count]
        model.train()
        comm.allreduce_(totals)
        n = max(totals[2], 1)
        loss = totals[0] / n
        record = {"test_loss": loss, "test_accuracy": totals[1] / n,
                  "test_perplexity": _perplexity(loss), "test_targets": int(totals[2])}
        line = (f"test loss {loss:.4f}, perplexity {_perplexity(loss):.3f}, next-token "
                f"accuracy {totals[1] / n:.4f}")
        return {"record": record, "line": line, "scores": None}

    def extra(self, loss: float) -> dict[str, Any]:
        return {"perplexity": _perplexity(loss)}


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # exp overflows float64 past ~709


def _xp(x: Any) -> Any:
    from mpidl.backend import get_array_module

    return get_array_module(x)


def objective_for(config: Any, dataset: Any) -> Any:
    """The objective of ``config.task`` (the dataset gives the padding id)."""
    if config.task == "gpt":
        return LanguageModel(getattr(dataset, "pad_id", None))
    return Classification()
