"""Shared fixtures: the world communicator, and the array modules to run on."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mpidl.backend import cupy_module


def pytest_configure(config):
    # tests/run.py runs tests/integration in pytest-xdist workers; a test marked `serial`
    # runs after the others, alone (one that needs the cores or a fixed port to itself).
    config.addinivalue_line("markers", "serial: runs alone, after the tier's parallel tests "
                                       "(tests/run.py)")
    _basetemp_of_this_rank(config)


def _basetemp_of_this_rank(config):
    """Under ``--with-mpi`` on several ranks (tests/run.py's MPI tiers, slurm/test.sbatch,
    ``mpiexec -n 3 python -m pytest --with-mpi``), each rank's pytest keeps its tmp_path
    folders in a folder of its own, named after the job and the rank, removed at the end.

    Every rank is a pytest of its own; on the shared default root (/tmp/pytest-of-USER)
    they prune each other's numbered folders and its ``pytest-current`` link at exit,
    and one of 16 ranks failed on that in CI (FileNotFoundError after every test had
    passed). The job comes from the launcher's environment (no collective here): PMIx's
    namespace (Open MPI 5, Slurm's pmix), else Slurm's job and step, else (a launcher
    that names no job: MPICH's and Intel MPI's Hydra set only ``PMI_RANK``, ``PMI_SIZE``,
    ``PMI_FD``) the process that started this rank, Hydra's proxy: one per node and
    launch, so two jobs at once differ. A ``--basetemp`` given wins.
    """
    import tempfile

    from hpc.env import detect

    if config.option.basetemp or not config.getoption("--with-mpi", default=False):
        return
    place = detect()
    if place.size < 2:
        return
    job = os.environ.get("PMIX_NAMESPACE") or (
        f"{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
        if "SLURM_JOB_ID" in os.environ else f"{place.launcher}-{os.getppid()}")
    safe = "".join(c if c.isalnum() or c in "-." else "-" for c in job)
    config.option.basetemp = os.path.join(tempfile.gettempdir(),
                                          f"mpidl-pytest-{safe}-rank{place.rank}")
    config.add_cleanup(lambda: shutil.rmtree(config.option.basetemp, ignore_errors=True))


@pytest.fixture(scope="session")
def comm():
    """The world communicator (size 1 without a launcher)."""
    from mpidl.comm import world

    return world()


@pytest.fixture
def shared_dir(comm):
    """A directory every rank sees: made by rank 0, its path broadcast; removed after."""
    import shutil
    import tempfile

    path = comm.bcast_obj(tempfile.mkdtemp(prefix="mpidl-test-") if comm.rank == 0 else None)
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _xp_params():
    import numpy

    params = [pytest.param(numpy, id="numpy")]
    cp = cupy_module()
    params.append(pytest.param(
        cp, id="cupy",
        marks=[pytest.mark.gpu] + ([] if cp is not None else
                                   [pytest.mark.skip(reason="CuPy/GPU not available here")]),
    ))
    return params


@pytest.fixture(params=_xp_params())
def xp(request):
    """Each test body runs on numpy and, where a GPU is present, on cupy (as CuPy's tests do)."""
    return request.param


@pytest.fixture(scope="session")
def sentiment_sentences() -> Path:
    """The real labelled review sentences: the copy in ``tests/data`` (CC BY 4.0, credited
    in its README), else ``shared/data/sentiment-sentences`` beside the repository, or
    under ``$MPIDL_SHARED_DATA``; the test is skipped where absent."""
    here = Path(__file__).resolve()
    candidates = [here.parent / "data" / "sentiment-sentences",
                  here.parents[2] / "shared" / "data" / "sentiment-sentences"]
    env = os.environ.get("MPIDL_SHARED_DATA")
    if env:
        candidates[:0] = [Path(env) / "sentiment-sentences", Path(env)]
    for c in candidates:
        if (c / "imdb.tsv").is_file():
            return c
    pytest.skip("shared/data/sentiment-sentences is not present (set MPIDL_SHARED_DATA)")
