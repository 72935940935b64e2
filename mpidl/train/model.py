"""The model a run trains, shaped by its data: a dataset needs no model options.

What the data determines is taken from it: the number of classes, and for token data
(text datasets: integer ``x`` with a vocabulary) the vocabulary size, the sequence
length and the padding id (so that padding is left out: the bag of words averages real
tokens only, the transformer masks them); for feature data (float ``x``) the input
width, the first and last of the mlp's ``sizes``. An option the user sets explicitly
must agree with the data, or it is a :class:`~mpidl.train.config.ConfigError` naming
both values (a 784-input mlp on 64-feature rows fails at its first matmul otherwise;
a bag of words with a smaller vocabulary indexes past its table).

The train split's statistics shape the models too: the ``mlp`` standardises its inputs
per column, and every feature model predicts a regression's targets in standard units,
with the column means and deviations ``mpidl shard`` stored (:func:`data_stats`;
``--model.standardize=false`` leaves them raw). On the real wine table (13 columns from
0.13 to 1,680) the mlp reaches 0.94 test accuracy in 3 epochs standardised, 0.22 raw
(0.83 after 30 epochs); see ``tests/integration/test_own_data.py``.
"""
from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any

import numpy

from mpidl import models
from mpidl.data.stats import column_scale
from mpidl.train.config import Config, ConfigError
from mpidl.train.model_keys import check_model, model_parameters

if TYPE_CHECKING:
    from mpidl.train.checkpoint import Checkpoint

TOKEN_MODELS = ("bow", "transformer", "gpt")   # read token ids
FEATURE_MODELS = ("mlp", "cnn", "cosmoflow")   # read feature arrays


def data_shapes(dataset: Any) -> dict[str, Any]:
    """What ``dataset`` (a split: ``features``, ``num_classes``, ``vocab``, ``pad_id``)
    determines of a model, by model keyword: ``classes``, and ``vocab``, ``seq_len``,
    ``pad_id`` (token data) or ``inputs`` (feature data: the flattened width)."""
    x = dataset.features["x"]
    y = dataset.features.get("y")
    shapes: dict[str, Any] = {}
    if dataset.num_classes:
        shapes["classes"] = shapes["outputs"] = int(dataset.num_classes)
    elif y is not None and y.dtype.kind == "f":  # regression: one output per target value
        shapes["outputs"] = int(math.prod(y.shape)) if y.shape else 1
    if x.dtype.kind in "iu" and dataset.vocab:
        shapes["vocab"] = len(dataset.vocab)
        if x.shape:
            shapes["seq_len"] = int(x.shape[-1])
        pad_id = getattr(dataset, "pad_id", None)
        if pad_id is not None:
            shapes["pad_id"] = int(pad_id)
    else:
        shapes["inputs"] = int(math.prod(x.shape)) if x.shape else 1
        shapes["in_shape"] = tuple(int(d) for d in x.shape)
    return shapes


TEXT_EMBED_STD = 0.1  # the bow's embedding init on a text dataset (model_options says why)
STATS_OPTIONS = ("input_stats", "target_stats")  # set from the data, never by the user


def data_stats(dataset: Any) -> dict[str, Any]:
    """``input_stats`` (the inputs' column mean and std) and, for regression targets,
    ``target_stats``, from the split's stored statistics
    (:func:`mpidl.data.stats.column_scale`); a split without them gives neither."""
    manifest = getattr(dataset, "manifest", None)
    if manifest is None:
        return {}
    stats = {"input_stats": column_scale(manifest, "x")}
    y = dataset.features.get("y")
    if not dataset.num_classes and y is not None and y.dtype.kind == "f":
        stats["target_stats"] = column_scale(manifest, "y")
    return {k: v for k, v in stats.items() if v is not None}


def unscaled_note(config: Config, dataset: Any) -> str | None:
    """What a run should say when its model would standardise but ``dataset`` has no
    column statistics to do it with (written by an mpidl before they were stored), else
    None: the model then trains on the data's own scale, which must not pass silently."""
    accepted = model_parameters(check_model(config))
    if "standardize" not in accepted or config.model.kwargs.get("standardize") is False \
            or "inputs" not in data_shapes(dataset):
        return None
    wanted = {"input_stats"} & accepted
    y = dataset.features.get("y")
    if not dataset.num_classes and y is not None and y.dtype.kind == "f":
        wanted |= {"target_stats"} & accepted
    missing = sorted(wanted - set(data_stats(dataset)))
    if not missing:
        return None
    what = " and ".join({"input_stats": "inputs", "target_stats": "regression targets"}[k]
                        for k in missing)
    return (f"note: {dataset.path} has no column statistics (written by an older mpidl), so "
            f"the {config.model.name}'s {what} are not standardised; write the dataset "
            "again with `mpidl shard` to have them")


def _contradiction(key: str, given: Any, dataset: Any, what: str) -> ConfigError:
    return ConfigError(f"--model.{key}={given} contradicts the data: {dataset.path} has "
                       f"{what}; leave model.{key} out, the data sets it")


