"""``mpidl eval``, and a trained run made ready to score inputs (``mpidl predict`` too).

Run::

    mpidl eval runs/reviews                       # the latest checkpoint, on the run's test split
    mpiexec -n 4 mpidl eval runs/reviews --data=data/other      # another dataset's test split
    mpidl eval runs/reviews --checkpoint=runs/reviews/checkpoints/checkpoint-00000094.h5
    mpidl eval runs/reviews --json                # one JSON object, for scripts

Each builds only what it uses: the model (from the run's ``config.toml`` and the
description of the data it was trained on, ``RUN_DIR/dataset.json``: see
:mod:`mpidl.data.description`), the checkpoint, and the inputs. No optimizer, no
data-parallel wrapper, no train loader: ``mpidl eval`` reads the test split alone, and
works when the train split is empty or gone; ``mpidl predict`` reads no dataset at all.

``mpidl eval`` scores the test split exactly (:func:`~mpidl.train.evaluation.evaluate`,
the same loop as the trainer's eval records, so they agree to the last count) and prints
for a classifier the loss, accuracy, macro-F1, the majority-class accuracy (the floor to
beat) and the confusion matrix with class names; for a regression or a language model,
its objective's scores. The test split must agree with the run's data (features,
vocabulary, classes: :func:`~mpidl.data.splits.check_splits_agree`).

Exit codes (the same on every rank): 0 done; 2 a missing run directory, no checkpoint,
a corrupt checkpoint, one of another model, a missing or corrupt dataset or one that
disagrees with the run's (one message, from rank 0); 1 any other error.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable, Sequence, TypeVar

from mpidl.comm import world
from mpidl.train.log import Logger, format_table, report_first_error
from mpidl.train.model_keys import check_model

# The modules that import NumPy (the rest of mpidl's) are imported inside the functions
# that use them, each marked "lazy": `mpidl eval --help` and a usage error answer at once,
# not after loading NumPy and the data stack (0.7 s). None of them imports this module: no
# cycle is hidden here. The ones above load no NumPy.

EXIT_CONFIG = 2
MAX_SHOWN_CLASSES = 20  # a wider confusion matrix does not fit a terminal: --json has it

T = TypeVar("T")


class Refused(Exception):
    """Raised on every rank after rank 0 reported an error that ends the command."""


def agreed(comm: Any, prog: str, step: Callable[[], T]) -> T:
    """Run ``step`` on every rank; if it fails on any rank with an error about the user's
    files or options, rank 0 reports the first such error once and every rank raises
    :class:`Refused`. Collective (``step`` itself may be)."""
    # lazy: NumPy and the data stack load after --help (see the module's note)
    from mpidl.data import DataError
    from mpidl.train.checkpoint import CheckpointError
    from mpidl.train.config import ConfigError

    value, error = None, None
    try:
        value = step()
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as e:
        error = str(e)
    if report_first_error(comm, error, prog):
        raise Refused(error)
    return value  # type: ignore[return-value]


@dataclasses.dataclass
class TrainedRun:
    """A run directory's configuration and the checkpoint to use."""

    run_dir: str
    config: Any
    checkpoint: str

    @property
    def description_file(self) -> str:
        # lazy: NumPy and the data stack load after --help (see the module's note)
        from mpidl.train.checkpoint import DATASET_FILE

        return os.path.join(self.run_dir, DATASET_FILE)


def open_run(run_dir: str, checkpoint: str | None = None, data: str | None = None
             ) -> TrainedRun:
    """The run in ``run_dir``: its ``config.toml`` (with ``--data=data`` if given) and
    ``checkpoint`` or else its newest loadable one. Not collective.

    Raises:
        FileNotFoundError: not a run directory, or no checkpoint in it.
        ConfigError: its config.toml does not load.
    """
    # lazy: NumPy and the data stack load after --help (see the module's note)
    from mpidl.train.checkpoint import CHECKPOINT_DIR, latest_checkpoint
    from mpidl.train.config import load_config

    config_path = os.path.join(run_dir, "config.toml")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} does not exist: is {run_dir!r} a run directory?")
    path = checkpoint or latest_checkpoint(os.path.join(run_dir, CHECKPOINT_DIR))
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {os.path.join(run_dir, CHECKPOINT_DIR)}")
    config = load_config(config_path, [f"--data={data}"] if data else [])
    return TrainedRun(run_dir, config, path)


def _config_dataset(config: Any) -> str | None:
    """The dataset directory ``config`` trains on, without generating anything."""
    if config.data.path:
        return config.data.path
    if config.task in ("reviews", "gpt"):
        # lazy: NumPy and the data stack load after --help (see the module's note)
        from mpidl.train.task import corpus_cache_dir

        return corpus_cache_dir(config)
    return None


