"""What a run optimises: classify samples, or predict each next token (a language model).

The trainer's step and evaluation ask the run's objective, chosen from the task:

- :class:`Classification` (every task but ``gpt``): logits ``(B, classes)`` of inputs
  ``x`` against labels ``y``; the loss is summed over samples and averaged over the
  global batch (the sampler's count); evaluation is the exact per-class count
  (:class:`~mpidl.data.evaluate.ClassCounts`): loss, accuracy, recall, macro-F1 and the
  confusion matrix.
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

Evaluation is one loop for every objective (:func:`mpidl.train.evaluation.evaluate`);
an objective gives what differs: :meth:`Objective.score` scores one batch (this rank's
share, which may have no rows), and :meth:`Objective.eval_sums` the sums that add the
batches up and their reduction over the ranks to an :class:`Evaluation`.
"""
from __future__ import annotations

import math
from typing import Any

import numpy

from mpidl import functions as F
from mpidl.backend import as_numpy, get_array_module
from mpidl.data.evaluate import ClassCounts
from mpidl.data.stats import column_scale
from mpidl.parallel.wrapper import Wrapper
from mpidl.train.objective_base import BatchScores, EvalSums, Evaluation, Objective


class Classification(Objective):
    """Softmax cross-entropy of ``model(x)`` against integer labels ``y``."""

    def step(self, model: Any, x: Any, y: Any, xp: Any) -> tuple[Any, int, Any]:
        """Forward through ``model`` (a wrapper or the model): this rank's summed loss,
        the number of targets in it, and the correct count."""
        logits = model(x)
        loss = F.softmax_cross_entropy(logits, y, reduction="sum")
        correct = xp.count_nonzero(logits.data.argmax(-1) == y) if len(y) else 0
        return loss, len(y), correct

    def score(self, model: Any, x: Any, y: Any, xp: Any) -> BatchScores:
        logits = model(x)
        loss = F.softmax_cross_entropy(logits, y, reduction="sum").data
        return BatchScores(loss, logits.data, y)

    def eval_sums(self, model: Any, dataset: Any, xp: Any) -> "ClassificationSums":
        # Counted over the model's outputs and the dataset's classes alike: a model with
        # more outputs than the dataset has classes (or fewer) has every count in range.
        classes = max(output_width(model, dataset.features["x"], xp), dataset.num_classes or 0)
        return ClassificationSums(classes, xp)


def output_width(model: Any, feature: Any, xp: Any) -> int:
    """The number of scores ``model`` gives a sample of ``feature`` (an
    :class:`~mpidl.data.format.Feature`): its output for a batch of no samples, the same
    on every rank. Collective as the model's forward (ZeRO-3: every rank probes)."""
    return int(model(xp.zeros((0, *feature.shape), dtype=feature.dtype)).shape[-1])


class ClassificationSums:
    """Per-class counts (:class:`~mpidl.data.evaluate.ClassCounts`) and the loss sum; both
    stay on the device until :meth:`reduce` (no host sync per batch with CuPy)."""

    def __init__(self, classes: int, xp: Any) -> None:
        self.counts = ClassCounts(classes, xp)
        self.xp = xp
        self.loss_sum: Any = 0.0

    def add(self, batch: BatchScores) -> None:
        # float64: float32 sums drift over batches
        self.loss_sum = self.loss_sum + batch.loss.astype(self.xp.float64)
        self.counts.update(batch.outputs, batch.targets)

    def reduce(self, comm: Any) -> Evaluation:
        scores = self.counts.scores(comm, self.loss_sum)
        line = (f"test loss {scores.loss:.4f}, test accuracy {scores.accuracy:.4f}, macro-F1 "
                f"{scores.macro_f1:.4f} (always guessing the majority class: "
                f"{scores.majority_accuracy:.4f})")
        return Evaluation(scores.as_record(), line, scores)


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
        xp = get_array_module(target)
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

    def score(self, model: Any, x: Any, y: Any, xp: Any) -> BatchScores:
        pred = model(x)
        target = self._targets(pred, y)
        return BatchScores(self._loss(pred, target).data, pred.data, target)

    def eval_sums(self, model: Any, dataset: Any, xp: Any) -> "RegressionSums":
        return RegressionSums(self.outputs)


