"""Convolutions and the convolutional reference models: mpidl's engine against PyTorch CPU.

Cases (float32, one thread, synthetic pre-generated inputs):

- ``conv2d``: forward + backward (input and weight gradients) of the reference cnn's
  second layer: 64 x 32 x 14 x 14 -> 64 channels, 3x3, padding 1.
- ``conv3d``: the cosmoflow model's second layer: 8 x 32 x 16^3 -> 64 channels, 2^3,
  padding 'same'.
- ``cnn``: a training step of ``mpidl.models.cnn`` (1 x 28 x 28 -> 10 classes, batch 64):
  ``zero_grad`` + forward + softmax cross-entropy + backward + SGD step (lr 0.01).
- ``cosmoflow``: a training step of ``mpidl.models.cosmoflow`` (4 x 32^3 -> 4 targets,
  batch 8, the MLPerf reference's local batch is 4): mean squared error, SGD.

PyTorch runs the same architectures (its own Conv/BatchNorm/pool layers, default
initialisation), in mpidl's order: max pooling before the activation, the same function
as the usual activation-then-pool (a max commutes with a non-decreasing activation) and
cheaper in both engines. The protocol is ``engine.py``'s: one thread (``OMP_NUM_THREADS=1``,
threadpoolctl, ``torch.set_num_threads(1)``), a warm-up, timed windows, the median;
every (case, framework) pair in its own process, whose peak memory is its
``ru_maxrss`` growth from just before the model is built. The ratio is mpidl's
throughput over PyTorch's (above 1: mpidl is faster).

Run from the repository root::

    .venv/bin/python benchmarks/conv.py                         # all cases, both engines
    .venv/bin/python benchmarks/conv.py --cases cnn,cosmoflow --rounds 2
    .venv/bin/python benchmarks/conv.py --cases cosmoflow --profile --no-torch   # cProfile
    .venv/bin/python benchmarks/conv.py --malloc keep   # glibc keeps freed memory (both)
"""
from __future__ import annotations

import os

# Before numpy/torch load their thread pools: one thread per process, as the protocol says.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import Any, Callable  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import add_protocol_arguments, compare, measure, sgd_step  # noqa: E402

import numpy  # noqa: E402

# case -> batch, one sample's shape, and what a step is
CASES = {
    "conv2d": {"batch": 64, "shape": (32, 14, 14), "layer": (32, 64, 3, 1)},
    "conv3d": {"batch": 8, "shape": (32, 16, 16, 16), "layer": (32, 64, 2, "same")},
    "cnn": {"batch": 64, "shape": (1, 28, 28), "outputs": 10},
    "cosmoflow": {"batch": 8, "shape": (4, 32, 32, 32), "outputs": 4},
}
N_BATCHES = 4  # distinct pre-generated inputs, cycled


def make_batches(case: str, seed: int = 0,
                 count: int = N_BATCHES) -> list[tuple[numpy.ndarray, numpy.ndarray]]:
    """``count`` pre-generated (input, target) batches of ``case`` drawn from ``seed``."""
    c = CASES[case]
    rng = numpy.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.standard_normal((c["batch"],) + c["shape"]).astype(numpy.float32)
        if case == "cnn":
            y = rng.integers(0, c["outputs"], size=c["batch"])
        elif case == "cosmoflow":
            y = rng.uniform(-1, 1, size=(c["batch"], c["outputs"])).astype(numpy.float32)
        else:
            y = rng.standard_normal(1).astype(numpy.float32)  # unused
        out.append((x, y))
    return out


def mpidl_step(case: str) -> tuple[Callable[[Any], None], int]:
    import mpidl.models as models
    from mpidl import functions as F
    from mpidl.autograd import Tensor
    from mpidl.nn import Conv2d, Conv3d
    from mpidl.optim import SGD

    c = CASES[case]
    if case in ("conv2d", "conv3d"):
        cin, cout, k, pad = c["layer"]
        layer = (Conv2d if case == "conv2d" else Conv3d)(cin, cout, k, padding=pad, seed=0)

        def step(batch: Any) -> None:
            x = Tensor(batch[0], requires_grad=True)  # a middle layer: dx is needed
            layer.zero_grad()
            y = layer(x)
            y.backward(numpy.ones(y.shape, dtype=y.dtype))

        return step, layer.num_parameters()
    model = models.build(case, in_shape=c["shape"], outputs=c["outputs"], seed=0)
    loss_fn = F.softmax_cross_entropy if case == "cnn" else F.mean_squared_error
    return sgd_step(model, SGD(model.parameters(), lr=0.01), loss_fn), model.num_parameters()


def torch_model(case: str, batch_norm: bool = False) -> Any:
    """PyTorch's ``case`` model; ``batch_norm``: cosmoflow's (mpidl's ``batch_norm=True``),
    a bias-free convolution then ``BatchNorm3d`` in each block."""
    from torch import nn

    c = CASES[case]
    if case == "cnn":
        layers, cin = [], c["shape"][0]
        for width in (32, 64, 128):
            layers += [nn.Conv2d(cin, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                       nn.MaxPool2d(2), nn.ReLU()]  # mpidl's order: pool, then activation
            cin = width
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(cin, c["outputs"]))
    layers, cin, side = [], c["shape"][0], c["shape"][1]
    for i in range(3):  # the blocks mpidl's cosmoflow builds for a 32^3 input
        width = 32 * 2 ** i
        layers.append(nn.Conv3d(cin, width, 2, padding="same", bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm3d(width))
        layers += [nn.MaxPool3d(2), nn.LeakyReLU(0.3)]
        cin, side = width, side // 2
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(cin * side ** 3, 128),
                         nn.LeakyReLU(0.3), nn.Linear(128, 64), nn.LeakyReLU(0.3),
                         nn.Linear(64, c["outputs"]))


def torch_step(case: str) -> tuple[Callable[[Any], None], int]:
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="Using padding='same'")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    c = CASES[case]
    if case in ("conv2d", "conv3d"):
        cin, cout, k, pad = c["layer"]
        layer = (torch.nn.Conv2d if case == "conv2d" else torch.nn.Conv3d)(
            cin, cout, k, padding=pad)

        def step(batch: Any) -> None:
            x = batch[0].detach().requires_grad_()
            layer.zero_grad(set_to_none=True)
            y = layer(x)
            y.backward(torch.ones_like(y))

        return step, sum(p.numel() for p in layer.parameters())
    model = torch_model(case)
    loss_fn = torch.nn.functional.cross_entropy if case == "cnn" else \
        torch.nn.functional.mse_loss
    return sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn), \
        sum(p.numel() for p in model.parameters())


def worker(args: argparse.Namespace) -> dict:
    """Measure one (case, framework) pair in this process; returns the result record."""
    return measure("conv", args.case, make_batches(args.case), CASES[args.case]["batch"],
                   mpidl_step, torch_step, args, min_warmup_steps=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated subset of {','.join(CASES)}")
    add_protocol_arguments(p)
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: the worker's case
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    compare(p, args, __file__, "case", args.cases, CASES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
