"""The ``mpidl`` command: one entry point, a sub-command per task.

Run under a launcher for several ranks::

    mpiexec -n 2 mpidl train                 # the built-in reviews task
    srun --mpi=pmix mpidl train my.toml --epochs=3
    mpiexec -n 3 mpidl run my_script.py ARGS # a user's script, aborting all ranks on error
    mpidl shard --from-csv reviews.csv --text-col review --label-col sentiment data/
    mpiexec -n 2 mpidl eval runs/reviews     # score a run's checkpoint on its test split
    echo "great stay" | mpidl predict runs/reviews
    mpidl checkpoint consolidate runs/reviews  # one full file of the newest checkpoint
    mpidl info

Every sub-command runs under the global exception hook (:mod:`mpidl.excepthook`): an
unhandled exception on one rank prints ``rank N/size: <traceback>`` and aborts the
whole job instead of leaving the other ranks hanging in a collective. And under the
watchdog (:mod:`mpidl.comm.watchdog`): a collective that waits longer than
``MPIDL_TIMEOUT`` (600 s by default), or a rank that exits while others wait for it,
ends the job with a report of what every rank was doing.
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys
from typing import Callable, Sequence

# name -> ("module:function", one-line help). Modules are imported only when their
# command runs, so `mpidl info` does not pay for h5py and `mpidl shard` not for MPI.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mpidl.train.command:main",
              "train a model data-parallel (default: the reviews task)"),
    "eval": ("mpidl.train.inference:eval_main",
             "evaluate a run's checkpoint on a test split: accuracy, macro-F1, confusion"),
    "predict": ("mpidl.train.predict:main",
                "classify new inputs (text lines, feature rows) with a run's checkpoint"),
    "shard": ("mpidl.data.command:main", "write or verify a sharded HDF5 dataset"),
    "plot": ("mpidl.train.plot:main", "plot a run's metrics to PNG (needs the [plot] extra)"),
    "checkpoint": ("mpidl.train.consolidate:main",
                   "consolidate a sharded checkpoint into one full file (eval, sharing)"),
    "export": ("mpidl.interop.command:export_main",
               "write a run's model as safetensors, a PyTorch state dict or a Hugging Face GPT-2"),
    "import": ("mpidl.interop.command:import_main",
               "make a run directory from a Hugging Face GPT-2 (to fine-tune, eval, predict)"),
    "info": ("mpidl.info:main", "report MPI, ranks, nodes, GPUs, library versions"),
    "sbatch": ("hpc.sbatch:main", "render a Slurm batch script for a site profile"),
    "bench": ("hpc.bench:main", "collective micro-benchmarks: latency, busbw, alpha-beta fit"),
    "plan": ("mpidl.plan_command:main", "predict time, speedup and break-even for N ranks"),
    "demo": ("mpidl.demo:main", "a short demonstration of the communicator on all ranks"),
    "run": ("mpidl.cli:run_main", "run a Python script with the abort-all-ranks exception hook"),
    "launch": ("hpc.launch:main", "run mpiexec so that SIGTERM checkpoints and exits 75"),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: mpidl COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`mpidl COMMAND --help` describes a command."]
    return "\n".join(lines)


def _resolve(target: str) -> Callable[[Sequence[str]], int | None]:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def run_main(argv: Sequence[str]) -> int:
    """``mpidl run SCRIPT.py [ARGS]``: run a script as ``__main__`` under the hook."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mpidl run SCRIPT.py [ARGS ...]\n\n"
              "Runs SCRIPT.py as __main__ (sys.argv = [SCRIPT.py, ARGS...]). An unhandled\n"
              "exception on any rank prints that rank's traceback and aborts every rank.")
        return 0 if argv else 2
    if not os.path.isfile(argv[0]):
        print(f"mpidl run: error: {argv[0]!r} is not a file; name a Python script "
              "(mpidl run SCRIPT.py [ARGS ...])", file=sys.stderr)
        return 2
    sys.argv = list(argv)
    # As `python SCRIPT.py` does: the script's directory first on the path, so that it
    # imports the modules that sit next to it.
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpidl`` console script and ``python -m mpidl``."""
    from mpidl import excepthook
    from mpidl.comm import watchdog

    excepthook.install()
    watchdog.enable()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"mpidl: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from mpidl.comm import LaunchError

    try:
        code = _resolve(COMMANDS[name][0])(rest)
    except LaunchError as e:  # N size-1 worlds: refused before any work, by rank 0 only
        if e.launcher_rank == 0:
            print(f"mpidl {name}: error: {e}", file=sys.stderr, flush=True)
        _note_exit(2)
        return 2
    except SystemExit as e:  # sys.exit in a command or a user's script: say so at exit
        _note_exit(e.code)
        raise
    except BrokenPipeError:
        # `mpidl shard ... | head`: the reader left. Not an error of the command's:
        # quiet, as a Unix tool is (Python's documented way: stdout to devnull).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        _note_exit(1)
        return 1
    _note_exit(code or 0)
    return int(code or 0)


def _note_exit(code: object) -> None:
    from mpidl.comm import watchdog

    if watchdog.current() is not None:
        watchdog.current().note_exit(code)
