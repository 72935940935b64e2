"""Dropout with its own seeded generator: reproducible masks, identity in eval mode."""
from __future__ import annotations

from typing import Any

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn import init
from mpidl.nn.module import Module


class Dropout(Module):
    """Inverted dropout (Srivastava et al. 2014): zero with probability ``p``, scale by 1/(1-p).

    The masks come from the module's own ``numpy.random.Generator`` (from ``seed``/``rng``,
    see :mod:`mpidl.nn.init`), so two runs with the same seed drop the same units. Under
    data parallelism give each rank a different seed (e.g. ``seed + rank``) if ranks
    should drop different units. The generator state is ``self.rng.bit_generator.state``
    (for checkpoints). Each call takes one seed from it and draws the mask from that
    seed on the input's device (:mod:`mpidl.functions.dropout`), so CuPy masks are
    generated on the GPU and still resume exactly from the checkpointed host state.

    Args:
        p: drop probability in ``[0, 1)``.
        seed, rng: the mask generator's source.
    """

    def __init__(self, p: float = 0.5, *, seed: int | None = None,
                 rng: numpy.random.Generator | None = None) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout probability p={p} must lie in [0, 1)")
        self.p = float(p)
        if seed is None and rng is None:
            # Own stream, derived from the default generator: reproducible, and not the
            # same stream another Dropout built without a seed consumes.
            seed = int(init.make_rng().integers(2**63))
        self.rng = init.make_rng(seed, rng)

    def forward(self, x: Any) -> Tensor:
        if not self.training or self.p == 0.0:
            return x if isinstance(x, Tensor) else Tensor(x)
        return F.dropout(x, self.p, training=True, rng=self.rng)

    def extra_repr(self) -> str:
        return f"p={self.p}"
