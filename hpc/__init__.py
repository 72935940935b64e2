"""hpc: cluster plumbing that knows nothing of deep learning.

- :mod:`hpc.env`: where this process runs (rank, local rank, node, job, time left),
  read from Slurm, Open MPI, MPICH/Hydra and PMIx variables.
- :mod:`hpc.gpu`: rank → GPU binding and the CUDA-aware-MPI probe.
- ``python -m hpc.gpu_check``: an end-to-end check of the GPU path on a GPU machine.

Importing ``hpc`` has no side effects: it does not import mpi4py or cupy and never
initialises MPI or CUDA. ``hpc`` never imports ``mpidl``.
"""