def run_description(run: TrainedRun, data_dir: str | None = None) -> Any:
    """The description of the data ``run`` was trained on: its ``dataset.json``; for runs
    older than that file, the train split of ``data_dir`` or of the dataset its
    config.toml names. Not collective.

    Raises:
        DataError: a damaged dataset.json, or neither it nor the dataset is there.
    """
    # lazy: NumPy and the data stack load after --help (see the module's note)
    from mpidl.data import DataError, read_manifest
    from mpidl.data.description import DatasetDescription, read_description

    if os.path.exists(run.description_file):
        return read_description(run.description_file)
    dataset = data_dir or _config_dataset(run.config)
    if dataset is None:
        raise DataError(f"{run.run_dir} has no {os.path.basename(run.description_file)} and "
                        "its config.toml names no dataset: pass --data=DIR, the dataset the run "
                        "was trained on")
    train = os.path.join(dataset, "train")
    try:
        return DatasetDescription(read_manifest(train), train)
    except DataError as e:
        raise DataError(
            f"{run.run_dir} has no {os.path.basename(run.description_file)} (runs of older "
            f"mpidl versions kept none), and the dataset it was trained on is not readable: "
            f"{e}; pass --data=DIR, that dataset (or a copy)") from None


def devices(config: Any, comm: Any) -> Any:
    """The array module of ``config.backend``, with this rank's BLAS threads and GPU set
    as ``mpidl train`` sets them. Returns ``xp``."""
    # lazy: NumPy and the data stack load after --help (see the module's note)
    from mpidl.backend import get_xp, limit_cpu_threads

    xp = get_xp(config.backend)
    limit_cpu_threads(comm.local_size)
    if config.backend == "cupy":
        from hpc.gpu import bind  # lazy: only a GPU run binds a device

        bind(comm.local_rank)
    return xp


def load_model(run: TrainedRun, description: Any, xp: Any, doing: str) -> tuple[Any, Any]:
    """The configured model, shaped by ``description``, on ``xp``, with the run's
    checkpoint loaded, in evaluation mode; and the checkpoint. Not collective.

    Raises:
        ConfigError: an unknown model, or a checkpoint of another model.
        CheckpointError, FileNotFoundError: the checkpoint does not load.
    """
    # lazy: NumPy and the data stack load after --help (see the module's note)
    from mpidl.train.checkpoint import CheckpointError, load_checkpoint
    from mpidl.train.model import build_model, load_model_state

    check_model(run.config)
    model = build_model(run.config, description).to(xp)
    try:
        state = load_checkpoint(run.checkpoint, state="model")  # no optimizer state
    except CheckpointError as e:  # only a --checkpoint: the run's own newest one loaded
        raise CheckpointError(f"{e}; name another with --checkpoint, or leave it out for the "
                              "run's newest checkpoint that loads") from None
    load_model_state(model, state, run.config, doing)
    return model.eval(), state


def _test_split(data_dir: str, comm: Any, config: Any) -> tuple[Any, Any]:
    """The test split and the run's objective (what scoring it reads and computes)."""
    # lazy: NumPy and the data stack load after --help (see the module's note)
    from mpidl.data import DataError, ShardedDataset
    from mpidl.train.objective import objective_for

    test = ShardedDataset(os.path.join(data_dir, "test"), comm=comm)
    objective = objective_for(config, test)
    missing = [name for name in objective.features if name not in test.features]
    if missing:
        reads = " and ".join(repr(n) for n in objective.features)
        raise DataError(f"dataset {test.path} has features {sorted(test.features)}, but "
                        f"evaluation reads {reads} ('x' inputs, 'y' labels or targets): write "
                        f"the split with those names (missing: {', '.join(missing)})")
    return test, objective


def _eval_description(run: TrainedRun, data_dir: str, test: Any) -> Any:
    """What the model is built from to score ``test``: the run's dataset.json; for older
    runs, the train split beside ``test``, or ``test`` itself when that is gone. Checked
    to agree with ``test`` (features, vocabulary, classes): the model must read the test
    split as it read its training data. Not collective."""
    # lazy: NumPy and the data stack load after --help (see the module's note)
    from mpidl.data.format import MANIFEST_NAME
    from mpidl.data.splits import check_splits_agree

    described = os.path.exists(run.description_file)
    if described or os.path.isfile(os.path.join(data_dir, "train", MANIFEST_NAME)):
        description = run_description(run, data_dir)
    else:
        description = test
    check_splits_agree({description.path: description.manifest, test.path: test.manifest})
    return description


