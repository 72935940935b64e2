"""hpc: cluster plumbing that knows nothing of deep learning.

- :mod:`hpc.env`: where this process runs (rank, local rank, node, job, time left),
  read from Slurm, Open MPI, MPICH/Hydra and PMIx variables.
- :mod:`hpc.gpu`: rank → GPU binding and the CUDA-aware-MPI probe.
- :mod:`hpc.bench`: OSU-style collective micro-benchmarks and an alpha-beta fit
  (``python -m hpc.bench`` or ``mpidl bench``).
- :mod:`hpc.sbatch`: batch scripts from ``slurm/`` templates for a site profile.
- ``python -m hpc.gpu_check``: an end-to-end check of the GPU path on a GPU machine.

Importing ``hpc`` has no side effects: it does not import mpi4py or cupy and never
initialises MPI or CUDA. ``hpc`` never imports ``mpidl``.
"""
