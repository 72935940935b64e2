"""Modules and Parameters: the containers that hold a model's trainable arrays.

A :class:`Module` registers every :class:`Parameter` and sub-Module assigned to one of its
attributes, in the order of assignment. That order is the model's parameter order: it is
the same on every rank that runs the same constructor, and it is the order the gradient
buckets of data parallelism, the optimizer state and the checkpoints use.

*Buffers* (:meth:`Module.register_buffer`) are arrays that belong to the model's state
but are not trained: batch norm's running mean and variance. They are in
:meth:`Module.state_dict` (so checkpoints keep them and ``load_state_dict`` restores
them), move with :meth:`Module.to`, and are neither parameters nor given to optimizers.

    class TwoLayer(Module):
        def __init__(self, rng):
            super().__init__()
            self.fc1 = Linear(4, 8, rng=rng)      # parameters fc1.weight, fc1.bias
            self.fc2 = Linear(8, 2, rng=rng)      # then fc2.weight, fc2.bias

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(x)))
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Iterator

import numpy

from mpidl.autograd import HookHandle, Tensor
from mpidl.backend import get_array_module, is_half, to_device


class Parameter(Tensor):
    """A trainable leaf Tensor: ``requires_grad`` is always True.

    Args:
        data: the initial array (NumPy or CuPy). It is used as is, not copied: the
            Parameter's ``.data`` is that array, and optimizers update it in place.
        name: optional label; :meth:`Module.named_parameters` gives the dotted name.
    """

    def __init__(self, data: Any, name: str | None = None) -> None:
        super().__init__(data, requires_grad=True, name=name)

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"


class Module:
    """Base class of layers and models.

    Subclasses call ``super().__init__()`` first, assign Parameters and sub-Modules to
    attributes, and implement ``forward``. Calling the module calls ``forward``.
    """

    training: bool

    def __init__(self) -> None:
        # The dicts keep insertion order; ``_order`` interleaves them so that the
        # parameter order is the order of assignment, whatever the kind of member.
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_order", [])
        object.__setattr__(self, "training", True)

    # -- registration ---------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if "_order" not in self.__dict__:
            raise RuntimeError(
                f"{type(self).__name__}.__init__ must call super().__init__() before "
                f"assigning attribute {name!r}"
            )
        params, modules, order = self._parameters, self._modules, self._order
        buffers = self.__dict__.get("_buffers", {})
        if name in buffers and not isinstance(value, (Parameter, Module)):
            # Assigning to a buffer replaces its array (None empties it) and keeps its
            # place, as in PyTorch.
            buffers[name] = value
            return
        if isinstance(value, (Parameter, Module)):
            # Re-assigning keeps the original position, as in PyTorch, so replacing a
            # layer does not reorder the buckets.
            target = params if isinstance(value, Parameter) else modules
            (modules if target is params else params).pop(name, None)
            buffers.pop(name, None)
            if name not in order:
                order.append(name)
            target[name] = value  # an existing key keeps its place in the dict
            self.__dict__.pop(name, None)
            return
        if name in params or name in modules:
            # Assigning a plain value (None, an array) over a member unregisters it.
            params.pop(name, None)
            modules.pop(name, None)
            order.remove(name)
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: members live in the dicts.
        d = self.__dict__
        for members in ("_parameters", "_modules", "_buffers"):
            if members in d and name in d[members]:
                return d[members][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        if name in self._parameters or name in self._modules or name in self._buffers:
            self._parameters.pop(name, None)
            self._modules.pop(name, None)
            self._buffers.pop(name, None)
            self._order.remove(name)
        else:
            object.__delattr__(self, name)

    def register_buffer(self, name: str, value: Any) -> None:
        """Register ``value`` (an xp array, or None) as the buffer ``name``.

        A buffer is model state that is not trained (batch norm's running statistics):
        it is read as ``self.<name>``, listed by :meth:`named_buffers`, saved by
        :meth:`state_dict` (None is left out) and restored in place by
        :meth:`load_state_dict`, and moved by :meth:`to`. Assigning ``self.<name> =
        array`` later replaces the array and keeps the buffer's place in the order.

        Raises:
            KeyError: ``name`` is already a parameter, a sub-module or another attribute.
            TypeError: ``value`` is a Parameter or Tensor (register those as parameters).
        """
        if "_order" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() "
                               f"before register_buffer({name!r})")
        if isinstance(value, Tensor):
            raise TypeError(f"register_buffer({name!r}): got a {type(value).__name__}; a "
                            "buffer is a plain array (a trainable one is a Parameter)")
        if name in self._parameters or name in self._modules or name in self.__dict__ \
                or name in self._buffers:
            raise KeyError(f"register_buffer: {type(self).__name__} already has an "
                           f"attribute {name!r}")
        self._buffers[name] = value
        self._order.append(name)

    # -- traversal ------------------------------------------------------------------
    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """Yield ``(dotted_name, parameter)`` in registration order, depth first.

        A Parameter shared by two members (tied weights) is yielded once, under the
        first name that reaches it.
        """
        seen: set[int] = set()
        for name, p in self._named_parameters_all(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _named_parameters_all(self, prefix: str) -> Iterator[tuple[str, Parameter]]:
        for name in self._order:
            if name in self._parameters:
                yield prefix + name, self._parameters[name]
            elif name in self._modules:
                yield from self._modules[name]._named_parameters_all(prefix + name + ".")

    def parameters(self) -> list[Parameter]:
        """The parameters in registration order (see :meth:`named_parameters`)."""
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        """Yield ``(dotted_name, array)`` of every buffer that is not None, in
        registration order, depth first (see :meth:`register_buffer`)."""
        for name, kind, value in self._members_all(prefix):
            if kind == "buffer":
                yield name, value

    def buffers(self) -> list[Any]:
        """The buffers' arrays in registration order (see :meth:`named_buffers`)."""
        return [b for _, b in self.named_buffers()]

    def _named_state(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        # Parameters and buffers interleaved in registration order (the state_dict
        # order); a shared parameter only under its first name.
        seen: set[int] = set()
        for name, kind, value in self._members_all(prefix):
            if kind == "parameter":
                if id(value) in seen:
                    continue
                seen.add(id(value))
            yield name, value

    def _members_all(self, prefix: str) -> Iterator[tuple[str, str, Any]]:
        for name in self._order:
            if name in self._parameters:
                yield prefix + name, "parameter", self._parameters[name]
            elif name in self._buffers:
                if self._buffers[name] is not None:
                    yield prefix + name, "buffer", self._buffers[name]
            elif name in self._modules:
                yield from self._modules[name]._members_all(prefix + name + ".")

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """Yield ``(dotted_name, module)`` for this module (name ``""``) and all below it."""
        yield prefix.rstrip("."), self
        for name in self._order:
            if name in self._modules:
                yield from self._modules[name].named_modules(prefix + name + ".")

    def children(self) -> list["Module"]:
        """The direct sub-modules in registration order."""
        return [self._modules[n] for n in self._order if n in self._modules]

    def num_parameters(self) -> int:
        """The total number of scalars in all parameters."""
        return sum(int(p.size) for p in self.parameters())

    # -- modes ----------------------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        """Set training mode here and below (dropout active); returns self."""
        for _, m in self.named_modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        """Set evaluation mode here and below (dropout is the identity); returns self."""
        return self.train(False)

    # -- gradients ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every parameter's gradient, as :meth:`mpidl.optim.Optimizer.zero_grad`.

        Args:
            set_to_none: drop the gradient arrays (the default, PyTorch 2's); False fills
                them with zeros in place.
        """
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.fill(0)

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A flat ``{dotted_name: array}`` of every parameter and buffer.

        Parameters and buffers come in registration order (for a model without
        buffers, the parameter order). The values are the live arrays, not copies: they
        change when the optimizer steps (or a batch norm updates its running
        statistics). Copy them (``{k: v.copy() ...}``) for a snapshot; a checkpoint
        writer that stores them immediately needs no copy.
        """
        return {name: (v.data if isinstance(v, Parameter) else v)
                for name, v in self._named_state()}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Copy arrays from ``state`` into the parameters and buffers, in place.

        Parameters and buffers keep their array objects (so an optimizer, or a bucket
        whose views they are, stays valid); values are cast to the target's dtype and
        moved to its device.

        Args:
            state: ``{dotted_name: array}`` as made by :meth:`state_dict`.
            strict: raise when a parameter or buffer has no entry or an entry names
                neither. Shape mismatches raise whatever ``strict`` says.

        Raises:
            KeyError: (strict) missing or unexpected names, all listed.
            ValueError: an entry's shape differs from its parameter's or buffer's.
        """
        targets = {name: (v.data if isinstance(v, Parameter) else v)
                   for name, v in self._named_state()}
        missing = [k for k in targets if k not in state]
        unexpected = [k for k in state if k not in targets]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if unexpected:
                parts.append(f"unexpected keys {unexpected}")
            raise KeyError(
                f"load_state_dict into {type(self).__name__}: " + "; ".join(parts)
                + " (pass strict=False to load the names that match)"
            )
        bad = [
            f"{k}: checkpoint {tuple(numpy.shape(state[k]))} vs model {tuple(a.shape)}"
            for k, a in targets.items()
            if k in state and tuple(numpy.shape(state[k])) != tuple(a.shape)
        ]
        if bad:
            raise ValueError(
                f"load_state_dict into {type(self).__name__}: shape mismatch for "
                + "; ".join(bad) + " (was the model built with the same configuration?)"
            )
        for k, a in targets.items():
            if k in state:
                xp = get_array_module(a)
                a[...] = to_device(state[k], xp)

    def to(self, xp: ModuleType) -> "Module":
        """Move every parameter (and gradient) and buffer to array module ``xp``.

        The parameters get new arrays, so call this before building the optimizer.
        Returns self.
        """
        for p in self.parameters():
            p.data = to_device(p.data, xp)
            if p.grad is not None:
                p.grad = to_device(p.grad, xp)
        for _, m in self.named_modules():
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = to_device(b, xp)
        return self

    def half_(self, dtype: Any) -> "Module":
        """Round every floating parameter to the 16-bit float ``dtype`` (float16 or
        bfloat16: :func:`mpidl.backend.precision_dtype`) in place of its array; buffers
        (running statistics) keep their dtype. Call it before wrapping the model and
        building the optimizer (:class:`~mpidl.optim.MasterWeights` keeps the fp32
        masters). Returns self.
        """
        dtype = numpy.dtype(dtype)
        if not is_half(dtype):
            raise ValueError(f"half_({dtype}): use float16 or bfloat16")
        for p in self.parameters():
            if p.data.dtype.kind == "f" or is_half(p.data.dtype):
                try:
                    p.data = p.data.astype(dtype)
                except (TypeError, ValueError) as e:  # CuPy before 14: no bfloat16
                    raise TypeError(f"half_({dtype.name}): {type(p.data).__module__} arrays "
                                    f"cannot hold {dtype.name} ({e}); bfloat16 on the GPU "
                                    "needs CuPy 14 or later") from e
                p.grad = None
        return self

    # -- calling --------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hooks = self.__dict__.get("_forward_hooks")
        if not hooks:
            return self.forward(*args, **kwargs)
        for hook in list(hooks["pre"]):
            hook(self, args)
        out = self.forward(*args, **kwargs)
        for hook in list(hooks["post"]):
            replaced = hook(self, args, out)
            if replaced is not None:
                out = replaced
        return out

    def register_forward_pre_hook(self, hook: Any) -> "HookHandle":
        """Call ``hook(module, args)`` before every ``forward`` (as PyTorch's)."""
        return self._add_forward_hook("pre", hook)

    def register_forward_hook(self, hook: Any) -> "HookHandle":
        """Call ``hook(module, args, output)`` after every ``forward``; a return value
        other than None replaces the output (as PyTorch's)."""
        return self._add_forward_hook("post", hook)

    def _add_forward_hook(self, kind: str, hook: Any) -> "HookHandle":
        hooks = self.__dict__.get("_forward_hooks")
        if hooks is None:
            hooks = {"pre": [], "post": []}
            object.__setattr__(self, "_forward_hooks", hooks)
        hooks[kind].append(hook)
        return HookHandle(hooks[kind], hook)

    def extra_repr(self) -> str:
        """The text inside this module's parentheses in ``repr`` (override)."""
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name in self._order:
            if name not in self._modules:
                continue
            sub = repr(self._modules[name]).replace("\n", "\n  ")
            lines.append(f"  ({name}): {sub}")
        if len(lines) == 1:
            return lines[0] + ")"
        return "\n".join(lines) + "\n)"


def as_input(x: Any) -> Any:
    """The raw array of a Tensor; arrays and other values pass through unchanged."""
    return x.data if isinstance(x, Tensor) else x


def default_dtype(dtype: Any) -> numpy.dtype:
    """The parameter dtype: ``dtype`` if given, float32 otherwise."""
    return numpy.dtype(numpy.float32 if dtype is None else dtype)
