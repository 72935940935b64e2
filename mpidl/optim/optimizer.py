"""The optimizer base class: parameters, in-place updates, flat array state.

Every optimizer updates ``p.data`` in place and never replaces it (data parallelism and
ZeRO hold views of it), reads ``p.grad`` without replacing it (gradients may be views into
flat buckets), and keeps its state as plain xp arrays and Python numbers, so the state is
checkpointed to HDF5 without pickle and can be sharded.

State layout of :meth:`Optimizer.state_dict` (flat; ``i`` indexes the parameter list
given to the constructor)::

    "step"                       int    number of step() calls so far
    "lr"                         float  the current learning rate
    "state.<i>.<name>"           array  per-parameter arrays, e.g. exp_avg, momentum_buffer
    "state.<i>.step"             int    (Adam/AdamW) steps taken by parameter i

A parameter that has not been updated yet (no gradient so far) has no ``state.<i>.*``.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

from mpidl.autograd import Tensor
from mpidl.backend import get_array_module, is_cupy, to_device


class Optimizer:
    """Base class: holds the parameters, the learning rate and per-parameter state.

    Subclasses name their per-parameter arrays in ``state_arrays``, create them in
    :meth:`_begin` and implement :meth:`_update`, which sees one block of a parameter at a
    time (see ``BLOCK``) and must use only elementwise operations. The learning rate is
    the attribute ``lr``; a schedule sets it before each step.

    Args:
        params: the parameters to update (e.g. ``model.parameters()``), in a fixed order.
        lr: the learning rate.
    """

    # Names of the per-parameter arrays a subclass keeps, and of its per-parameter ints.
    state_arrays: tuple[str, ...] = ()
    state_ints: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Tensor], lr: float) -> None:
        self.params: list[Tensor] = list(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        for i, p in enumerate(self.params):
            if not isinstance(p, Tensor) or not p.requires_grad:
                raise TypeError(
                    f"{type(self).__name__}: parameter {i} is a {type(p).__name__} "
                    "that does not require grad; pass model.parameters()"
                )
        if lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        self.lr = float(lr)
        self.step_count = 0
        # state[i] is {name: array or int}; filled at a parameter's first update.
        self.state: list[dict[str, Any]] = [{} for _ in self.params]
        # Scratch arrays for the update (not state: never saved), per (array type, dtype).
        self._scratch: dict[tuple[type, Any], list[Any]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the parameters (PyTorch 2's default: drop them).

        Args:
            set_to_none: drop the gradient arrays (``p.grad = None``, the default): the
                next backward writes fresh gradients instead of adding to zeros, one pass
                over memory fewer (into a parameter's :attr:`~mpidl.autograd.Tensor.grad_buffer`
                where data parallelism set one). False fills the arrays with zeros in place.
                Under :class:`~mpidl.parallel.DataParallel` a dropped array is a view of
                the bucket that the next backward writes again (as PyTorch DDP's
                ``gradient_as_bucket_view``): copy a gradient you keep across steps.
        """
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.fill(0)

    def step(self) -> None:
        """Update every parameter that has a gradient, in place."""
        lr = self.lr
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            self._begin(i, p.data, lr)
            st = self.state[i]
            arrays = [st[name] for name in self.state_arrays if name in st]
            for block in _blocks(p.data, p.grad, *arrays):
                self._update(*block, lr=lr)
        self.step_count += 1

    def state_dtype(self, param: Any) -> Any:
        """The dtype of the state arrays of ``param`` (its own dtype unless overridden)."""
        return param.dtype

    def _begin(self, i: int, param: Any, lr: float) -> None:
        """Per-parameter work before its blocks are updated (create state, count steps)."""

    def _update(self, param: Any, grad: Any, *state: Any, lr: float) -> None:
        """Update one block: views of the parameter, its gradient and its state arrays."""
        raise NotImplementedError

    def _temps(self, like: Any, count: int) -> list[Any]:
        """``count`` scratch arrays shaped like ``like``, views of buffers reused every step."""
        # Called once per block: keyed by the array type and dtype objects (cheap to
        # hash), and no reshape for the flat blocks of a host update.
        key = (type(like), like.dtype)
        bufs = self._scratch.get(key)
        if bufs is None or bufs[0].size < like.size or len(bufs) < count:
            xp = get_array_module(like)
            size = max(like.size, bufs[0].size if bufs else 0)
            bufs = self._scratch[key] = [xp.empty(size, like.dtype) for _ in range(count)]
        n = like.size
        if like.ndim == 1:
            return [b[:n] for b in bufs[:count]]
        return [b[:n].reshape(like.shape) for b in bufs[:count]]

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The flat state (layout in the module docstring); arrays are live, not copies."""
        out: dict[str, Any] = {"step": self.step_count, "lr": self.lr}
        for i, st in enumerate(self.state):
            for name, value in st.items():
                out[f"state.{i}.{name}"] = value
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` output (or the same keys read from a checkpoint).

        Arrays are copied into existing state arrays in place where they exist, else
        into new arrays on the parameter's device.

        Raises:
            KeyError: ``step``/``lr`` missing, or a key that this optimizer does not know.
            ValueError: an array's shape differs from its parameter's.
        """
        for key in ("step", "lr"):
            if key not in state:
                raise KeyError(f"{type(self).__name__}.load_state_dict: missing key {key!r}")
        known = set(self.state_arrays) | set(self.state_ints)
        new: list[dict[str, Any]] = [{} for _ in self.params]
        unexpected = []
        for key, value in state.items():
            if key in ("step", "lr"):
                continue
            parts = key.split(".")
            if (len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit()
                    or int(parts[1]) >= len(self.params) or parts[2] not in known):
                unexpected.append(key)
                continue
            i, name = int(parts[1]), parts[2]
            if name in self.state_ints:
                new[i][name] = int(value)
                continue
            p = self.params[i]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: {key} has shape "
                    f"{tuple(value.shape)} but parameter {i} has shape {tuple(p.shape)}"
                )
            xp = get_array_module(p.data)
            old = self.state[i].get(name)
            if old is None:
                old = xp.empty(p.data.shape, dtype=self.state_dtype(p.data))
            old[...] = to_device(value, xp)
            new[i][name] = old
        if unexpected:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: unexpected keys {unexpected} "
                f"(this optimizer has {len(self.params)} parameters and state "
                f"{sorted(known)}; was it saved by another optimizer type?)"
            )
        self.step_count = int(state["step"])
        self.lr = float(state["lr"])
        self.state = new

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={self.lr}, params={len(self.params)})"


# Elements per block of a host update. An update makes several elementwise passes over
# the parameter, its gradient and its state; done over blocks that stay in the CPU's
# caches instead of over whole multi-MB arrays, the Adam step on the 10 MB embedding
# table of the bow model ran 1.2-1.7x faster here (2-core Zen 3, under load), and the
# scratch arrays shrink to the block size. Smaller blocks pay Python overhead per block:
# against 64 Ki elements, 256 Ki (1 MiB of float32) made the SGD step on that table
# 1.2x faster and Adam's 3 % (interleaved runs, CPU time).
BLOCK = 1 << 18


def _blocks(param: Any, grad: Any, *state: Any) -> Iterator[list[Any]]:
    """The arrays as matching flat blocks (NumPy, large, contiguous) or whole (otherwise).

    A device array is updated whole: a GPU wants few large kernels, not cache blocks.
    """
    arrays = [param, grad, *state]
    n = param.size
    if (n <= BLOCK or is_cupy(get_array_module(param))
            or not all(a.flags.c_contiguous for a in arrays)):
        yield arrays
        return
    flats = [a.reshape(-1) for a in arrays]  # views: all are contiguous
    for start in range(0, n, BLOCK):
        yield [f[start:start + BLOCK] for f in flats]
