"""A pipelined model's state under the single-rank model's names, from and to any layout.

Each stage holds its parts' parameters (and its optimizer their state); the functions
here give the single-rank :class:`~mpidl.models.GPT`'s state dict and its optimizer's,
gathered over the tensor group and the pipeline axis, and load them into any layout:
another pipeline size, other virtual stages or layer counts, a tensor grid. So a
checkpoint written by one layout resumes in another. The arrays cross the pipeline
axis pickled (``allgather_obj``) as host arrays: a checkpoint-time exchange, not a
step's, that allocates nothing on any rank's device.
"""
from __future__ import annotations

from typing import Any

from mpidl.backend import as_numpy
from mpidl.parallel import tensor


def part_full_state(part: Any) -> dict[str, Any]:
    """The single-rank names and full arrays of ``part``'s parameters (collective over
    the tensor group when the part is tensor-parallel)."""
    arrays = tensor.full_state_dict(part)
    return {part.full_names()[n]: a for n, a in arrays.items()}


def load_part_state(part: Any, state: dict[str, Any]) -> None:
    """Load ``part``'s parameters from a single-rank state dict (not collective)."""
    local = {n: state[full] for n, full in part.full_names().items()}
    tensor.load_full_state_dict(part, local)


def full_state_dict(model: Any) -> dict[str, Any]:
    """The single-rank model's state dict, on every rank. Collective over the world.

    Each stage gathers its parts' full arrays (over the tensor group), then the
    stages exchange them.
    """
    model.wrapped.before_forward()  # ZeRO: the optimizer's updates are in the shards
    # On the host before the exchange: a pickled CuPy array unpickles as a device array,
    # so every rank would allocate every stage's parameters on its own GPU (#48).
    mine: dict[str, Any] = {}
    for part in model.module.parts:
        mine.update({n: as_numpy(a) for n, a in part_full_state(part).items()})
    merged: dict[str, Any] = {}
    for state in model.grid.pipeline.allgather_obj(mine):
        for name, array in state.items():
            merged.setdefault(name, array)
    order = model.names if model.names is not None else list(merged)
    return {n: merged[n] for n in order}


def full_optimizer_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """What the single-rank optimizer's ``state_dict()`` would be, from this stage's
    ``optimizer`` (built over :meth:`PipelineModel.parameters`, plain data parallelism;
    ZeRO keeps its own sharded state). Collective over the world, as
    :func:`full_state_dict`.
    """
    stage = tensor.full_optimizer_state(optimizer, model.module)
    names = stage_names(model)
    mine = {(names[int(k.split(".")[1])], k.split(".", 2)[2]): _host(v)
            for k, v in stage.items() if k.startswith("state.")}
    merged: dict[tuple[str, str], Any] = {}
    for part in model.grid.pipeline.allgather_obj(mine):
        for key, value in part.items():
            merged.setdefault(key, value)
    order = model.names if model.names is not None else sorted({n for n, _ in merged})
    index = {name: i for i, name in enumerate(order)}
    out = {k: v for k, v in stage.items() if not k.startswith("state.")}
    out.update({f"state.{index[n]}.{what}": v for (n, what), v in
                sorted(merged.items(), key=lambda kv: (index[kv[0][0]], kv[0][1]))})
    return out


def _host(value: Any) -> Any:
    """An array's host copy (see :func:`full_state_dict`); other values as they are."""
    return as_numpy(value) if hasattr(value, "shape") else value


def load_full_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Load a single-rank optimizer state (:func:`full_optimizer_state` of any
    layout) into this stage's ``optimizer`` (not collective)."""
    if model.names is None:
        raise ValueError("load_full_optimizer_state needs the model's parameter names "
                         "(PipelineModel(names=...), as pipeline_gpt passes them)")
    here = {name: i for i, name in enumerate(stage_names(model))}
    stage = {k: v for k, v in state.items() if not k.startswith("state.")}
    for key, value in state.items():
        if key.startswith("state."):
            _, i, what = key.split(".", 2)
            name = model.names[int(i)]
            if name in here:
                stage[f"state.{here[name]}.{what}"] = value
    tensor.load_full_optimizer_state(optimizer, model.module, stage)


def stage_names(model: Any) -> list[str]:
    """The single-rank names of the stage module's parameters, in their order."""
    out = []
    for name, _ in model.module.named_parameters():
        _, j, local = name.split(".", 2)  # "parts.<j>.<the part's own name>"
        out.append(model.module.parts[int(j)].full_names()[local])
    return out


def load_full_state_dict(model: Any, state: dict[str, Any]) -> None:
    """Load a single-rank state dict into this rank's parts (not collective)."""
    for part in model.module.parts:
        load_part_state(part, state)


__all__ = ["full_optimizer_state", "full_state_dict", "load_full_optimizer_state",
           "load_full_state_dict", "load_part_state", "part_full_state", "stage_names"]
