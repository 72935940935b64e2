"""A small data-parallel training step, for counting the host synchronisations of a step.

``python -m hpc.gpu_check`` imports :func:`build` by name (``--sync-step``; hpc does not
depend on mpidl) and counts how often the host waits for the GPU in each phase it
returns. The model touches every path the GPU review found syncing: an embedding with
padding, an embedding bag (row-sparse exchange), attention with a host padding mask,
dropout, cross-entropy with host labels, DataParallel buckets and Adam.

Phases:

- ``"forward+backward"``: under ``no_sync()``, so no communication: nothing in it needs
  the host to wait for the GPU, and :data:`EXPECTED_SYNCS` says so.
- ``"step"``: forward, backward with the gradient exchange, optimizer step. Its blocking
  collectives wait for their data (MPI is driven by the host), and the sparse exchange
  reads one count per table; the count is reported, not judged.
- ``"budget step"``: a step of ``mpidl train gpt --backend=cupy`` (:func:`budget_step`),
  judged against the host-read budget of docs/testing.md ("Device budgets"): at most 2
  waits a step outside the exchange and the open sites (:func:`judged`), the budget that
  tests/unit/test_device_budgets.py holds on the fake device.

On NumPy the same phases run (a host has nothing to wait for).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy

EXPECTED_SYNCS = {"forward+backward": 0, "budget step": 2}
# The budget step's host reads besides its budget, and the exchange's waits (blocking
# collectives wait for their data): counted, not judged (docs/testing.md, "Device
# budgets": tests/unit/test_device_budgets.py holds the same on the fake device).
NOT_JUDGED = ("train/objective.py", "parallel/sparse.py", "comm/", "parallel/buckets.py",
              "parallel/zero_gather.py", "parallel/pipeline_messages.py",
              "parallel/transport.py", "parallel/overlap.py", "parallel/agreement.py")


def judged(sites: list[str]) -> list[str]:
    """The host waits of ``sites`` (``hpc.gpu_check.SyncCounter``'s) that a budget
    counts: those outside :data:`NOT_JUDGED`."""
    return [s for s in sites if not s.startswith(NOT_JUDGED)]

VOCAB, DIM, HEADS, CLASSES, BATCH, LENGTH = 2000, 32, 2, 3, 8, 16


def _model() -> Any:
    from mpidl import functions as F
    from mpidl.nn import Dropout, Embedding, EmbeddingBag, Linear, Module, \
        TransformerEncoderLayer

    class Probe(Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = Embedding(VOCAB, DIM, seed=1)
            self.bag = EmbeddingBag(VOCAB, DIM, padding_idx=0, seed=2)
            self.layer = TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.1, seed=3)
            self.drop = Dropout(0.1, seed=4)
            self.head = Linear(DIM, CLASSES, seed=5)

        def forward(self, ids: Any, mask: Any) -> Any:
            h = F.embedding(ids, self.emb.weight, padding_idx=0)  # (B, T, D)
            h = self.layer(h, mask=mask)
            pooled = F.add(F.mean(h, axis=1), self.bag(ids))  # (B, D)
            return self.head(self.drop(pooled))

    return Probe()


def build(xp: Any = None, comm: Any = None, seed: int = 0) -> dict[str, Callable[[], None]]:
    """The phases of one step on ``xp`` (cupy by default) over ``comm`` (the world).

    Collective over ``comm``: DataParallel is built here, and every rank must run the
    phases in the same order. Each call of a phase draws a fresh host batch.
    """
    from mpidl import functions as F
    from mpidl.backend import get_xp, is_cupy
    from mpidl.comm import world
    from mpidl.optim import Adam
    from mpidl.parallel import DataParallel

    xp = get_xp("cupy") if xp is None else xp
    comm = world() if comm is None else comm
    model = _model().to(xp)
    dp = DataParallel(model, comm)
    opt = Adam(model.parameters(), lr=1e-3)
    rng = numpy.random.default_rng(seed + comm.rank)

    def batch() -> tuple:
        ids = rng.integers(1, VOCAB, size=(BATCH, LENGTH))
        ids[:, LENGTH - 3:] = 0  # padding
        mask = (ids != 0)[:, None, None, :]  # (B, 1, 1, T), on the host
        labels = rng.integers(0, CLASSES, size=BATCH)
        return ids, mask, labels

    def forward_backward() -> None:
        ids, mask, labels = batch()
        with dp.no_sync():
            loss = F.softmax_cross_entropy(dp(ids, mask), labels, reduction="sum")
            dp.backward(loss, global_count=BATCH * comm.size)
        opt.zero_grad()

    def step() -> None:
        ids, mask, labels = batch()
        loss = F.softmax_cross_entropy(dp(ids, mask), labels, reduction="sum")
        dp.backward(loss, global_count=BATCH * comm.size)
        opt.step()
        opt.zero_grad()

    phases = {"forward+backward": forward_backward, "step": step}
    if is_cupy(xp):  # mpidl train's step on the device
        phases.update(budget_step(comm))
    return phases


def budget_step(comm: Any, preset: str = "gpt") -> dict[str, Callable[[], None]]:
    """``"budget step"``: a training step of ``mpidl train PRESET --backend=cupy`` (a
    64-sample corpus in a temporary folder) over ``comm``, whose host waits the budget
    of docs/testing.md bounds. Collective."""
    import atexit
    import shutil
    import tempfile

    from mpidl.train.build import build_run
    from mpidl.train.config import load_config
    from mpidl.train.log import Logger
    from mpidl.train.step import TrainStep
    from mpidl.train.task import prepare_data

    tmp = comm.bcast_obj(tempfile.mkdtemp(prefix="mpidl-budget-") if comm.rank == 0
                         else None)
    if comm.rank == 0:
        atexit.register(shutil.rmtree, tmp, True)
    config = load_config(preset, ["--data.num-train=64", "--data.num-test=16",
                                  f"--data.cache-dir={tmp}", "--backend=cupy",
                                  "--global-batch=16", "--steps=1000"])
    log = Logger(comm.rank, comm.size)
    run = build_run(config, comm, prepare_data(config, comm, log), log)
    train = TrainStep(run, log)
    state = {"batches": iter(()), "step": 0}

    def step() -> None:
        batch = next(state["batches"], None)
        if batch is None:
            state["batches"] = iter(run.loader)
            batch = next(state["batches"])
        x, y, n = batch[0], batch[1] if len(batch) > 2 else None, batch[-1]
        train(x, y, n, state["step"])
        state["step"] += 1

    return {"budget step": step}


__all__ = ["build", "budget_step", "judged", "EXPECTED_SYNCS", "NOT_JUDGED"]
