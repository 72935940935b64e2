"""Shape and indexing operations: reshape, transpose, getitem, concat, stack, broadcast_to.

Their backward moves gradients back without arithmetic, except :func:`getitem` with
integer-array indices, whose backward is a scatter-add (an index may repeat).
"""
from __future__ import annotations

from typing import Any, Sequence

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module, to_device, zeros_add_at
from mpidl.functions.math import sum_to


class Reshape(Function):
    def forward(self, x):
        self.x_shape = x.shape
        return x.reshape(self.shape)

    def backward(self, gy):
        return gy.reshape(self.x_shape)


class Transpose(Function):
    def forward(self, x):
        xp = get_array_module(x)
        return xp.transpose(x, self.axes)

    def backward(self, gy):
        xp = get_array_module(gy)
        if self.axes is None:
            return xp.transpose(gy)
        inverse = [0] * len(self.axes)
        for i, a in enumerate(self.axes):
            inverse[a % len(self.axes)] = i
        return xp.transpose(gy, inverse)


def _index_data(index: Any, xp: Any) -> Any:
    """``index`` with Tensors replaced by their data and index arrays moved to ``xp``.

    Tensors used as indices (ids produced by other code) index by their data. A host
    index array on a device tensor (labels from the data loader, say) is copied to the
    device: CuPy's indexing and its ``add.at`` in backward take device indices only.
    """
    def one(i: Any) -> Any:
        if isinstance(i, Tensor):
            i = i.data
        if getattr(i, "ndim", 0) > 0 and get_array_module(i) is not xp:
            i = to_device(i, xp)
        return i

    return tuple(one(i) for i in index) if isinstance(index, tuple) else one(index)


def _is_advanced(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in parts)


class GetItem(Function):
    owned_grads = (0,)  # a fresh zeroed array

    def forward(self, x):
        self.x_shape, self.x_dtype = x.shape, x.dtype
        return x[self.index]

    def backward(self, gy):
        xp = get_array_module(gy)
        if _is_advanced(self.index):
            # Integer arrays may repeat an element, whose gradients must add up.
            return zeros_add_at(xp, self.x_shape, self.index, gy)
        gx = xp.zeros(self.x_shape, dtype=gy.dtype)
        gx[self.index] = gy
        return gx


class Concat(Function):
    def forward(self, *xs):
        xp = get_array_module(*xs)
        self.sizes = [x.shape[self.axis] for x in xs]
        return xp.concatenate(xs, axis=self.axis)

    def backward(self, gy):
        xp = get_array_module(gy)
        bounds = []
        total = 0
        for n in self.sizes[:-1]:
            total += n
            bounds.append(total)
        return tuple(xp.split(gy, bounds, axis=self.axis))


class Stack(Function):
    def forward(self, *xs):
        return get_array_module(*xs).stack(xs, axis=self.axis)

    def backward(self, gy):
        xp = get_array_module(gy)
        n = gy.shape[self.axis]
        return tuple(xp.take(gy, i, axis=self.axis) for i in range(n))


class BroadcastTo(Function):
    def forward(self, x):
        self.x_shape = x.shape
        return get_array_module(x).broadcast_to(x, self.shape)

    def backward(self, gy):
        return sum_to(gy, self.x_shape)


def reshape(x: Any, shape: Sequence[int]) -> Tensor:
    """``x`` with a new shape (one entry may be -1), as ``xp.reshape``."""
    if isinstance(shape, int):
        shape = (shape,)
    return Reshape.apply(x, shape=tuple(shape))


def transpose(x: Any, axes: Sequence[int] | None = None) -> Tensor:
    """Permute the axes of ``x``; ``None`` reverses them."""
    return Transpose.apply(x, axes=None if axes is None else tuple(axes))


def getitem(x: Any, index: Any) -> Tensor:
    """``x[index]`` for basic indices (ints, slices, None, Ellipsis) and integer arrays.

    The backward of integer-array indexing adds the gradients of repeated indices.
    """
    return GetItem.apply(x, index=_index_data(index, get_array_module(x)))


def concat(xs: Sequence[Any], axis: int = 0) -> Tensor:
    """Join tensors along an existing axis, as ``xp.concatenate``."""
    if len(xs) == 0:
        raise ValueError("concat needs at least one tensor, got an empty sequence")
    return Concat.apply(*xs, axis=axis)


def stack(xs: Sequence[Any], axis: int = 0) -> Tensor:
    """Join tensors of one shape along a new axis, as ``xp.stack``."""
    if len(xs) == 0:
        raise ValueError("stack needs at least one tensor, got an empty sequence")
    return Stack.apply(*xs, axis=axis)


def broadcast_to(x: Any, shape: Sequence[int]) -> Tensor:
    """``x`` broadcast to ``shape`` (a read-only view); backward sums back."""
    return BroadcastTo.apply(x, shape=tuple(shape))
