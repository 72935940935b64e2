"""How gradients are compressed on the wire: the one place a choice is read and named.

``mpidl train --compression``, ``mpidl plan --compression``, :class:`DataParallel`'s
``compression`` and the planner all take the same values:

- ``none``: gradients travel in their own dtype;
- ``fp16`` / ``bf16`` (or ``float16`` / ``bfloat16``): 16 bits on the wire, summed in
  that format (:mod:`mpidl.parallel.compression`);
- ``powersgd:R``: a rank-R approximation of each gradient matrix with error feedback
  (:mod:`mpidl.parallel.powersgd`; Vogels, Karimireddy and Jaggi, "PowerSGD: Practical
  Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019).

:func:`parse_compression` turns a value into what the library passes around: None, a
wire dtype name, or a :class:`PowerSGDOptions`.
"""
from __future__ import annotations

import dataclasses
from typing import Union

CHOICES = "none, fp16, bf16 or powersgd:R (R >= 1, the rank of each gradient matrix's " \
          "approximation)"

_WIRE = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class PowerSGDOptions:
    """PowerSGD's settings, with PyTorch's names and defaults where it has them
    (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``).

    Attributes:
        matrix_approximation_rank: r, the rank of each matrix's approximation; the
            bytes of an n x m gradient become (n + m) r.
        start_powerSGD_iter: steps exchanged uncompressed first (the early, large
            gradients; PyTorch's default 1000).
        use_error_feedback: add to each step's gradient what compression lost before
            (the paper shows the method does not converge well without it).
        warm_start: start each step's power iteration from the last step's Q
            (one iteration per step then suffices); otherwise a fresh random Q.
        min_compression_rate: a matrix is compressed only when its elements are more
            than this many times the (n + m) r it would send; the rest travel
            uncompressed, together in one message per bucket.
        random_seed: the seed of the initial (or every, without warm start) Q, the
            same on every rank.
    """

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1_000
    use_error_feedback: bool = True
    warm_start: bool = True
    min_compression_rate: float = 2.0
    random_seed: int = 0

    def __post_init__(self) -> None:
        if int(self.matrix_approximation_rank) < 1:
            raise ValueError(f"PowerSGD rank {self.matrix_approximation_rank} must be >= 1 "
                             f"(compression: {CHOICES})")
        if int(self.start_powerSGD_iter) < 0:
            raise ValueError(f"start_powerSGD_iter={self.start_powerSGD_iter} must be >= 0 "
                             "(steps exchanged uncompressed first)")
        if not self.min_compression_rate >= 0:
            raise ValueError(f"min_compression_rate={self.min_compression_rate} must be "
                             ">= 0")

    def __str__(self) -> str:
        return f"powersgd:{self.matrix_approximation_rank}"


Compression = Union[None, str, PowerSGDOptions]


def parse_compression(value: object, **powersgd: object) -> Compression:
    """``value`` (a command-line or config value, or an already parsed one) as None, a
    wire dtype ("float16", "bfloat16") or :class:`PowerSGDOptions` (``powersgd``: its
    other options). ValueError naming the value and the choices otherwise."""
    if value is None or isinstance(value, PowerSGDOptions):
        return value
    text = str(value).strip().lower()
    if text in ("none", ""):
        return None
    if text in _WIRE:
        return _WIRE[text]
    head, colon, rank = text.partition(":")
    if head == "powersgd" and colon:
        try:
            r = int(rank)
        except ValueError:
            r = 0
        if r >= 1 and str(r) == rank.strip():
            return PowerSGDOptions(matrix_approximation_rank=r, **powersgd)  # type: ignore
    raise ValueError(f"compression {value!r} is not one of {CHOICES}")


def describe(choice: Compression) -> str:
    """The command-line spelling of a parsed choice ("none", "fp16", "powersgd:4")."""
    if choice is None:
        return "none"
    if isinstance(choice, PowerSGDOptions):
        return str(choice)
    return {"float16": "fp16", "bfloat16": "bf16"}[choice]


__all__ = ["CHOICES", "Compression", "PowerSGDOptions", "describe", "parse_compression"]
