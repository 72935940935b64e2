"""What ``mpidl train --data DIR`` takes from the data when the command line leaves it open.

``mpidl train`` with no preset starts from ``reviews``, whose model (bow) and epochs (2)
were chosen for its generated corpus of 25,000 reviews. A user's own dataset is another
thing: a table of floats stops the bow at once, and 2 epochs of 2,700 real sentences
are 86 optimizer steps, far from trained (0.67-0.69 test accuracy on the UCI sentences
against 0.80 after 10 epochs; docs/data.md, "Defaults that fit the data"). So, for
``mpidl train --data DIR`` with no preset or config file:

- **the model** follows the dataset's kind (:func:`model_for`), unless ``--model`` is
  given: token ids -> ``bow``, feature vectors -> ``mlp`` (``linear`` for a regression
  table of fewer than :data:`LINEAR_ROWS` rows), images -> ``cnn``, volumes ->
  ``cosmoflow``;
- **the linear model** (``--model=linear``) trains at its own rate,
  :data:`LINEAR_LR`, unless ``--lr`` is given;
- **the epochs** give the run at least :data:`MIN_STEPS` optimizer steps
  (:func:`epochs_for`), unless ``--epochs`` or ``--steps`` is given: never fewer than
  the preset's, at most :data:`MAX_EPOCHS`.

The run says what it chose, and ``config.toml`` records it (what ``eval``, ``predict``
and a resume read). A preset or a config file keeps its own model and epochs. The run
keeps its last epoch's parameters (no validation split is carved): with these defaults
the test accuracy has levelled off by the last epochs (docs/data.md).
"""
from __future__ import annotations

import math
import os
from typing import Sequence

from mpidl.train.config import Config

# The linear model's learning rate at a batch of 64 (AdamW): measured on the UCI
# sentences, 10 epochs: 0.837 test accuracy at 1e-2, 0.817 at 2e-3 (the bow's rate);
# scikit-learn's LogisticRegression on the same counts 0.827-0.837 (C from 10 to 3).
LINEAR_LR = 1e-2

# Optimizer steps a run gets at least. Measured on the 3,000 UCI sentences (2,700 train,
# batch 64: 43 steps an epoch): the bow's test accuracy levels off after 8-10 epochs
# (344-430 steps); the generated reviews (391 steps an epoch) keep their 2 epochs.
MIN_STEPS = 400
# Small tables (the 142 training rows of the wine data: 3 steps an epoch) take at most
# this many epochs: 300 steps of a linear or small mlp model, a few seconds.
MAX_EPOCHS = 100
# A regression table of fewer training rows gets the linear model (least squares on the
# standardised columns). Measured on diabetes (398 rows, seeds 0-2, 58 epochs): the
# reference mlp (two layers of 1024) overfits, test RMSE 68.4-70.1 (56.6 after one
# epoch); two layers of 64 58.6, 62.1, 61.7 (over 16 epochs it overfits too); the linear
# model 59.2, 59.2, 59.3; Ridge 58.9. On the classification tables the mlp does as well
# or better (wine 0.944 both, breast cancer 0.976 against 0.965), so they keep it.
LINEAR_ROWS = 1000


def sets(overrides: Sequence[str], key: str) -> bool:
    """Whether the command-line ``overrides`` set ``key`` (``--key``, ``--key=V``,
    ``--key V``; dashes or underscores; ``--model.name`` for ``--model``)."""
    names = {"--" + key, "--" + key.replace("_", "-")}
    if "." not in key:
        names |= {n + ".name" for n in names}
    return any(a.partition("=")[0] in names for a in overrides)


def model_for(features: dict, has_vocab: bool, rows: int = LINEAR_ROWS) -> str:
    """The model for a split of ``rows`` samples with ``features`` (name ->
    :class:`~mpidl.data.format.Feature`): token ids (integer ``x`` with a vocabulary) ->
    bow; float ``x`` of at most one axis per sample -> mlp, or the linear model for
    regression targets (float ``y``) on fewer than :data:`LINEAR_ROWS` rows; two axes
    (H, W), or three with at most 4 channels first (C, H, W) -> cnn; more -> cosmoflow
    (a one-channel volume (D, H, W), or (C, D, H, W))."""
    x, y = features["x"], features.get("y")
    if x.dtype.kind in "iu" and has_vocab:
        return "bow"
    axes = len(x.shape)
    if axes <= 1 and y is not None and y.dtype.kind == "f" and rows < LINEAR_ROWS:
        return "linear"
    if axes <= 1:
        return "mlp"
    if axes == 2 or (axes == 3 and x.shape[0] <= 4):
        return "cnn"
    return "cosmoflow"


def epochs_for(samples: int, global_batch: int, at_least: int) -> int:
    """Epochs of at least :data:`MIN_STEPS` steps over ``samples`` in batches of
    ``global_batch`` (never fewer than ``at_least``, at most :data:`MAX_EPOCHS`)."""
    per_epoch = max(math.ceil(samples / max(global_batch, 1)), 1)
    return max(at_least, min(MAX_EPOCHS, math.ceil(MIN_STEPS / per_epoch)))


def fit_to_data(config: Config, preset: str | None, overrides: Sequence[str]) -> list[str]:
    """Set ``config``'s model and epochs from its dataset where the command line leaves
    them open (the module docstring); returns what was chosen, a line each. Reads the
    train split's manifest only; a dataset that cannot be read, or has no training
    samples, is left to the trainer to report (nothing is chosen)."""
    if preset is not None or not config.data.path:
        return []
    # Here: config parsing stays free of the data package until a dataset is named.
    from mpidl.data.format import DataError, read_manifest

    try:
        manifest = read_manifest(os.path.join(config.data.path, "train"))
    except (DataError, OSError):
        return []
    if "x" not in manifest.features or manifest.num_samples == 0:
        return []  # the trainer says what is wrong with it, before anything is chosen
    notes = []
    if not sets(overrides, "model"):
        x = manifest.features["x"]
        config.model.name = model_for(manifest.features, bool(manifest.metadata.get("vocab")),
                                      manifest.num_samples)
        kind = "token ids" if config.model.name == "bow" else \
            f"{x.dtype.name} samples of shape {tuple(x.shape)}"
        if config.model.name == "linear":
            kind += (f" and regression targets, {manifest.num_samples} training rows: "
                     f"fewer than {LINEAR_ROWS}, where the mlp overfits")
        notes.append(f"model {config.model.name} (the data holds {kind}; --model=NAME "
                     "chooses another)")
    if config.model.name == "linear" and not sets(overrides, "lr"):
        config.lr = LINEAR_LR
        notes.append(f"lr {LINEAR_LR:g} (the linear model's, at a batch of 64; --lr sets it)")
    if not (sets(overrides, "epochs") or sets(overrides, "steps")):
        epochs = epochs_for(manifest.num_samples, config.global_batch, config.epochs)
        if epochs != config.epochs:
            config.epochs = epochs
            notes.append(f"epochs {epochs} (at least {MIN_STEPS} steps of "
                         f"{config.global_batch} over {manifest.num_samples} training samples; "
                         "--epochs=N sets them)")
    return notes


__all__ = ["LINEAR_LR", "LINEAR_ROWS", "MIN_STEPS", "MAX_EPOCHS", "epochs_for", "fit_to_data", "model_for",
           "sets"]