class RegressionSums:
    """Per-output sums, float64 on the host: values, targets and their squares, squared and
    absolute errors (all in the data's units), and the loss (in standard units)."""

    def __init__(self, outputs: int) -> None:
        self.outputs = outputs
        self.sums = numpy.zeros((6, outputs))  # count, sum y, sum y^2, sum e^2, sum |e|, loss

    def add(self, batch: BatchScores) -> None:
        k = self.outputs
        p = as_numpy(batch.outputs).reshape(-1, k).astype(numpy.float64)
        t = as_numpy(batch.targets).reshape(-1, k).astype(numpy.float64)
        e = p - t
        self.sums += [numpy.full(k, len(t)), t.sum(0), (t * t).sum(0), (e * e).sum(0),
                      numpy.abs(e).sum(0), numpy.full(k, float(batch.loss) / k)]

    def reduce(self, comm: Any) -> Evaluation:
        """MSE, MAE and R² per output over the split, and their means. Collective."""
        sums, k = self.sums, self.outputs
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
        return Evaluation(record, line)


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
        # Left on the device (a 0-d array), as correct is: summed into the records.
        return loss, xp.count_nonzero(real), correct

    def targets(self, x: Any, y: Any) -> int:
        """The next-token targets of ``x`` that are not padding."""
        xp = get_array_module(x)
        if self.pad_id is None:
            return int(x[:, 1:].size)
        return int(xp.count_nonzero(x[:, 1:] != self.pad_id))

    def global_count(self, comm: Any, samples: int, local: int) -> int:
        """Real targets over every rank (one 8-byte allreduce)."""
        counts = numpy.array([local], dtype=numpy.int64)
        comm.allreduce_(counts)
        return max(int(counts[0]), 1)

    def score(self, model: Any, x: Any, y: Any, xp: Any) -> BatchScores:
        loss, count, correct = self.step(model, x, None, xp)
        return BatchScores(loss.data, count=count, correct=correct)

    def eval_sums(self, model: Any, dataset: Any, xp: Any) -> "LanguageModelSums":
        return LanguageModelSums(self)

    def extra(self, loss: float) -> dict[str, Any]:
        return {"perplexity": _perplexity(loss)}

    def split_over(self, grid: Any) -> "ParallelLanguageModel":
        """This objective for the model split over ``grid`` (:class:`ParallelGPT`, or
        pipeline stages when the grid has a pipeline axis)."""
        if grid.pipeline_size > 1:
            return PipelineLanguageModel(self.pad_id, grid)
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
        module = model  # in evaluation: the model itself
        if isinstance(model, Wrapper):  # in training: its hooks sit on the parameters
            model.before_forward()  # ZeRO 1-2: the updated parameters; not model.__call__
            module = model.module
        loss, hits = module.loss(x, reduction="sum", hits=True)
        # The count left on the device (count_targets reads it to the host), as hits.
        targets = x[:, 1:]
        pad = getattr(module, "pad_id", None)
        count = targets.size if pad is None else xp.count_nonzero(targets != pad)
        return loss, count, hits

    def global_count(self, comm: Any, samples: int, local: int) -> int:
        """Real targets over the data axis (the tensor x sequence group shares each)."""
        return super().global_count(self.grid.data, samples, local)

    def sum_totals(self, comm: Any, totals: Any) -> None:
        shares = numpy.array(totals[:2], dtype=numpy.float64)  # loss, hits
        self.grid.replicas.allreduce_(shares)  # data x sequence: the shares of every sample
        counts = numpy.array(totals[2:])
        self.grid.data.allreduce_(counts)      # the same on every rank of a sequence group
        totals[:2], totals[2:] = shares, counts


class PipelineLanguageModel(ParallelLanguageModel):
    """The language model in pipeline stages (:class:`~mpidl.parallel.PipelineModel`),
    each stage split over the grid's tensor x sequence axes or not. The pipeline runs
    its microbatches itself (:meth:`PipelineModel.step`, called by the trainer's step,
    not :meth:`step`); evaluation runs :meth:`PipelineModel.evaluate`, whose loss share
    is the same on every stage, so the sums reduce as :class:`ParallelLanguageModel`'s.
    The last stage counts the next-token hits beside the loss and they reach every stage
    with it (:attr:`PipelineModel.hits`): accuracy as any gpt run reports it."""

    def step(self, model: Any, x: Any, y: Any, xp: Any) -> tuple[Any, int, Any]:
        raise TypeError("a pipelined model steps through PipelineModel.step (the trainer's "
                        "TrainStep), not the objective's forward")

    def score(self, model: Any, x: Any, y: Any, xp: Any) -> BatchScores:
        """``model.evaluate(x)``: every rank runs its stage's forwards on every batch,
        its share empty or not (the pipeline's messages and the stages' collectives)."""
        loss, count = model.evaluate(x)
        return BatchScores(loss, count=count, correct=model.hits)


class LanguageModelSums:
    """The loss sum, next-token hits and real targets, float64 on the host; reduced as the
    objective's train windows are (:meth:`LanguageModel.sum_totals`)."""

    def __init__(self, objective: LanguageModel) -> None:
        self.objective = objective
        self.totals = numpy.zeros(3)  # loss sum, correct, targets

    def add(self, batch: BatchScores) -> None:
        self.totals += [float(batch.loss), float(batch.correct), float(batch.count)]

    def reduce(self, comm: Any) -> Evaluation:
        """Loss per real target, next-token accuracy and perplexity over the split.
        Collective."""
        totals = self.totals
        self.objective.sum_totals(comm, totals)
        n = max(totals[2], 1)
        loss = totals[0] / n
        record = {"test_loss": loss, "test_perplexity": _perplexity(loss),
                  "test_targets": int(totals[2])}
        line = f"test loss {loss:.4f}, perplexity {_perplexity(loss):.3f}"
        if self.objective.accuracy:
            record["test_accuracy"] = totals[1] / n
            line += f", next-token accuracy {totals[1] / n:.4f}"
        return Evaluation(record, line)


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # exp overflows float64 past ~709


def objective_for(config: Any, dataset: Any) -> Objective:
    """The objective of ``config.task``; ``dataset``, the train split (or its
    description), gives the padding id, or the targets' standard deviations."""
    if config.task == "gpt":
        return LanguageModel(getattr(dataset, "pad_id", None))
    y = dataset.features.get("y")
    if y is not None and y.dtype.kind == "f":
        manifest = getattr(dataset, "manifest", None)
        scale = column_scale(manifest, "y") if manifest is not None else None
        return Regression(config.regression_loss, int(math.prod(y.shape)) if y.shape else 1,
                          scale=None if scale is None else scale[1])
    return Classification()
