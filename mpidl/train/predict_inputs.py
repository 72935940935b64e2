"""What ``mpidl predict`` reads: text lines or feature rows, checked against the run.

:func:`read_inputs` takes ``INPUT`` (a text file, ``-`` for standard input, or an
``.npz``/``.h5`` file of rows; :mod:`mpidl.train.predict` documents the formats) and
returns inputs that the prediction loop slices a round at a time::

    inputs = read_inputs("reviews.txt", description, comm)   # collective
    x = inputs.rows(0, 256)            # encoded as `mpidl shard` encoded the training set
    inputs.where(17)                   # "line 18 ('The staff was...')": for error messages

Every problem is a :class:`~mpidl.data.DataError` that names the file, the line or row,
the value and the fix, raised on every rank alike.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Sequence

import numpy

from hpc.env import stdin_problem

# mpidl.data (and h5py) load inside the functions that read, each marked "lazy":
# `mpidl predict --help` and a usage error answer before the data stack loads
# (mpidl.train.predict imports this module at its top).

ARRAY_SUFFIXES = (".npz", ".h5", ".hdf5")
STDIN = "-"


class TextInputs:
    """Text lines, encoded for the run's model a slice at a time (on the rank scoring it)."""

    def __init__(self, lines: list[str], description: Any) -> None:
        description.encode_texts([])  # a dataset without text, another tokenizer: now
        self.lines, self.description = lines, description

    def __len__(self) -> int:
        return len(self.lines)

    def rows(self, start: int, stop: int) -> numpy.ndarray:
        return self.description.encode_texts(self.lines[start:stop])

    def where(self, index: int) -> str:
        return f"line {index + 1} ({self.lines[index][:40]!r})"


class ArrayInputs:
    """Feature rows already in memory, of the feature's shape and dtype."""

    def __init__(self, rows: numpy.ndarray) -> None:
        self.array = rows

    def __len__(self) -> int:
        return len(self.array)

    def rows(self, start: int, stop: int) -> numpy.ndarray:
        return self.array[start:stop]

    def where(self, index: int) -> str:
        return f"row {index} (largest |value| {float(numpy.abs(self.array[index]).max()):.3g})"


def _name(path: str) -> str:
    return "standard input" if path == STDIN else path


def _read_lines(path: str) -> list[str]:
    """The lines of ``path`` (``-``: standard input), without their line ends."""
    # lazy: the data stack loads after --help (see the module's note)
    from mpidl.data import DataError

    try:
        if path == STDIN:
            problem = stdin_problem()
            if problem:
                raise DataError(f"standard input does not reach rank 0: {problem}; pass the "
                                "inputs as a file: mpiexec -n N mpidl predict RUN_DIR "
                                "INPUTS.txt")
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
        text = data.decode("utf-8")
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e}); pass a text file with "
                        "one input per line, - for standard input, or an .npz/.h5 file of "
                        "feature rows") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{_name(path)}: not UTF-8 text (byte {e.start}: "
                        f"{data[e.start:e.start + 4]!r}); save it as UTF-8") from None
    lines = text.split("\n")
    if lines[-1] == "":  # the newline that ends the last line starts no input
        lines.pop()
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if not lines:
        raise DataError(f"{_name(path)} is empty: no input to classify; pass one input per "
                        "line")
    blank = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if blank:
        raise DataError(f"{_name(path)}: line {blank[0]} is blank ({len(blank)} blank "
                        f"line(s) of {len(lines)}); a blank line has nothing to classify, and "
                        "output line i answers input line i: remove the blank lines")
    return lines


def read_text(path: str, description: Any, comm: Any) -> TextInputs:
    """Rank 0 reads the lines (standard input reaches rank 0 only) and every rank gets
    them. Collective; raises the same DataError on every rank."""
    # lazy: the data stack loads after --help (see the module's note)
    from mpidl.data import DataError

    payload: Any = None
    if comm.rank == 0:
        try:
            payload = ("ok", _read_lines(path))
        except DataError as e:
            payload = ("error", str(e))
    status, value = comm.bcast_obj(payload)
    if status == "error":
        raise DataError(value)
    return TextInputs(value, description)


def _pick(names: Sequence[str], path: str) -> str:
    """The array of ``path`` that holds the rows: ``x``, or the only one."""
    # lazy: the data stack loads after --help (see the module's note)
    from mpidl.data import DataError

    if "x" in names:
        return "x"
    if len(names) == 1:
        return names[0]
    raise DataError(f"{path}: holds arrays {sorted(names)} but none named x; predict reads x "
                    "(or the file's only array): save the rows to classify as x")


