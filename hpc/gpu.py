"""GPUs for MPI ranks: which device each rank binds, and whether MPI is CUDA-aware.

Each rank must choose its device *before* the first CUDA allocation, or every rank's
context lands on GPU 0 (the "extra processes on GPU 0" OOM of horovod#2625).
:func:`choose_device` is the pure rule; :func:`bind` applies it::

    from hpc import gpu
    device = gpu.bind()          # local rank from hpc.env; CuPy device set if importable
    verdict = gpu.cuda_aware_mpi(comm)   # may MPI read CuPy buffers? (hpc.cuda_aware)

CuPy is imported lazily, inside the functions that need it; without CuPy the binding
is still decided (from ``CUDA_VISIBLE_DEVICES``) and returned.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Mapping, Sequence

from hpc.cuda_aware import Verdict, cuda_aware_mpi

__all__ = ["choose_device", "visible_devices", "cupy_module", "device_count", "bind",
           "describe_device", "Verdict", "cuda_aware_mpi"]


def choose_device(
    local_rank: int, visible: Sequence[str] | None, device_count: int | None
) -> int | None:
    """The device index, within the visible devices, that node-local rank ``local_rank`` uses.

    Args:
        local_rank: this process's rank among the processes on its node.
        visible: the entries of ``CUDA_VISIBLE_DEVICES``, or None when it is unset.
        device_count: devices CUDA reports (it already applies ``CUDA_VISIBLE_DEVICES``),
            or None when not asked, to avoid initialising CUDA.

    Returns:
        None without devices; 0 when one device is visible (Slurm's ``--gpus-per-task=1``
        gives each task its own, always device 0 in its own numbering); otherwise
        ``local_rank % count``, so ranks share devices round-robin when there are more
        ranks than devices on a node.
    """
    if local_rank < 0:
        raise ValueError(
            f"local_rank={local_rank} is negative; it counts processes on a node from 0")
    count = device_count
    if count is None and visible is not None:
        count = len(visible)
    if not count:
        return None
    return 0 if count == 1 else local_rank % count


def visible_devices(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES``, or None when it is unset.

    Follows CUDA's reading: entries after the first invalid one (``-1``) are hidden, and
    ``""`` or Slurm's ``NoDevFiles`` mean no device.
    """
    environ = os.environ if environ is None else environ
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    out: list[str] = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry or entry == "NoDevFiles" or entry.startswith("-"):
            break
        out.append(entry)
    return out


def cupy_module() -> ModuleType | None:
    """The cupy module if it imports, else None. Importing cupy does not touch the GPU."""
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install failing at import
        return None
    return cupy


def device_count(environ: Mapping[str, str] | None = None) -> int | None:
    """How many devices this process can use; from ``CUDA_VISIBLE_DEVICES`` when set.

    Falls back to asking CUDA through CuPy (which initialises the driver, not a
    context). None when neither can tell.
    """
    visible = visible_devices(environ)
    if visible is not None:
        return len(visible)
    cp = cupy_module()
    if cp is None:
        return None
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, or no device: CUDA raises rather than returning 0
        return 0


def bind(local_rank: int | None = None, environ: Mapping[str, str] | None = None) -> int | None:
    """Choose this rank's device and, if CuPy imports, make it the current device.

    Call before the first CUDA allocation.

    Args:
        local_rank: node-local rank; by default read by :func:`hpc.env.detect`.
        environ: the environment to read; ``os.environ`` by default.

    Returns:
        The chosen index within the visible devices, or None without devices.
    """
    if local_rank is None:
        from hpc import env

        local_rank = env.detect(environ).local_rank
    device = choose_device(local_rank, visible_devices(environ), device_count(environ))
    cp = cupy_module()
    if device is not None and cp is not None:
        cp.cuda.Device(device).use()
    return device


def describe_device(device: int) -> dict[str, Any]:
    """Name, PCI bus id and memory of a CuPy device, for reports; ``{}`` without CuPy."""
    cp = cupy_module()
    if cp is None:
        return {}
    props = cp.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    return {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "pci_bus_id": cp.cuda.runtime.deviceGetPCIBusId(device),
        "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
    }
