"""``mpidl train gpt --precision fp16|bf16`` on a split model equals one rank: tensor=2,
the three sequence modes (Megatron-SP, Ulysses, ring) and pipeline=2, on thread ranks in
this process (the whole command: build, step, checkpoint). The masters stay fp32 (a
loss-scale overflow under a pipeline: tests/unit/test_precision_train.py).

Not bit for bit, as data parallelism in half precision is not
(tests/unit/test_mixed_precision_ranks.py): a row-parallel layer's partial sums are
added in float32 and rounded once, where one rank rounds its one GEMM's sum; from a
master that differs in its last bits the forwards differ by half ulps. So the fp32
masters' distance from one rank's (2-norm over every parameter) is held to a fraction
of how far training moved them (TOLERANCE). Each run is 3 steps of a tiny gpt (under a
second on 2 thread ranks; 15 s for the file on the shared 2-core machine).
"""
from __future__ import annotations

import os

import numpy
import pytest

from mpidl.testing import run_ranks
from mpidl.train import latest_checkpoint, load_checkpoint
from mpidl.train.command import _train
from mpidl.train.signals import PreemptionFlag

# SGD with momentum: Adam's normalised step turns a change of sign of a near-zero
# gradient into a whole step (test_mixed_precision_ranks). 2 microbatches a step, the
# pipeline's split, on every layout.
TINY = ["gpt", "--data.num-train=48", "--data.num-test=8", "--global-batch=8",
        "--steps=3", "--epochs=1", "--progress=never", "--keep-freed-memory=false",
        "--model.layers=2", "--model.dim=16", "--model.heads=2", "--data.seq-len=8",
        "--optimizer=sgd", "--lr=0.5", "--momentum=0.5", "--microbatches=2",
        "--checkpoint-epochs=false"]
LAYOUTS = {
    "tensor": ["--tensor-parallel=2"],
    "megatron-sp": ["--tensor-parallel=2", "--megatron-sequence-parallel"],
    "ulysses": ["--sequence-parallel=ulysses"],
    "ring": ["--sequence-parallel=ring"],
    "pipeline": ["--pipeline-parallel=2"],
}
# |masters(2 ranks) - masters(1 rank)| / |masters(1 rank) - start|, measured here (3 SGD
# steps): fp16 0.0004-0.0015, bf16 0.003-0.014 (tensor and Megatron-SP the most: their
# row-parallel sums); the bounds of test_mixed_precision_ranks.
TOLERANCE = {"fp16": 0.01, "bf16": 0.06}
HALF = {"fp16": "float16", "bf16": "bfloat16"}


def masters(tmp, ranks, name, *args):
    """The fp32 masters (by the single-rank parameter names) and the half parameters of
    the last checkpoint of ``mpidl train`` on ``ranks`` thread ranks with ``args``."""
    argv = [*TINY, f"--data.cache-dir={tmp / 'cache'}", f"--run-dir={tmp / name}", *args]
    assert run_ranks(ranks, lambda comm: _train(argv, comm, PreemptionFlag(None))) \
        == [0] * ranks
    found = load_checkpoint(latest_checkpoint(os.path.join(tmp / name, "checkpoints")))
    kept = {key: value for key, value in found.optimizer.items() if key.endswith(".master")}
    return kept, found.model


def distance(a, b):
    return float(numpy.sqrt(sum(float(((a[k] - b[k]).astype(numpy.float64) ** 2).sum())
                                for k in a)))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Per precision: one rank's masters after the steps and before them (a rate of
    1e-30: --lr must be > 0)."""
    tmp = tmp_path_factory.mktemp("precision")
    return tmp, {half: (masters(tmp, 1, f"one-{half}", f"--precision={half}"),
                        masters(tmp, 1, f"start-{half}", f"--precision={half}",
                                "--lr=1e-30"))
                 for half in TOLERANCE}


@pytest.mark.parametrize("half", sorted(TOLERANCE))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_half_precision_on_a_split_model_equals_one_rank(one_rank, layout, half):
    tmp, reference = one_rank
    (want, _), (start, _) = reference[half]
    got, model = masters(tmp, 2, f"{layout}-{half}", f"--precision={half}", *LAYOUTS[layout])
    assert sorted(got) == sorted(want) and len(got) == len(model)
    # The masters stay fp32; the model trains in the half dtype.
    assert all(value.dtype == numpy.float32 for value in got.values())
    assert {value.dtype.name for value in model.values()} == {HALF[half]}
    moved = distance(want, start)
    assert moved > 0.1  # it trained: a test that moved nothing would pass
    assert distance(got, want) <= TOLERANCE[half] * moved, distance(got, want) / moved