def _load_rows(path: str) -> tuple[str, numpy.ndarray]:
    """The name and values of the array of rows in the .npz or HDF5 file ``path``."""
    # lazy: the data stack loads after --help (see the module's note)
    from mpidl.data import DataError, sources

    if path.lower().endswith(".npz"):
        splits = sources.load_npz(path)
        if set(splits) != {"train"}:
            raise DataError(f"{path}: holds train and test arrays ({', '.join(splits)}); "
                            "predict reads one array of rows: save the rows to classify as x")
        name = _pick(list(splits["train"]), path)
        return name, splits["train"][name]
    import h5py  # lazy: only an HDF5 input needs it (and h5py is heavier than NumPy)

    try:
        with h5py.File(path, "r", locking=False) as f:
            names = [k for k in f if f.get(k, getclass=True) is h5py.Dataset]
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be opened as HDF5 ({e})") from None
    if not names:
        raise DataError(f"{path}: holds no dataset at its root; predict reads the rows from "
                        "a dataset named x (or the file's only dataset)")
    name = _pick(names, path)
    # load_h5 reads only bytes stored in the file itself (no external links or storage).
    return name, sources.load_h5(path, [name])["train"][name]


def read_rows(path: str, description: Any) -> ArrayInputs:
    """The rows to classify from an .npz or HDF5 file, checked against the run's input
    feature (shape, dtype, token ids in the vocabulary) and cast to its dtype. Not
    collective (every rank reads the file)."""
    # lazy: the data stack loads after --help (see the module's note)
    from mpidl.data import DataError
    from mpidl.data.ranges import bad_rows, value_ranges

    name, rows = _load_rows(path)
    feature = description.features["x"]
    want = f"rows of shape {list(feature.shape)} ({feature.dtype.name})"
    if rows.ndim == 0 or tuple(rows.shape[1:]) != feature.shape:
        got = list(rows.shape[1:]) if rows.ndim else "a scalar"
        raise DataError(f"{path}: array {name!r} has rows of shape {got}, but the run's model "
                        f"reads {want}: pass {len(rows) if rows.ndim else 'the'} rows of that "
                        "shape (the features the run was trained on, in the same order)")
    if rows.dtype.kind not in "biuf" or not numpy.can_cast(rows.dtype, feature.dtype,
                                                           "same_kind"):
        raise DataError(f"{path}: array {name!r} has dtype {rows.dtype}, but the run's model "
                        f"reads {want}: convert it (e.g. token ids as integers)")
    if not len(rows):
        raise DataError(f"{path}: array {name!r} has no rows; pass at least one row to "
                        "classify")
    with numpy.errstate(over="ignore", invalid="ignore"):  # checked: _check_finite
        cast = numpy.ascontiguousarray(rows, dtype=feature.dtype)
    if cast.dtype.kind == "f":
        _check_finite(path, name, rows, cast, feature.dtype)
    limit = value_ranges(description.manifest).get("x")
    if limit is not None and rows.dtype.kind in "iu" and len(rows):
        bad = bad_rows(rows, limit.limit)
        if bad.size:
            raise DataError(f"{path}: row {bad[0]} of {name!r} holds a {limit.what} outside "
                            f"[0, {limit.limit}) ({limit.why}; {bad.size} bad rows): encode "
                            "the inputs with the run's vocabulary")
    return ArrayInputs(cast)


def _check_finite(path: str, name: str, rows: numpy.ndarray, cast: numpy.ndarray,
                  dtype: numpy.dtype) -> None:
    """DataError naming the first row of ``cast`` (``rows`` as the model reads them)
    that holds NaN or an infinity: the model's scores for it would be NaN."""
    # lazy: the data stack loads after --help (see the module's note)
    from mpidl.data import DataError

    bad = ~numpy.isfinite(cast.reshape(len(cast), -1)).all(axis=1)
    if not bad.any():
        return
    first = int(numpy.flatnonzero(bad)[0])
    at = [int(i) for i in numpy.unravel_index(
        int(numpy.flatnonzero(~numpy.isfinite(cast[first]))[0]), cast.shape[1:])]
    value = float(rows[first][tuple(at)])
    why = f", beyond {dtype.name}'s range," if math.isfinite(value) else ""
    raise DataError(f"{path}: row {first} of {name!r} holds {value:g}{why} at "
                    f"{'column ' + str(at[0]) if len(at) == 1 else 'index ' + str(at)} "
                    f"({int(bad.sum())} of {len(cast)} rows hold NaN or infinite values); the "
                    "model's scores for them would be NaN: replace them (numpy.nan_to_num) "
                    "or drop those rows")


def read_inputs(path: str, description: Any, comm: Any) -> Any:
    """The inputs at ``path``: feature rows for an .npz/.h5 file, else text lines.
    Collective; raises the same DataError on every rank."""
    if path != STDIN and path.lower().endswith(ARRAY_SUFFIXES):
        return read_rows(path, description)
    return read_text(path, description, comm)


__all__ = ["STDIN", "ARRAY_SUFFIXES", "TextInputs", "ArrayInputs", "read_inputs", "read_text",
           "read_rows"]
