"""mpidl: distributed deep-learning training for HPC machines.

A pure-array neural-network engine (NumPy on CPU, CuPy on GPU, the same code) trained
across many processes with MPI. Importing mpidl has no side effects: it does not import
mpi4py, cupy or h5py, and never initialises MPI or a GPU; the modules that need them
import them.
"""
from mpidl.autograd import Function, Tensor, no_grad, is_grad_enabled

__version__ = "0.1.0"

__all__ = ["Tensor", "Function", "no_grad", "is_grad_enabled", "__version__"]