def _shown(value: float) -> str:
    return "-" if value != value else f"{value:.4f}"  # NaN: undefined (no samples)


def format_confusion(scores: Any, names: Sequence[str]) -> str:
    """The confusion matrix as a table: rows the true class, columns the predicted one,
    and each class's recall; or a line saying why it is not shown."""
    k = scores.num_classes
    if scores.confusion is None or k > MAX_SHOWN_CLASSES:
        return (f"confusion matrix: {k} classes, more than the {MAX_SHOWN_CLASSES} shown here "
                "(--json has the recall per class" +
                (" and the matrix)" if scores.confusion is not None else ")"))
    short = [n if len(n) <= 16 else n[:15] + "~" for n in names]
    rows = [[name, *map(int, counts), _shown(recall)]
            for name, counts, recall in zip(short, scores.confusion, scores.recall)]
    return format_table(["true \\ predicted", *short, "recall"], rows,
                        title="confusion matrix (rows: true class, columns: predicted class):")


def _json(obj: dict[str, Any]) -> str:
    """Strict JSON, as metrics.jsonl: a score that is not finite (a diverged model) is null."""
    # lazy: NumPy and the data stack load after --help (see the module's note)
    from mpidl.train.metrics import jsonable

    return json.dumps(jsonable(obj), allow_nan=False)


def report(scores: Any, names: Sequence[str], state: Any, as_json: bool) -> str:
    """What ``mpidl eval`` prints for ``scores`` of the checkpoint ``state``."""
    if as_json:
        return _json({"checkpoint": state.path, "step": state.step,
                      "test_samples": scores.samples, "classes": list(names),
                      **scores.as_record(),
                      "confusion": None if scores.confusion is None
                      else scores.confusion.tolist()})
    majority = scores.majority_class
    always = f" (always {names[majority]!r})" if majority is not None else ""
    return (f"checkpoint: {state.path} (step {state.step})\n"
            f"test samples: {scores.samples}\n"
            f"test loss: {_shown(scores.loss)}\n"
            f"test accuracy: {_shown(scores.accuracy)}\n"
            f"macro-F1: {_shown(scores.macro_f1)}\n"
            f"majority-class accuracy: {_shown(scores.majority_accuracy)}{always}\n\n"
            + format_confusion(scores, names))


def run_parser(prog: str, description: str, epilog: str) -> Any:
    """The argument parser of a command on a run: ``RUN_DIR`` and ``--checkpoint``."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory written by `mpidl train`")
    parser.add_argument("--checkpoint", help="a checkpoint file (default: the run's latest)")
    return parser


def eval_main(argv: Sequence[str]) -> int:
    """``mpidl eval RUN_DIR [--checkpoint PATH] [--data DIR] [--json]``. Collective."""
    parser = run_parser("mpidl eval", "Evaluate a run's checkpoint exactly on a test split.",
                        __doc__.split("Each builds")[0])
    parser.add_argument("--data", help="a dataset directory with a test/ split "
                                       "(default: the run's own data)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(list(argv))

    # lazy: NumPy and the data stack load after --help (see the module's note)
    from mpidl.train.evaluation import evaluate, evaluation_loader
    from mpidl.train.objective import objective_for
    from mpidl.train.task import prepare_data

    comm, prog = world(), "mpidl eval"
    try:
        run = agreed(comm, prog, lambda: open_run(args.run_dir, args.checkpoint, args.data))
        data_dir = prepare_data(run.config, comm, Logger(comm.rank, comm.size, sys.stderr))
        test, objective = agreed(comm, prog, lambda: _test_split(data_dir, comm, run.config))
        description = agreed(comm, prog, lambda: _eval_description(run, data_dir, test))
        # scored as in training: a regression's standard units are the train split's
        objective = objective_for(run.config, description)
        xp = devices(run.config, comm)
        model, state = agreed(comm, prog, lambda: load_model(run, description, xp, "evaluate"))
    except Refused:
        return EXIT_CONFIG
    loader = evaluation_loader(test, comm, xp, run.config.data.prefetch, objective.features)
    result = evaluate(objective, model, loader, comm)
    if comm.rank != 0:
        return 0
    if result.scores is not None:  # a classifier: the confusion matrix, by class name
        names = [description.class_name(c) for c in range(result.scores.num_classes)]
        print(report(result.scores, names, state, args.json), flush=True)
    else:  # regression, a language model
        print(_json({"checkpoint": state.path, "step": state.step, **result.record})
              if args.json else f"checkpoint: {state.path} (step {state.step})\n{result.line}",
              flush=True)
    return 0