def model_options(config: Config, dataset: Any) -> dict[str, Any]:
    """The model's keyword arguments: the user's, completed (and checked) by the data."""
    name = config.model.name
    accepted = model_parameters(check_model(config))
    kwargs = dict(config.model.kwargs)
    shapes = data_shapes(dataset)
    x = dataset.features["x"]
    if name in TOKEN_MODELS and "vocab" not in shapes:
        raise ConfigError(f"model {name!r} reads token ids, but {dataset.path} holds "
                          f"{x.dtype} features of shape {tuple(x.shape)}: use --model=mlp "
                          "(or write the dataset from text with `mpidl shard`)")
    if name in FEATURE_MODELS and "inputs" not in shapes:
        raise ConfigError(f"model {name!r} reads feature vectors, but {dataset.path} holds "
                          f"token ids (a text dataset): use --model=bow or --model=transformer")
    what = {"classes": "{} classes", "vocab": "a vocabulary of {} tokens",
            "seq_len": "rows of {} tokens", "pad_id": "padding id {}",
            "outputs": "{} classes or regression targets", "in_shape": "samples of shape {}"}
    for key, wanted in shapes.items():
        if key not in accepted or key == "inputs":
            continue
        given = kwargs.get(key)
        if isinstance(given, list):
            given = tuple(given)
        if key in kwargs and given != wanted and not (
                key == "in_shape" and _same_samples(given, wanted)):
            raise _contradiction(key, kwargs[key], dataset, what[key].format(wanted))
        kwargs[key] = given if key in kwargs else wanted
    if "embed_std" in accepted and "pad_id" in shapes and "embed_std" not in kwargs:
        # The bag of words of a text dataset starts its embeddings at N(0, 0.1²), not
        # the reference's N(0, 1) (PyTorch's default). On the 3,000 UCI sentences, where
        # most words occur a few times, each rare word's random vector barely moves from
        # where it started and drowns the words that carry the sentiment: 0.80 test
        # accuracy at std 1, 0.83 at 0.1, logistic regression on the same counts 0.83
        # (docs/data.md, "Defaults that fit the data").
        kwargs["embed_std"] = TEXT_EMBED_STD
    if "sizes" in accepted and "inputs" in shapes:
        kwargs["sizes"] = _mlp_sizes(kwargs, shapes, dataset)
    given = [k for k in STATS_OPTIONS if k in kwargs and k in accepted]
    if given:
        raise ConfigError(f"--model.{given[0]} is not an option: the train split's column "
                          "statistics set it; --model.standardize=false leaves the data "
                          "unscaled")
    if "standardize" in accepted and "inputs" in shapes:
        kwargs.update({k: v for k, v in data_stats(dataset).items() if k in accepted})
    return kwargs


def _same_samples(given: Any, wanted: tuple) -> bool:
    """``in_shape`` given without the channel axis of one-channel data: the same samples."""
    return tuple(given) == wanted[1:] and wanted[:1] == (1,) or (1, *tuple(given)) == wanted


def _mlp_sizes(kwargs: dict[str, Any], shapes: dict[str, Any], dataset: Any) -> list[int]:
    """The mlp's widths: the user's hidden layers (the reference's two of 1024 by default)
    between the data's input width and class count."""
    default = list(inspect.signature(models.mlp).parameters["sizes"].default)
    sizes = list(kwargs.get("sizes", default))
    if len(sizes) < 2:
        raise ConfigError(f"--model.sizes={sizes} needs at least an input and an output width")
    given = "sizes" in kwargs
    if given and sizes[0] != shapes["inputs"]:
        raise _contradiction("sizes", sizes, dataset,
                             f"{shapes['inputs']} input features per sample, not {sizes[0]}")
    classes = shapes.get("outputs")
    if given and classes is not None and sizes[-1] != classes:
        raise _contradiction("sizes", sizes, dataset, f"{classes} classes, not {sizes[-1]}")
    sizes[0] = shapes["inputs"]
    if classes is not None:
        sizes[-1] = classes
    return sizes


def build_model(config: Config, dataset: Any, keep: Any = None) -> Any:
    """The configured model, shaped by ``dataset`` (see the module docstring); ``keep``:
    the parts of a gpt this rank builds (a pipeline stage's; None: all)."""
    factory = check_model(config)
    extra = {} if keep is None else {"keep": keep}
    return factory(seed=config.seed, **model_options(config, dataset), **extra)


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name when it has none)."""
    text = str(error).strip("'\" ")
    return text.splitlines()[0] if text else type(error).__name__


def another_model(path: str, config: Config, doing: str, error: BaseException) -> ConfigError:
    """The error for a checkpoint at ``path`` that holds another model than ``config``'s
    (``error``: what loading it raised; ``doing``: "evaluate", "resume from", ...)."""
    return ConfigError(
        f"cannot {doing} {path}: it holds another model than the configured "
        f"{config.model.name!r} ({first_line(error)}); use the model options it was saved "
        "with (the run's config.toml) or another --run-dir for a new model")


def load_model_state(model: Any, state: Checkpoint, config: Config, doing: str) -> None:
    """Load a checkpoint's parameters into ``model``; ConfigError naming the checkpoint
    when it holds another model (other parameter names or shapes)."""
    try:
        model.load_state_dict(state.model)
    except (KeyError, ValueError) as e:
        raise another_model(state.path, config, doing, e) from None


def seed_dropout_per_rank(model: Any, seed: int, rank: int, salt: int = 0) -> int:
    """Give every rank its own dropout masks; returns how many generators changed.

    The model is built from the same seed on every rank (its parameters must agree), so
    every dropout module's generator starts alike and sample k of every rank's share
    would get the same mask: one mask, repeated across the global batch. Rank 0 keeps
    its generators (a 1-rank run is unchanged); rank r > 0 reseeds each from
    ``(seed, r, module index, salt)``. The states are checkpointed per rank
    (:meth:`~mpidl.train.checkpointing.RunCheckpoints.rng_states`), so a resume on as
    many ranks is exact; on another number, rank r > 0 reseeds with the step as ``salt``.
    """
    if rank == 0:
        return 0
    changed = 0
    for index, (_, m) in enumerate(model.named_modules()):
        if isinstance(getattr(m, "rng", None), numpy.random.Generator):
            m.rng = numpy.random.default_rng([int(seed), int(rank), index, int(salt)])
            changed += 1
    return changed
