"""Containers: modules applied in sequence, and a list of modules."""
from __future__ import annotations

from typing import Any, Iterable, Iterator

from mpidl.nn.module import Module


class ModuleList(Module):
    """A list of modules whose parameters are registered (named ``"0.weight"``, ...).

    Unlike :class:`Sequential` it has no ``forward``: the owner decides how to call them
    (e.g. the layers of a transformer).
    """

    def __init__(self, modules: Iterable[Module] = ()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> "ModuleList":
        if not isinstance(module, Module):
            raise TypeError(f"ModuleList.append: got a {type(module).__name__}, not a Module")
        setattr(self, str(len(self._modules)), module)
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> Module:
        return self.children()[i]

    def __iter__(self) -> Iterator[Module]:
        return iter(self.children())


class Sequential(ModuleList):
    """Apply modules one after another; their parameters are named ``"0.weight"``, ...

    Args:
        *modules: the modules, in the order they are applied.
    """

    def __init__(self, *modules: Module) -> None:
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise TypeError(f"Sequential: argument {i} is a {type(m).__name__}, not a Module")
        super().__init__(modules)

    def forward(self, x: Any) -> Any:
        for m in self.children():
            x = m(x)
        return x
