"""``mpidl predict``: classify new inputs with a run's checkpoint.

Run::

    echo "The staff was wonderful." | mpidl predict runs/reviews
    mpidl predict runs/reviews reviews.txt --json      # one input per line
    mpiexec -n 4 mpidl predict runs/dense rows.npz     # feature rows: 'x', or the only array
    mpidl predict runs/dense rows.h5 --batch 1024

Inputs (``INPUT``):

- a text file, one input per line (UTF-8; output line ``i`` answers input line ``i``,
  so a blank line, which has nothing to classify, is refused), or ``-`` / nothing for
  standard input, which rank 0 reads once and shares. Under ``mpiexec`` pass a file
  rather than piping into the launcher: Open MPI 5's ``prterun`` never forwards its
  standard input (PRRTE #2373, seen with 5.0.11; refused at once, see
  :func:`hpc.env.stdin_problem`) and may duplicate parts of inputs over 64 KB (PRRTE
  #2579, 5.0.8). Each line is encoded exactly as ``mpidl shard`` encoded the training texts:
  the same tokenizer, vocabulary and length, from the run's ``dataset.json``
  (:mod:`mpidl.data.description`), so predicting needs no dataset;
- an ``.npz`` or ``.h5``/``.hdf5`` file of rows: the array ``x`` (the model's input
  feature), or the file's only array; each row of the shape the model was trained on,
  its values finite (NaN or infinity is refused, naming the row).

Output (rank 0, in input order): one line per input, the label and its probability
(softmax), tab-separated; with ``--json`` one JSON object per line,
``{"index": 0, "label": "positive", "probability": 0.97, "probabilities": {...}}``.
No input is an error (exit 2), as is a row whose scores are not finite (values far
beyond the training data's: named when its round is scored, before its lines are
written). The predicted label is the argmax of the scores, the same
rule as ``mpidl eval``'s (:func:`~mpidl.data.evaluate.predicted_classes`). A regression
run (float targets) writes its predicted values instead, tab-separated, or
``{"index": 0, "prediction": [0.12, -0.5], "targets": ["t1", "t2"]}`` (``targets``: the
target names, when the dataset stored them). A language model (``gpt``) has no
per-input answer to give: refused (exit 2), ``mpidl eval`` scores it.

On several ranks the inputs go in rounds of ``--batch`` per rank, each round split
over the ranks by :func:`~mpidl.comm.split_counts`; rank 0 gathers a round's scores
and writes its lines before the next round, so output starts early and memory stays
bounded. The model is built as for ``mpidl eval`` (:mod:`mpidl.train.inference`): no
optimizer, no data-parallel wrapper, no dataset.

Exit codes (the same on every rank; docs/exit-status.md): 0 done; 2 a missing run
directory or checkpoint, a corrupt one, an unreadable, empty or blank input, rows of the
wrong shape or not finite (one message, from rank 0, naming the file, the value and the
fix); 1 any other error.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

import numpy

from hpc.argtypes import positive_int
from mpidl.backend import as_numpy, to_device
from mpidl.comm import split_counts, world
from mpidl.train.inference import (EXIT_CONFIG, Refused, agreed, devices, load_model, open_run,
                                   run_description, run_parser)
from mpidl.train.predict_inputs import STDIN, read_inputs

# The engine and the data stack are imported inside the functions that use them, each
# marked "lazy", as in mpidl.train.inference: `mpidl predict --help` and a usage error
# answer before the data stack (h5py) and the engine load. None of them imports this
# module: no cycle hides here. (mpidl.train.predict_inputs loads its own the same way.)
# The modules above add only NumPy.

def format_line(index: int, probabilities: numpy.ndarray, label: int, names: Sequence[str],
                as_json: bool) -> str:
    """One output line: ``label<TAB>probability``, or its JSON object."""
    if not as_json:
        return f"{names[label]}\t{float(probabilities[label]):.4f}"
    return json.dumps({"index": index, "label": names[label],
                       "probability": float(probabilities[label]),
                       "probabilities": {n: float(p) for n, p in zip(names, probabilities)}},
                      allow_nan=False)


def format_values(index: int, values: numpy.ndarray, names: Sequence[str] | None,
                  as_json: bool) -> str:
    """One output line of a regression run: the predicted values, or their JSON object."""
    if not as_json:
        return "\t".join(f"{float(v):.6g}" for v in values)
    return json.dumps({"index": index, "prediction": [float(v) for v in values],
                       **({"targets": list(names)} if names else {})}, allow_nan=False)


def predict(model: Any, inputs: Any, comm: Any, xp: Any, batch: int,
            write: Any) -> None:
    """Score every input in rounds of ``batch`` per rank; call ``write(start, logits)``
    on rank 0 with each round's ``(rows, classes)`` host scores, in input order, until
    it returns False (the output was closed). Collective.

    Raises:
        DataError: on every rank alike (each checks the same gathered scores), before a
            round is written, when an input's scores are not finite.
    """
    # lazy: the engine and the data stack load after --help (see the module's note)
    from mpidl.autograd import no_grad
    from mpidl.data import DataError

    n, per_round = len(inputs), batch * comm.size
    for start in range(0, n, per_round):
        counts = split_counts(min(per_round, n - start), comm.size)
        first = start + sum(counts[:comm.rank])
        x = to_device(inputs.rows(first, first + counts[comm.rank]), xp)
        with no_grad():
            logits = as_numpy(model(x).data)
        gathered = comm.allgatherv(numpy.ascontiguousarray(logits))  # rank order = input order
        finite = numpy.isfinite(gathered.reshape(len(gathered), -1)).all(axis=1)
        if not finite.all():
            i = start + int(numpy.flatnonzero(~finite)[0])
            raise DataError(f"input {i}, {inputs.where(i)}: the model's scores for it are not "
                            "finite, its values being far beyond the training data's "
                            f"({int((~finite).sum())} such input(s) among inputs {start}-"
                            f"{start + len(gathered) - 1}): check or drop it")
        closed = comm.rank == 0 and not write(start, gathered)
        if comm.agree_each(closed)[0]:
            break


def _objective(run: Any, description: Any) -> Any:
    """The run's objective (classification or regression); a language model refused."""
    # lazy: the engine and the data stack load after --help (see the module's note)
    from mpidl.data import DataError
    from mpidl.train.objective import LanguageModel, objective_for

    objective = objective_for(run.config, description)
    if isinstance(objective, LanguageModel):
        raise DataError(f"{run.run_dir} is a language model ({run.config.model.name!r}): it "
                        "continues sequences, it has no label or value per input to "
                        f"predict; score it with `mpidl eval {run.run_dir}` (test loss and "
                        "perplexity)")
    return objective


