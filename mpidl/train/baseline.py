"""The baseline in the box: the linear model's test score beside the trained model's.

A user who trains on their own data compares with what they would try first:
scikit-learn's logistic regression on word counts, or on standardised columns (Ridge for
regression). ``mpidl train --baseline auto`` (the default) ends a run on a small dataset
by training :class:`~mpidl.models.LinearModel` on the same train split, on the same
ranks, with the same data-parallel step, and printing its test score beside the model's::

    baseline: linear model (logistic regression on token counts), 10 epochs in 1.9 s:
    test accuracy 0.8367 (the bow: 0.8333)

It writes no file (no run directory, no checkpoint) and changes nothing of the run.
"Small": at most :data:`MAX_VALUES` stored values in the train split (rows x values
per row), so that the fit takes seconds (the 2,700 UCI sentences of 40 tokens: 108,000
values, 2 s); larger datasets, or ``--baseline off``, skip it. The linear model trains
at :data:`~mpidl.train.data_fit.LINEAR_LR` with the run's optimizer and batch, for :func:`epochs_for
<mpidl.train.data_fit.epochs_for>` epochs.
"""
from __future__ import annotations

import copy
import io
import math
import time
from typing import Any

from mpidl.train.config import Config

# At most this many values (rows x values per row) in the train split: about 2 s of
# linear fit per million on one core (measured: the UCI sentences, 108,000 values,
# 430 steps in ~2 s; the step costs little more than reading the batch).
MAX_VALUES = 4_000_000

def wanted(config: Config, train_set: Any) -> bool:
    """Whether the run ends with the baseline: ``--baseline auto``, a user's dataset
    (``--data``; the generated corpora are mpidl's own demonstrations, and the test
    suite trains on them hundreds of times), a model that is not already the linear
    one, a train split of at most :data:`MAX_VALUES` values, and a classification or
    regression task (not a language model)."""
    if (config.baseline != "auto" or not config.data.path or config.model.name == "linear"
            or config.task == "gpt"):
        return False
    x = train_set.features["x"]
    return len(train_set) * max(math.prod(x.shape), 1) <= MAX_VALUES


def baseline_config(config: Config, samples: int) -> Config:
    """``config`` for the linear model: its own rate and enough epochs; no files."""
    # Here: data_fit imports the data package lazily; the baseline runs after training.
    from mpidl.train.data_fit import LINEAR_LR, epochs_for

    linear = copy.deepcopy(config)
    linear.model.name, linear.model.kwargs = "linear", {}
    linear.lr, linear.lr_scaling, linear.steps, linear.stop_at_step = LINEAR_LR, "auto", None, None
    linear.epochs = epochs_for(samples, config.global_batch, 1)
    linear.precision, linear.zero, linear.microbatches = "fp32", 0, 1
    linear.tensor_parallel, linear.pipeline_parallel = 1, 1
    linear.sequence_parallel = "none"
    return linear


def fit_baseline(config: Config, comm: Any, data_dir: str,
                 samples: int) -> tuple[Any, int, float]:
    """Train the linear model on ``data_dir``'s train split (of ``samples`` rows) and
    score it on its test split: ``(evaluation, epochs, seconds)``. Collective; writes
    no file."""
    # Here: the engine loads when a baseline is fitted, not when the module is read.
    from mpidl.train.build import build_run
    from mpidl.train.evaluation import evaluate
    from mpidl.train.log import Logger
    from mpidl.train.step import TrainStep

    start = time.perf_counter()
    # The run has said what there is to say of the data (a dominant class, ...): once.
    quiet = Logger(comm.rank, comm.size, stream=io.StringIO())
    linear = baseline_config(config, samples)
    run = build_run(linear, comm, data_dir, quiet)
    try:
        step_fn = TrainStep(run, quiet)
        step = 0
        for epoch in range(linear.epochs):
            run.loader.set_epoch(epoch)
            for batch in run.loader:
                x, y, n = batch[0], batch[1] if len(batch) > 2 else None, batch[-1]
                step_fn(x, y, n, step)
                step += 1
        scores = evaluate(run.objective, run.model, run.eval_loader, comm)
    finally:
        run.close()
    return scores, linear.epochs, time.perf_counter() - start


def describe(model: str, tokens: bool, scores: Any, model_score: Any, epochs: int,
             seconds: float, key: str, label: str) -> str:
    """The line ``mpidl train`` prints: the baseline's ``key`` score (shown as ``label``)
    beside the ``model``'s ``model_score``; ``tokens``: the data is token ids."""
    inputs = "token counts" if tokens else "features"
    kind = "logistic regression" if key == "test_accuracy" else "least squares"
    def shown(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, (int, float)) else "-"  # R² of one test row: none

    return (f"baseline: linear model ({kind} on {inputs}), {epochs} epochs in "
            f"{seconds:.1f} s: {label} {shown(scores.record.get(key))} (the {model}: "
            f"{shown(model_score)}; --baseline=off skips this)")


__all__ = ["MAX_VALUES", "baseline_config", "describe", "fit_baseline", "wanted"]
