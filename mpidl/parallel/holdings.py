"""What this rank holds of the single-rank model's state: typed records, element runs.

Every layout splits the single-rank state (each parameter, buffer and optimizer array)
differently: data parallelism holds it all on every rank, ZeRO a block of each flat
unit, tensor parallelism a slice along one axis, a grid with ZeRO a block of the
slices. A sharded checkpoint needs one description of all of them: a :class:`Held`
record per single-rank tensor this rank holds part of, naming the tensor by its
:class:`Key` and the elements by *runs*: ``(start, length)`` ranges of the full
tensor's flat C order, listed in the order this rank keeps them. Elements increase
along the runs in every layout we have (a slice of a C-ordered array along one axis, or
a contiguous block of one), which keeps overlaps a merge of two sorted lists.

::

    full (4, 6), split over 2 tensor ranks along axis 1 (3 columns each):
    rank 1 holds runs [(3, 3), (9, 3), (15, 3), (21, 3)]: elements 3-5, 9-11, ...

The records say which rank *writes* each piece (``owner``): replicated state is
written once (by one replica), so a checkpoint holds every element exactly once.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import numpy

from mpidl.backend import get_array_module, to_device

Runs = numpy.ndarray  # (k, 2) int64: start, length; starts increasing


class Key(NamedTuple):
    """One tensor of the single-rank state.

    ``Key("model", "blocks.0.attn.weight")`` a parameter or buffer;
    ``Key("optimizer", "blocks.0.attn.weight", "exp_avg")`` an optimizer array of it.
    """

    group: str
    name: str
    array: str = ""

    def path(self) -> str:
        """A readable label (error messages, listings): ``optimizer:NAME:exp_avg``."""
        return ":".join(p for p in self if p)


@dataclasses.dataclass
class Held:
    """This rank's part of one single-rank tensor.

    Attributes:
        key: which tensor.
        shape: the full tensor's shape; ``dtype``: the dtype this rank keeps it in.
        runs: the elements held, as runs of the full tensor's flat order, in local order.
        read: returns this rank's elements, flat, in local order (a view where it can).
        write: sets them from a flat host array of as many elements.
        owner: whether this rank writes them into a checkpoint (one replica does).
    """

    key: Key
    shape: tuple[int, ...]
    dtype: numpy.dtype
    runs: Runs
    read: Callable[[], Any]
    write: Callable[[numpy.ndarray], None]
    owner: bool = True

    @property
    def count(self) -> int:
        return int(self.runs[:, 1].sum()) if len(self.runs) else 0

    @property
    def bounds(self) -> tuple[int, int]:
        """``[first, last)``: the smallest range of full elements covering the runs."""
        if not len(self.runs):
            return 0, 0
        return int(self.runs[0, 0]), int(self.runs[-1, 0] + self.runs[-1, 1])


@dataclasses.dataclass
class HeldInt:
    """A per-parameter optimizer integer (Adam's step count) this rank keeps."""

    key: Key
    read: Callable[[], int | None]
    write: Callable[[int], None]
    owner: bool = True


# -- run arithmetic --------------------------------------------------------------------------

def runs_array(pairs: Sequence[tuple[int, int]] | numpy.ndarray) -> Runs:
    """``(start, length)`` pairs as a runs array; empty runs are dropped."""
    runs = numpy.asarray(pairs, dtype=numpy.int64).reshape(-1, 2)
    return runs[runs[:, 1] > 0]


def whole(shape: Sequence[int]) -> Runs:
    """The runs of a whole tensor: one, or none when it is empty."""
    return runs_array([(0, int(numpy.prod(shape, dtype=numpy.int64)))])


def merge(runs: Runs) -> Runs:
    """``runs`` with each run that starts where the one before ends joined to it."""
    runs = runs_array(runs)
    if len(runs) < 2:
        return runs
    joined = numpy.flatnonzero(runs[1:, 0] != runs[:-1, 0] + runs[:-1, 1]) + 1
    starts = numpy.concatenate([[0], joined])
    lengths = numpy.add.reduceat(runs[:, 1], starts)
    return numpy.stack([runs[starts, 0], lengths], axis=1)


def clip(runs: Runs, lo: int, hi: int) -> Runs:
    """The runs of local elements ``[lo, hi)`` (offsets in the local order of ``runs``)."""
    ends = numpy.cumsum(runs[:, 1])
    begins = ends - runs[:, 1]
    keep = (ends > lo) & (begins < hi)
    out = runs[keep].copy()
    if len(out):
        cut = lo - begins[keep][0]
        if cut > 0:
            out[0] += (cut, -cut)
        over = ends[keep][-1] - hi
        if over > 0:
            out[-1, 1] -= over
    return runs_array(out)


def overlap(mine: Runs, theirs: Runs) -> numpy.ndarray:
    """Where two run lists share elements: ``(k, 3)`` rows ``(my offset, their offset,
    length)``, offsets in each list's local order, increasing.

    Both lists' starts increase (module docstring), so this is one merge.
    """
    out = []
    i = j = 0
    my_off = their_off = 0
    while i < len(mine) and j < len(theirs):
        a0, an = int(mine[i, 0]), int(mine[i, 1])
        b0, bn = int(theirs[j, 0]), int(theirs[j, 1])
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if lo < hi:
            out.append((my_off + lo - a0, their_off + lo - b0, hi - lo))
        if a0 + an <= b0 + bn:
            my_off += an
            i += 1
        else:
            their_off += bn
            j += 1
    return numpy.asarray(out, dtype=numpy.int64).reshape(-1, 3)


# -- records of a parameter list: data parallelism, tensor parallelism ---------------------

def parameter_holdings(named: Sequence[tuple[str, Any]], buffers: Sequence[tuple[str, Any]],
                       optimizer: Any, runs_of: Callable[[Any, tuple], tuple[tuple, Runs]],
                       owner_of: Callable[[Any], bool], buffer_owner: bool
                       ) -> tuple[list[Held], list[HeldInt]]:
    """The records of a model whose every parameter is one array of this rank (whole,
    or a tensor-parallel slice) and an optimizer built over exactly those parameters.

    Args:
        named: ``(single-rank name, parameter)`` in the optimizer's order.
        buffers: ``(name, array)``, held whole.
        runs_of: ``(parameter, local shape)`` -> the full shape and the runs of the
            local elements (:func:`whole_runs` for a parameter held whole).
        owner_of: whether this rank writes a parameter (and its optimizer state).
        buffer_owner: whether this rank writes the buffers.
    """
    held: list[Held] = []
    ints: list[HeldInt] = []
    index = {id(p): i for i, p in enumerate(optimizer.params)} if optimizer is not None else {}
    for name, p in named:
        shape, runs = runs_of(p, tuple(p.data.shape))
        held.append(record(Key("model", name), shape, p.data.dtype, runs,
                           lambda create, p=p: p.data, owner_of(p)))
        if optimizer is None:
            continue
        i = index[id(p)]
        dtype = numpy.dtype(optimizer.state_dtype(p.data))
        for array in optimizer.state_arrays:
            held.append(record(Key("optimizer", name, array), shape, dtype, runs,
                               optimizer_state(optimizer, i, array, p.data.shape, dtype),
                               owner_of(p)))
        for integer in optimizer.state_ints:
            ints.append(optimizer_int(optimizer, i, Key("optimizer", name, integer), owner_of(p)))
    for name, b in buffers:
        held.append(record(Key("model", name), tuple(b.shape), b.dtype, whole(b.shape),
                           lambda create, b=b: b, buffer_owner))
    return held, ints


def whole_runs(p: Any, shape: tuple) -> tuple[tuple, Runs]:
    """``runs_of`` of a parameter held whole."""
    return shape, whole(shape)


def record(key: Key, shape: Sequence[int], dtype: Any, runs: Runs,
           get: Callable[[bool], Any], owner: bool) -> Held:
    """The record of the local array ``get(create)`` (None: not created yet; ``create``
    makes it), whose elements in C order are ``runs`` of the full tensor."""
    def read() -> Any:
        a = get(False)
        return None if a is None else a.reshape(-1)

    def write(values: numpy.ndarray) -> None:
        a = get(True)
        a[...] = to_device(values.reshape(a.shape), get_array_module(a))
    return Held(key, tuple(int(s) for s in shape), numpy.dtype(dtype), runs, read, write,
                owner)


def optimizer_state(optimizer: Any, i: int, array: str, shape: tuple, dtype: Any,
                    part: slice = slice(None)) -> Callable[[bool], Any]:
    """A getter of ``part`` of the optimizer's state array ``array`` of its parameter
    ``i`` (made of zeros on a write when the optimizer has none yet)."""
    def get(create: bool) -> Any:
        st = optimizer.state[i]
        if array not in st and create:
            xp = get_array_module(optimizer.params[i].data)
            st[array] = xp.zeros(shape, dtype=dtype)
        a = st.get(array)
        return None if a is None else a[part]
    return get


def optimizer_int(optimizer: Any, i: int, key: Key, owner: bool) -> HeldInt:
    """The record of the optimizer's integer ``key.array`` of its parameter ``i``; a
    load keeps the first value written (ZeRO: a unit's members agree)."""
    def write(value: int) -> None:
        optimizer.state[i].setdefault(key.array, int(value))
    return HeldInt(key, lambda: optimizer.state[i].get(key.array), write, owner)


def reset_optimizer(optimizer: Any, step: int, lr: float) -> None:
    """Empty the optimizer's state before records are loaded into it (a state the
    checkpoint does not have must not survive from before)."""
    optimizer.state = [{} for _ in optimizer.params]
    optimizer.step_count, optimizer.lr = int(step), float(lr)


__all__ = ["Key", "Held", "HeldInt", "runs_array", "whole", "whole_runs", "merge", "clip",
           "overlap", "record", "optimizer_state", "optimizer_int", "parameter_holdings",
           "reset_optimizer"]