def main(argv: Sequence[str]) -> int:
    """``mpidl predict RUN_DIR [INPUT] [--checkpoint PATH] [--json] [--batch N]``. Collective."""
    parser = run_parser("mpidl predict", "Classify new inputs with a run's checkpoint.",
                        __doc__.split("Output (rank 0")[0])
    parser.add_argument("input", nargs="?", default=STDIN,
                        help="a text file (one input per line), - for standard input (the "
                             "default), or an .npz/.h5 file of feature rows")
    parser.add_argument("--json", action="store_true", help="one JSON object per input")
    parser.add_argument("--batch", type=positive_int, default=256,
                        help="inputs scored at a time on each rank (256)")
    parser.add_argument("--data", help="the dataset the run was trained on, for runs without "
                                       "a dataset.json (older mpidl); otherwise unused")
    # Intermixed: `RUN_DIR --checkpoint=C INPUT` leaves INPUT to the optional positional.
    args = parser.parse_intermixed_args(list(argv))

    # lazy: the engine and the data stack load after --help (see the module's note)
    from mpidl import functions as F
    from mpidl.autograd import no_grad
    from mpidl.data.evaluate import predicted_classes

    comm, prog = world(), "mpidl predict"
    try:
        run = agreed(comm, prog, lambda: open_run(args.run_dir, args.checkpoint, args.data))
        description = agreed(comm, prog, lambda: run_description(run, args.data))
        objective = agreed(comm, prog, lambda: _objective(run, description))
        xp = devices(run.config, comm)
        model, _ = agreed(comm, prog, lambda: load_model(run, description, xp, "predict with"))
        inputs = agreed(comm, prog, lambda: read_inputs(args.input, description, comm))
    except Refused:
        return EXIT_CONFIG

    # lazy: the engine and the data stack load after --help (see the module's note)
    from mpidl.train.objective import Regression

    def lines(start: int, logits: numpy.ndarray) -> list[str]:
        if isinstance(objective, Regression):
            names = description.metadata.get("targets")
            return [format_values(start + i, v, names, args.json)
                    for i, v in enumerate(logits.reshape(len(logits), -1))]
        with no_grad():
            probabilities = F.softmax(logits).data
        labels = predicted_classes(logits)
        names = [description.class_name(c) for c in range(logits.shape[1])]
        return [format_line(start + i, p, int(label), names, args.json)
                for i, (p, label) in enumerate(zip(probabilities, labels))]

    def write(start: int, logits: numpy.ndarray) -> bool:
        try:
            sys.stdout.write("".join(line + "\n" for line in lines(start, logits)))
            sys.stdout.flush()
        except BrokenPipeError:
            # The reader left (`| head`): stop quietly, as command-line tools do. Standard
            # output goes to /dev/null so that the interpreter's last flush cannot fail.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return False
        return True

    # The scores are checked for finiteness above; NumPy's overflow warnings on the way
    # there would only repeat that, on every rank.
    with numpy.errstate(over="ignore", invalid="ignore", divide="ignore"):
        try:
            agreed(comm, prog, lambda: predict(model, inputs, comm, xp, args.batch, write))
        except Refused:
            return EXIT_CONFIG
    return 0
