"""Inside an srun step: what hpc.env and hpc.gpu decide, next to MPI's own view.

Run by tests/slurm/test_env_gpu.py as ``srun --mpi=pmix python tests/slurm/probe.py``.
Rank 0 prints one line ``PROBE {json}`` per rank, in rank order, holding:

- ``detect``: :func:`hpc.env.detect` from the launcher's variables, read *before*
  MPI is initialised (as a GPU binding must be);
- ``mpi``: :func:`hpc.env.from_mpi` (rank, size and node-local group from MPI itself);
- ``visible``, ``device``, ``bind``: ``CUDA_VISIBLE_DEVICES`` as hpc.gpu reads it, the
  index :func:`hpc.gpu.choose_device` picks within it, and what :func:`hpc.gpu.bind`
  returns;
- ``environ``: the Slurm and thread variables the task saw.
"""
from __future__ import annotations

import dataclasses
import json
import os

from hpc import env, gpu

detected = env.detect()
launched = env.is_mpi_launch()
visible = gpu.visible_devices()
record = {
    "detect": dataclasses.asdict(detected),
    "is_mpi_launch": launched,
    "visible": visible,
    "device": gpu.choose_device(detected.local_rank, visible, gpu.device_count()),
    "bind": gpu.bind(),
    "environ": {k: v for k, v in os.environ.items()
                if k.startswith(("SLURM_", "SLURMD_"))
                or k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")},
}

from mpi4py import MPI  # noqa: E402  (after detect: a binding happens before MPI_Init)

comm = MPI.COMM_WORLD
record["mpi"] = dataclasses.asdict(env.from_mpi(comm))
records = comm.gather(record, root=0)
if comm.rank == 0:
    for r in records:
        print("PROBE " + json.dumps(r, sort_keys=True), flush=True)
