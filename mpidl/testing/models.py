"""Small models and whole-model views for tests of the parallel wrappers.

::

    from mpidl.testing.models import TwoHeads, full_parameters

    sdp = ShardedDataParallel(TwoHeads(), comm, stage=3)
    sdp.backward(F.sum(sdp(x, use_b=comm.rank == 0)), global_count=n)   # b: rank 0 only
    got = full_parameters(sdp)       # {name: whole array}, as the single-rank model's
"""
from __future__ import annotations

from typing import Any

from mpidl.nn import Linear, Module
from mpidl.parallel import ShardedDataParallel


class TwoHeads(Module):
    """Two linear heads on the same input; ``forward(x, use_b)`` uses head ``b`` only
    when asked: a parameter that some rank's batch never reaches (its gradient hook
    never fires there), float64 for exact comparisons."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Linear(4, 3, seed=1, dtype="float64")
        self.b = Linear(4, 3, seed=2, dtype="float64")

    def forward(self, x: Any, use_b: bool) -> Any:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def full_parameters(wrapper: Any) -> dict[str, Any]:
    """Every parameter of the wrapped model, whole, by name, in the model's order:
    copies, to compare with the single-rank model's.

    ``wrapper``: a :class:`~mpidl.parallel.ShardedDataParallel` (stages 1-2 first bring
    the full parameters up to date; stage 3 gathers each unit and releases it again),
    or anything else with the model whole on every rank (DataParallel, or the model).
    Collective for ZeRO.
    """
    if not isinstance(wrapper, ShardedDataParallel):
        model = getattr(wrapper, "module", wrapper)
        return {n: p.data.copy() for n, p in model.named_parameters()}
    wrapper.gather_parameters()
    names = {id(p): n for n, p in wrapper.named}
    out = {}
    for u in wrapper.units:
        gathered = u.flat is None  # stage 3: released after the step
        if gathered:
            wrapper.gathers.gather(u)
        out.update({names[id(p)]: p.data.copy() for p in u.params})
        if gathered:
            u.release_params()
    return {n: out[n] for n, _ in wrapper.named}


__all__ = ["TwoHeads", "full_parameters"]
