"""PowerSGD's state in a checkpoint: the step count, the warm-start Qs, the errors.

Records of the group ``"compression"`` (:mod:`mpidl.parallel.holdings`), named after the
parameter each belongs to, so one checkpoint format holds them beside the model:

- ``compression:NAME:q``, (m, r): the same on every rank, rank 0 writes it;
- ``compression:NAME:error``, (ranks, *shape): row k is rank k's error feedback, each
  rank writes its own row;
- ``compression::step``: exchanges done (uncompressed ones too).

At the same number of ranks every rank reads its own row back: resuming continues bit
for bit. At another number the rows no longer belong to anyone; every quantity PowerSGD
computes depends on the errors only through their sum over the ranks (see
:mod:`mpidl.parallel.powersgd`), so each new rank takes the sum divided by the new
count: the same training up to rounding. A checkpoint without these records (written
uncompressed) leaves the state fresh: zero errors, new Qs, the step count kept at 0.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy

from mpidl.backend import get_array_module, to_device
from mpidl.parallel.holdings import Held, HeldInt, Key, runs_array, whole
from mpidl.parallel.data import DataParallel
from mpidl.parallel.powersgd import PowerSGDTransport

GROUP = "compression"
STEP = Key(GROUP, "", "step")


class PowerSGDState:
    """The records of ``transport``, whose buckets hold ``names`` (per bucket, its
    members' parameter names, in bucket order). Not collective."""

    def __init__(self, transport: PowerSGDTransport, names: Sequence[Sequence[str]]) -> None:
        self.transport = transport
        self.names = [list(n) for n in names]

    def holdings(self) -> tuple[list[Held], list[HeldInt]]:
        t, comm = self.transport, self.transport.comm
        held: list[Held] = []
        for i, plan in enumerate(t.plans):
            flat = t._flats[i] if t._flats else None
            dtype = numpy.dtype(flat.dtype) if flat is not None else numpy.dtype("float64")
            for k in plan.matrices:
                name = self.names[i][k.index]
                held.append(Held(Key(GROUP, name, "q"), (k.m, k.rank), dtype, whole((k.m, k.rank)),
                                 read=lambda k=k: k.q, write=self._set_q(k, flat),
                                 owner=comm.rank == 0))
                count = k.n * k.m
                held.append(Held(Key(GROUP, name, "error"), (comm.size, k.n, k.m), dtype,
                                 runs_array([(comm.rank * count, count)]),
                                 read=self._read_error(i, k), write=self._set_error(i, k)))
        ints = [HeldInt(STEP, read=lambda: t.step, write=self._set_step,
                        owner=comm.rank == 0)]
        return held, ints

    def load(self, source: Any, load: Any) -> int:
        """Set the state from ``source`` (a :class:`~mpidl.train.pieces.Source`) with
        ``load`` (:func:`~mpidl.train.pieces.load`); errors saved at another number of
        ranks are summed and shared out. Returns the elements read. Not collective."""
        held, ints = self.holdings()
        same, other = [], []
        for h in held:
            saved = source.keys.get(h.key)
            if saved is not None and h.key.array == "error" and tuple(saved[0]) != h.shape:
                other.append(h)
            else:
                same.append(h)
        read = load(source, same, ints, GROUP)
        size = self.transport.comm.size
        from mpidl.train.pieces import assemble  # here: the parallel layer reads no files

        for h in other:
            rows = assemble(source, h.key)  # (old ranks, n, m)
            if tuple(rows.shape[1:]) != h.shape[1:]:
                raise ValueError(f"{h.key.path()} has shape {rows.shape[1:]} in checkpoint "
                                 f"{source.path}, {h.shape[1:]} in the model")
            h.write((rows.astype(numpy.float64).sum(axis=0) / size).astype(h.dtype).reshape(-1))
            read += rows.size
        return read

    # -- the accessors ---------------------------------------------------------------------------
    def _set_q(self, k: Any, flat: Any) -> Any:
        def write(values: numpy.ndarray) -> None:
            xp = get_array_module(flat) if flat is not None else numpy
            k.q = to_device(values.reshape(k.m, k.rank).copy(), xp)
        return write

    def _read_error(self, i: int, k: Any) -> Any:
        def read() -> Any:
            e = self.transport.errors[i]
            return None if e is None else e[k.start:k.start + k.n * k.m]
        return read

    def _set_error(self, i: int, k: Any) -> Any:
        def write(values: numpy.ndarray) -> None:
            flat = self.transport._flats[i]
            e = self.transport._error(i, flat)
            e[k.start:k.start + k.n * k.m] = to_device(values, get_array_module(flat))
        return write

    def _set_step(self, value: int) -> None:
        self.transport.steps = [int(value)] * len(self.transport.steps)


def powersgd_state(wrapper: Any) -> PowerSGDState | None:
    """The PowerSGD state of a DataParallel ``wrapper``, or None when it has none."""
    if not isinstance(wrapper, DataParallel) or \
            not isinstance(wrapper.transport, PowerSGDTransport):
        return None
    transport = wrapper.transport
    names = {id(p): n for n, p in wrapper.named}
    buckets = wrapper.buckets + wrapper.table_buckets
    return PowerSGDState(transport, [[names[id(p)] for p in b.params] for b in buckets])


__all__ = ["PowerSGDState", "powersgd_state"]
