"""What a run optimises: classify samples, or predict each next token (a language model).

The trainer's step and evaluation ask the run's objective, chosen from the task:

- :class:`Classification` (every task but ``gpt``): logits ``(B, classes)`` of inputs
  ``x`` against labels ``y``; the loss is summed over samples and averaged over the
  global batch (the sampler's count); evaluation is the exact per-class count of
  :func:`mpidl.train.evaluation.evaluate_model`.
- :class:`Regression` (a dataset whose ``y`` is floating point, scalar or a vector per
  sample): squared error (or Huber), in standard units (each output's error divided by
  its standard deviation over the train split), summed over samples and outputs and
  averaged over the global batch's values; evaluation gives MSE, MAE and R² per output
  in the data's units, exact over the ranks (per-output sums, one allreduce).

  Why standard units: in the data's units each output's share of the loss grows with
  the square of its scale, so a target of spread 1,000 beside one of spread 1 leaves
  the small one unlearned (measured, 2 targets from 4 features, 10 epochs: R² 0.28 and
  0.995 in the data's units, both high standardised), and Huber's threshold of 1 means
  one standard deviation whatever the units. The loss is then about 1 for predicting
  the mean, 0 for an exact fit.
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


class Objective:
    """What every objective shares: the features it reads, whether its records carry an
    accuracy, and how a window's sums (loss, correct, targets) add up over the ranks."""

    features: tuple[str, ...] = ("x", "y")
    accuracy = True  # train records carry one
    # The eval record's keys a run's summary ends with, and how it names them.
    final_scores: tuple[tuple[str, str], ...] = (("test_accuracy", "test accuracy"),)

    def global_count(self, comm: Any, samples: int, local: int) -> int:
        """Targets in the global batch: the sampler's sample count."""
        return samples

    def sum_totals(self, comm: Any, totals: Any) -> None:
        """Sum ``[loss, correct, targets]`` (float64, in place) over the ranks. Collective."""
        comm.allreduce_(totals)

    def extra(self, loss: float) -> dict[str, Any]:
        """Fields a train record adds for a mean loss ``loss``."""
        return {}


class Classification(Objective):
    """Softmax cross-entropy of ``model(x)`` against integer labels ``y``."""

    def step(self, model: Any, x: Any, y: Any, xp: Any) -> tuple[Any, int, Any]:
        """Forward through ``model`` (a wrapper or the model): this rank's summed loss,
        the number of targets in it, and the correct count."""
        logits = model(x)
        loss = F.softmax_cross_entropy(logits, y, reduction="sum")
        correct = xp.count_nonzero(logits.data.argmax(-1) == y) if len(y) else 0
        return loss, len(y), correct

    def evaluate(self, model: Any, loader: Any, comm: Any) -> dict[str, Any]:
        """The eval record's fields and a line saying them. Collective."""
        from mpidl.train.evaluation import evaluate_model

        scores = evaluate_model(model, loader, comm)
        record = scores.as_record()
        line = (f"test loss {scores.loss:.4f}, test accuracy {scores.accuracy:.4f}, macro-F1 "
                f"{scores.macro_f1:.4f} (always guessing the majority class: "
                f"{scores.majority_accuracy:.4f})")
        return {"record": record, "line": line, "scores": scores}


class Regression(Objective):
    """Squared (or Huber) error of ``model(x)`` against float targets ``y``."""

    features = ("x", "y")
    accuracy = False
    final_scores = (("test_r2", "test R²"), ("test_mse", "test MSE"))

    def __init__(self, kind: str = "mse", outputs: int = 1, scale: Any = None) -> None:
        """``scale``: each output's standard deviation (the train split's; None, a
        missing or a zero one count as 1): errors are divided by it."""
        self.kind, self.outputs = kind, int(outputs)
        std = numpy.ones(self.outputs) if scale is None else numpy.array(
            [numpy.nan if v is None else v for v in scale], numpy.float64)
        self.inverse = numpy.where(numpy.isfinite(std) & (std > 0), 1 / std, 1.0)
        self._inverse_on: dict[tuple, Any] = {}  # (array module, dtype) -> its copy

    def _targets(self, pred: Any, y: Any) -> Any:
        return y.reshape(pred.shape)  # (B,) scalar targets against (B, 1) predictions

    def _loss(self, pred: Any, target: Any) -> Any:
        """The summed loss of ``pred`` against ``target``, in standard units."""
        xp = _xp(target)
        key = (xp.__name__, str(pred.dtype))
        inv = self._inverse_on.get(key)
        if inv is None:  # once per device and dtype, not a host-to-device copy per step
            inv = self._inverse_on[key] = xp.asarray(self.inverse.astype(pred.dtype))
        return F.regression_loss(F.mul(pred, inv), target * inv, kind=self.kind,
                                 reduction="sum")

    def step(self, model: Any, x: Any, y: Any, xp: Any) -> tuple[Any, int, Any]:
        pred = model(x)
        target = self._targets(pred, y)
        return self._loss(pred, target), int(target.size), 0

    def global_count(self, comm: Any, samples: int, local: int) -> int:
        """Values in the global batch: samples times outputs."""
        return samples * self.outputs

    def evaluate(self, model: Any, loader: Any, comm: Any) -> dict[str, Any]:
        """MSE, MAE and R² per output over the test split. Collective."""
        from mpidl.autograd import no_grad
        from mpidl.backend import as_numpy

        k = self.outputs
        sums = numpy.zeros((6, k))  # count, sum y, sum y^2, sum e^2, sum |e|, sum loss
        model.eval()
        loader.set_epoch(0)
        with no_grad():
            for batch in loader:
                x, y = batch[0], batch[1]
                if len(x) == 0:
                    continue
                pred = model(x)
                target = self._targets(pred, y)
                loss = self._loss(pred, target)
                p = as_numpy(pred.data).reshape(-1, k).astype(numpy.float64)
                t = as_numpy(target).reshape(-1, k).astype(numpy.float64)
                e = p - t
                sums += [numpy.full(k, len(t)), t.sum(0), (t * t).sum(0), (e * e).sum(0),
                         numpy.abs(e).sum(0), numpy.full(k, float(loss.data) / k)]
        model.train()
        comm.allreduce_(sums)
        n = numpy.maximum(sums[0], 1)
        mse, mae = sums[3] / n, sums[4] / n
        var = sums[2] / n - (sums[1] / n) ** 2  # the targets' variance, per output
        r2 = numpy.where(var > 0, 1 - mse / numpy.where(var > 0, var, 1), numpy.nan)
        record = {"test_loss": float(sums[5].sum() / n[0] / k), "test_mse": float(mse.mean()),
                  "test_mae": float(mae.mean()), "test_r2": float(numpy.nanmean(r2))
                  if numpy.isfinite(r2).any() else None,
                  "test_mse_per_output": mse.tolist(), "test_mae_per_output": mae.tolist(),
                  "test_r2_per_output": [None if not numpy.isfinite(v) else float(v)
                                         for v in r2]}
        r2_text = "-" if record["test_r2"] is None else f"{record['test_r2']:.4f}"
        line = (f"test loss {record['test_loss']:.4f} (standard units), MSE "
                f"{record['test_mse']:.4g}, MAE {record['test_mae']:.4g}, R² {r2_text}")
        return {"record": record, "line": line, "scores": None}


