"""Reverse-mode automatic differentiation on raw xp arrays.

A :class:`Tensor` holds an array (``.data``: NumPy or CuPy), its gradient (``.grad``)
and the :class:`Function` that made it. ``Function.forward``/``backward`` work on raw
arrays, as in Chainer; ``Function.apply`` runs forward and records the graph.
``Tensor.backward()`` walks the graph once, in reverse topological order, and frees each
node's saved arrays as soon as its backward has run.

Leaf tensors (parameters) can carry *post-accumulate hooks*: a callback that fires the
moment the leaf's gradient is final for this backward pass (every function that used the
leaf has contributed). Data parallelism uses it to start a bucket's allreduce while the
rest of backward is still running.
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import numpy

from mpidl.backend import get_array_module

_state = threading.local()


def is_grad_enabled() -> bool:
    """Whether operations record a graph (False inside :func:`no_grad`)."""
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def enable_grad() -> Iterator[None]:
    """Context manager: operations inside record a graph, even within :func:`no_grad`
    (activation recomputation rebuilds a block's graph during backward)."""
    previous = is_grad_enabled()
    _state.grad_enabled = True
    try:
        yield
    finally:
        _state.grad_enabled = previous


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Context manager: operations inside record no graph (evaluation, optimizer steps)."""
    previous = is_grad_enabled()
    _state.grad_enabled = False
    try:
        yield
    finally:
        _state.grad_enabled = previous


class HookHandle:
    """Returned by hook registration; ``remove()`` unregisters the hook."""

    def __init__(self, hooks: list, hook: Callable) -> None:
        self._hooks = hooks
        self._hook = hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


class Tensor:
    """An xp array with an optional gradient and the graph that produced it.

    Args:
        data: an array (NumPy or CuPy), or anything ``numpy.asarray`` accepts.
        requires_grad: accumulate a gradient into ``.grad`` during backward.
        name: optional label (parameters get their dotted name).
    """

    __array_priority__ = 200  # so that ``ndarray + Tensor`` defers to Tensor.__radd__

    def __init__(self, data: Any, requires_grad: bool = False, name: str | None = None) -> None:
        if isinstance(data, Tensor):
            data = data.data
        if get_array_module(data) is numpy and not isinstance(data, numpy.ndarray):
            data = numpy.asarray(data)
        self.data = data
        self.grad: Any = None
        # Where a leaf's gradient is written when it arrives while .grad is None (that
        # array then becomes .grad): data parallelism points it at the parameter's slice
        # of a flat bucket, so the first contribution of a step lands in the bucket (by
        # the backward itself, or one copy), with no zero-fill and no read-add-write.
        self.grad_buffer: Any = None
        # The backward pass (current_backward_pass()) in which this leaf last received a
        # gradient that is not row-sparse (Function.row_sparse_grads): data parallelism
        # may exchange only the touched rows of a table only while this is not the pass.
        self.dense_grad_pass = 0
        self.requires_grad = requires_grad
        # True for a parameter whose array is dropped between its forward and backward
        # (sharded data parallelism, stage 3): Functions then refer to it by the tensor.
        self.releasable = False
        self.creator: Function | None = None
        self.name = name
        self._post_accumulate_hooks: list[Callable[[Tensor], None]] = []

    # -- array-like properties ------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def xp(self) -> ModuleType:
        """The array module of ``.data`` (numpy or cupy)."""
        return get_array_module(self.data)

    @property
    def is_leaf(self) -> bool:
        return self.creator is None

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{grad})"

    def item(self) -> float:
        """The value of a one-element tensor as a Python number (syncs a device array)."""
        return self.data.item()

    def numpy(self) -> numpy.ndarray:
        """A NumPy copy of ``.data`` (from the device if needed)."""
        from mpidl.backend import as_numpy

        return as_numpy(self.data)

    def detach(self) -> "Tensor":
        """The same data, cut from the graph."""
        return Tensor(self.data, requires_grad=False)

    # -- hooks ----------------------------------------------------------------------
    def register_post_accumulate_grad_hook(self, hook: Callable[["Tensor"], None]) -> HookHandle:
        """Call ``hook(tensor)`` when this leaf's ``.grad`` is final in a backward pass.

        Fires once per ``backward()`` in which the tensor received a gradient, right
        after its last contribution was accumulated, while backward goes on for the rest
        of the graph. (Same name and meaning as PyTorch's.)
        """
        if not self.is_leaf:
            raise RuntimeError("post-accumulate hooks can only be registered on leaf tensors")
        self._post_accumulate_hooks.append(hook)
        return HookHandle(self._post_accumulate_hooks, hook)

    # -- backward -------------------------------------------------------------------
    def backward(self, grad: Any = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into ``.grad`` of every leaf that requires grad.

        Args:
            grad: the gradient flowing into this tensor; defaults to 1 for a scalar.
            retain_graph: keep the graph (and saved arrays) for a second backward.
        """
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(
                    f"backward() without a gradient needs a scalar, got shape {self.shape}; "
                    "reduce it (sum or mean) first or pass grad="
                )
            grad = self.xp.ones_like(self.data)
        elif isinstance(grad, Tensor):
            grad = grad.data
        backward(self, grad, retain_graph=retain_graph)

    # -- operators: thin wrappers over mpidl.functions ---------------------------------
    def __add__(self, other: Any) -> "Tensor":
        return _F().add(self, other)

    def __radd__(self, other: Any) -> "Tensor":
        return _F().add(other, self)

    def __sub__(self, other: Any) -> "Tensor":
        return _F().sub(self, other)

    def __rsub__(self, other: Any) -> "Tensor":
        return _F().sub(other, self)

    def __mul__(self, other: Any) -> "Tensor":
        return _F().mul(self, other)

    def __rmul__(self, other: Any) -> "Tensor":
        return _F().mul(other, self)

    def __truediv__(self, other: Any) -> "Tensor":
        return _F().div(self, other)

    def __rtruediv__(self, other: Any) -> "Tensor":
        return _F().div(other, self)

    def __neg__(self) -> "Tensor":
        return _F().neg(self)

    def __pow__(self, exponent: float) -> "Tensor":
        return _F().pow(self, exponent)

    def __matmul__(self, other: Any) -> "Tensor":
        return _F().matmul(self, other)

    def __rmatmul__(self, other: Any) -> "Tensor":
        return _F().matmul(other, self)

    def __getitem__(self, index: Any) -> "Tensor":
        return _F().getitem(self, index)

    def reshape(self, *shape: Any) -> "Tensor":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _F().reshape(self, shape)

    def transpose(self, *axes: Any) -> "Tensor":
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return _F().transpose(self, axes or None)

    @property
    def T(self) -> "Tensor":
        return _F().transpose(self, None)

    def sum(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return _F().sum(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return _F().mean(self, axis=axis, keepdims=keepdims)


_functions_module: ModuleType | None = None


def _F() -> ModuleType:
    # mpidl.functions imports this module, so the operators find it lazily.
    global _functions_module
    if _functions_module is None:
        import mpidl.functions

        _functions_module = mpidl.functions
    return _functions_module


class Function:
    """One differentiable operation on raw arrays.

    Subclasses implement ``forward(*arrays)`` returning an array (or a tuple of arrays)
    and ``backward(*output_grads)`` returning one gradient per input (or None for an
    input that needs none). Keyword arguments of ``apply`` become attributes, so
    ``Sum.apply(x, axis=1)`` can read ``self.axis``. ``backward`` may receive None for an
    output that got no gradient only when ``forward`` returned several outputs.

    ``owned_grads`` lists the input positions whose gradient ``backward`` returns as a
    freshly allocated, C-contiguous array that nothing else references (a GEMM result,
    a new zeroed table; never ``gy`` itself, a view of it or a saved array). For those,
    a leaf whose ``.grad`` is None adopts the array as its ``.grad`` instead of copying
    it (a 10 MB embedding gradient costs a copy per step otherwise). Set it on the class,
    or on the instance inside ``backward`` when it depends on the path taken.

    A backward that computes a gradient with an ``out=`` argument (a GEMM, a sum) can
    write it straight into its leaf's :attr:`Tensor.grad_buffer` (data parallelism's
    bucket slice): :meth:`grad_buffer_for` says where, or None for a fresh array.

    ``row_sparse_grads`` lists the input positions whose gradient is zero outside the
    rows that ``backward`` records on the input tensor as ``grad_row_mask`` (the embedding
    functions). A leaf that receives any other gradient in a pass gets that pass in
    :attr:`Tensor.dense_grad_pass`: a table tied to an output projection, or under a
    weight penalty written into the loss, then has a dense gradient in that step.
    """

    generation = 0
    inputs: tuple | None = None
    owned_grads: tuple[int, ...] = ()
    row_sparse_grads: tuple[int, ...] = ()

    def __init__(self, **params: Any) -> None:
        self.__dict__.update(params)

    @property
    def needs_input_grad(self) -> tuple[bool, ...]:
        """Per input, whether ``backward`` must compute its gradient.

        Valid inside ``backward`` (the graph holds the inputs then): an input that is a
        constant (a raw array, a scalar, a tensor without ``requires_grad``) needs none,
        so a backward can skip that work and return None for it.
        """
        if self.inputs is None:
            raise RuntimeError("needs_input_grad is only known while backward runs")
        return tuple(isinstance(x, Tensor) and x.requires_grad for x in self.inputs)

    def grad_buffer_for(self, i: int) -> Any:
        """The array ``backward`` may write input ``i``'s gradient into, or None.

        Valid inside ``backward``: the input's :attr:`Tensor.grad_buffer` when it is a
        leaf with no ``.grad`` yet (this is its first gradient of the pass), unless the
        same tensor is another input of this Function too (its gradients must add).
        Returning that same array as the gradient then costs no copy.
        """
        x = self.inputs[i]
        if (not isinstance(x, Tensor) or x.grad_buffer is None or x.grad is not None
                or x.creator is not None or sum(y is x for y in self.inputs) > 1):
            return None
        return x.grad_buffer

    def forward(self, *xs: Any) -> Any:
        raise NotImplementedError

    def backward(self, *gys: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def apply(cls, *inputs: Any, **params: Any) -> Any:
        """Run forward on the inputs' arrays; record the graph if any input needs grad."""
        f = cls(**params)
        xs = [x.data if isinstance(x, Tensor) else x for x in inputs]
        ys = f.forward(*xs)
        single = not isinstance(ys, tuple)
        if single:
            ys = (ys,)
        needs_grad = is_grad_enabled() and any(
            isinstance(x, Tensor) and x.requires_grad for x in inputs
        )
        outputs = tuple(Tensor(y, requires_grad=needs_grad) for y in ys)
        if needs_grad:
            f.inputs = tuple(inputs)
            f.generation = max(
                (x.creator.generation for x in inputs if isinstance(x, Tensor) and x.creator),
                default=0,
            ) + 1
            # Outputs are held through their position only: the Function keeps no
            # reference to the output tensors, so a dropped branch frees its memory.
            f.n_outputs = len(outputs)
            for i, y in enumerate(outputs):
                y.creator = f
                y._output_index = i
            if any(isinstance(x, Tensor) and x.releasable for x in inputs):
                f._refer_to_released_inputs()
        return outputs[0] if single else outputs

    def _refer_to_released_inputs(self) -> None:
        """Keep a releasable input's array by reference to the input, not as the array.

        Sharded data parallelism (stage 3) drops a parameter's full array after its
        forward and gathers it again before its backward: a saved copy of the array
        would keep it in memory all along. Saved attributes that *are* such an input's
        ``.data`` are set to None now and read from the input again just before
        backward (:meth:`_restore_released_inputs`).
        """
        arrays = {id(x.data): i for i, x in enumerate(self.inputs)
                  if isinstance(x, Tensor) and x.releasable}
        by_input = {name: arrays[id(value)] for name, value in self.__dict__.items()
                    if id(value) in arrays and name != "inputs"}
        for name in by_input:
            self.__dict__[name] = None
        self._by_input = by_input

    def _restore_released_inputs(self) -> None:
        for name, i in getattr(self, "_by_input", {}).items():
            self.__dict__[name] = self.inputs[i].data

    def release(self) -> None:
        """Drop the inputs and anything saved for backward (after backward has run)."""
        self.inputs = None
        keep = {"generation", "n_outputs"}
        for key in [k for k in self.__dict__ if k not in keep]:
            del self.__dict__[key]


def _accumulate(acc: Any, g: Any) -> Any:
    if acc is None:
        return g
    return acc + g


_backward_passes = itertools.count(1)


def current_backward_pass() -> int:
    """A number that identifies the running (or last) backward pass.

    Changes at every call of :func:`backward`; a Function can use it to tell a second
    use of the same leaf within one pass from a new pass (the embedding functions
    gather the rows they touched per pass this way).
    """
    return getattr(_state, "backward_pass", 0)


def backward(root: Tensor, grad: Any, retain_graph: bool = False) -> None:
    """Backpropagate ``grad`` from ``root`` through the recorded graph.

    Functions run in decreasing generation, so every function runs once, after all of
    its outputs' gradients are complete. Leaf gradients are accumulated into ``.grad``
    (in place when ``.grad`` already exists, so it may be a view into a bucket; written
    into ``grad_buffer`` when there is one and ``.grad`` is None).
    """
    if getattr(_state, "in_backward", False):
        # A backward inside a backward (activation recomputation, mpidl.nn.recompute)
        # belongs to the outer pass: a new number would tell the embedding functions
        # that the outer pass's dense gradient of a tied table came from another pass.
        _backward(root, grad, retain_graph)
        return
    _state.backward_pass = next(_backward_passes)
    _state.in_backward = True
    try:
        _backward(root, grad, retain_graph)
    finally:
        _state.in_backward = False


def _backward(root: Tensor, grad: Any, retain_graph: bool) -> None:
    if root.creator is None:
        if root.requires_grad:
            root.dense_grad_pass = _state.backward_pass
            _accumulate_leaf(root, grad)
            _fire(root)
        return

    # Pass 1: find every function and count, per leaf, how many (function, input)
    # edges will deliver a gradient, so a leaf's hooks fire when its last one arrives.
    pending_leaf: dict[int, int] = {}
    leaves: dict[int, Tensor] = {}
    seen: set[int] = set()
    stack = [root.creator]
    while stack:
        f = stack.pop()
        if id(f) in seen or f.inputs is None:
            continue
        seen.add(id(f))
        for x in f.inputs:
            if isinstance(x, Tensor) and x.requires_grad:
                if x.creator is None:
                    pending_leaf[id(x)] = pending_leaf.get(id(x), 0) + 1
                    leaves[id(x)] = x
                else:
                    stack.append(x.creator)

    # Pass 2: run backward. Output gradients wait in a dict keyed by function id.
    counter = itertools.count()
    heap: list = [(-root.creator.generation, next(counter), root.creator)]
    grads: dict[int, list] = {id(root.creator): [None] * root.creator.n_outputs}
    grads[id(root.creator)][root._output_index] = grad
    queued = {id(root.creator)}
    # Leaves that got a gradient in this pass: only they fire hooks (a leaf may hold a
    # .grad from an earlier pass and get nothing in this one).
    received: set[int] = set()
    while heap:
        _, _, f = heapq.heappop(heap)
        gys = grads.pop(id(f))
        if f.inputs is None:
            raise RuntimeError(
                "backward through a graph that was already freed; "
                "pass retain_graph=True to the first backward()"
            )
        if "_by_input" in f.__dict__:
            f._restore_released_inputs()
        gxs = f.backward(*gys) if len(gys) > 1 else f.backward(gys[0])
        if not isinstance(gxs, tuple):
            gxs = (gxs,)
        inputs, owned, row_sparse = f.inputs, f.owned_grads, f.row_sparse_grads
        if not retain_graph:
            f.release()
        for i, (x, gx) in enumerate(zip(inputs, gxs)):
            if not (isinstance(x, Tensor) and x.requires_grad):
                continue
            if x.creator is None:
                if gx is not None:
                    if i not in row_sparse:
                        x.dense_grad_pass = _state.backward_pass
                    # An owned array may be adopted, unless the same array was also
                    # returned for another input (it would then be aliased).
                    _accumulate_leaf(x, gx, i in owned
                                     and sum(g is gx for g in gxs) == 1)
                    received.add(id(x))
                pending_leaf[id(x)] -= 1
                if pending_leaf[id(x)] == 0 and id(x) in received:
                    _fire(x)
                continue
            if gx is None:
                continue
            c = x.creator
            slot = grads.setdefault(id(c), [None] * c.n_outputs)
            slot[x._output_index] = _accumulate(slot[x._output_index], gx)
            if id(c) not in queued:
                queued.add(id(c))
                heapq.heappush(heap, (-c.generation, next(counter), c))

    # A branch whose gradients were all None never ran, so its leaves' counts did not
    # reach zero; their hooks still fire, at the end.
    for key, left in pending_leaf.items():
        if left > 0 and key in received:
            _fire(leaves[key])


def _accumulate_leaf(x: Tensor, g: Any, owned: bool = False) -> None:
    if g.shape != x.data.shape:
        raise RuntimeError(
            f"gradient of shape {g.shape} for a tensor of shape {x.data.shape} "
            f"({x.name or 'unnamed'}): a Function.backward returned a wrong shape"
        )
    if x.grad is None:
        if x.grad_buffer is not None:
            if g is not x.grad_buffer:  # else backward wrote it there (grad_buffer_for)
                x.grad_buffer[...] = g
            x.grad = x.grad_buffer
            return
        if (owned and type(g) is type(x.data) and g.dtype == x.data.dtype
                and g.flags.c_contiguous):
            # Function.owned_grads: nothing else holds this array, so it can become
            # the .grad that later accumulation writes into in place.
            x.grad = g
            return
        # A function may return the same array for several inputs (add does), so the
        # leaf gets its own copy; later accumulation writes into it in place.
        # xp.array (not astype) so that a NumPy scalar from 0-d arithmetic becomes an array.
        x.grad = get_array_module(x.data).array(g, dtype=x.data.dtype, copy=True)
    else:
        x.grad += g


@contextlib.contextmanager
def fresh_grads(leaves: Sequence[Tensor]) -> Iterator[Callable[[], list]]:
    """Inside, ``leaves`` start a gradient of their own: no ``.grad``, no grad buffer, no
    hooks; the yielded function returns the gradients gathered so far (None where
    none came). On leaving, each leaf has its own ``.grad``, buffer and hooks back.

    Activation recomputation backpropagates through a rebuilt block inside the outer
    backward: the block's parameter gradients go back to the outer pass as the
    gradients of one Function, so they are accumulated, and their hooks fire, once.
    """
    saved = [(x.grad, x.grad_buffer, x._post_accumulate_hooks) for x in leaves]
    for x in leaves:
        x.grad, x.grad_buffer, x._post_accumulate_hooks = None, None, []
    try:
        yield lambda: [x.grad for x in leaves]
    finally:
        for x, (grad, buffer, hooks) in zip(leaves, saved):
            x.grad, x.grad_buffer, x._post_accumulate_hooks = grad, buffer, hooks


def _fire(x: Tensor) -> None:
    for hook in list(x._post_accumulate_hooks):
        hook(x)


def as_tensor(x: Any) -> Tensor:
    """Wrap an array (or scalar) as a constant Tensor; a Tensor is returned as is."""
    return x if isinstance(x, Tensor) else Tensor(x)


def tensors_data(xs: Sequence[Any]) -> list:
    """The raw arrays of a sequence of Tensors/arrays."""
    return [x.data if isinstance(x, Tensor) else x for x in xs]