class LanguageModel(Objective):
    """Next-token cross-entropy; ``pad_id`` targets (padding) count nothing."""

    features = ("x",)
    accuracy = True
    final_scores = (("test_perplexity", "test perplexity"),
                    ("test_accuracy", "next-token accuracy"))

    def __init__(self, pad_id: int | None) -> None:
        self.pad_id = pad_id

    def step(self, model: Any, x: Any, y: Any, xp: Any) -> tuple[Any, int, Any]:
        logits = model(x[:, :-1])
        targets = x[:, 1:]
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
                loss, count, correct = self.step(model, x, None, _xp(x))
                totals += [float(loss.data), float(correct), count]
        model.train()
        self.sum_totals(comm, totals)
        n = max(totals[2], 1)
        loss = totals[0] / n
        record = {"test_loss": loss, "test_perplexity": _perplexity(loss),
                  "test_targets": int(totals[2])}
        line = f"test loss {loss:.4f}, perplexity {_perplexity(loss):.3f}"
        if self.accuracy:
            record["test_accuracy"] = totals[1] / n
            line += f", next-token accuracy {totals[1] / n:.4f}"
        return {"record": record, "line": line, "scores": None}

    def extra(self, loss: float) -> dict[str, Any]:
        return {"perplexity": _perplexity(loss)}

    def split_over(self, grid: Any) -> "ParallelLanguageModel":
        """This objective for the model split over ``grid`` (:class:`ParallelGPT`)."""
        return ParallelLanguageModel(self.pad_id, grid)


class ParallelLanguageModel(LanguageModel):
    """The language model split over a tensor x sequence grid (``ParallelGPT``): each
    rank computes its share of the loss; shares add up over the sequence group and are
    replicated over the tensor group, so sums go over the data axis (the count) and
    over the replicas, data x sequence (the loss and the next-token hits, whose argmax
    over the vocabulary-sharded logits one small allreduce finds)."""

    def __init__(self, pad_id: int | None, grid: Any) -> None:
        super().__init__(pad_id)
        self.grid = grid

    def step(self, model: Any, x: Any, y: Any, xp: Any) -> tuple[Any, int, Any]:
        module = getattr(model, "module", model)  # the wrapper's hooks sit on parameters
        if module is not model:
            model.before_forward()  # ZeRO 1-2: the updated parameters; not model.__call__
        loss, hits = module.loss(x, reduction="sum", hits=True)
        return loss, module.count_targets(x), hits

    def global_count(self, comm: Any, samples: int, local: int) -> int:
        """Real targets over the data axis (the tensor x sequence group shares each)."""
        return super().global_count(self.grid.data, samples, local)

    def sum_totals(self, comm: Any, totals: Any) -> None:
        shares = numpy.array(totals[:2], dtype=numpy.float64)  # loss, hits
        self.grid.replicas.allreduce_(shares)  # data x sequence: the shares of every sample
        counts = numpy.array(totals[2:])
        self.grid.data.allreduce_(counts)      # the same on every rank of a sequence group
        totals[:2], totals[2:] = shares, counts


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # exp overflows float64 past ~709


def _xp(x: Any) -> Any:
    from mpidl.backend import get_array_module

    return get_array_module(x)


def objective_for(config: Any, dataset: Any) -> Any:
    """The objective of ``config.task``; ``dataset``, the train split (or its
    description), gives the padding id, or the targets' standard deviations."""
    if config.task == "gpt":
        return LanguageModel(getattr(dataset, "pad_id", None))
    y = dataset.features.get("y")
    if y is not None and y.dtype.kind == "f":
        from mpidl.data.stats import column_scale

        manifest = getattr(dataset, "manifest", None)
        scale = column_scale(manifest, "y") if manifest is not None else None
        return Regression(config.regression_loss, int(math.prod(y.shape)) if y.shape else 1,
                          scale=None if scale is None else scale[1])
    return Classification()
