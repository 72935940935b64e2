"""Shared fixtures: the world communicator, and the array modules to run on."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from mpidl.backend import cupy_module


def pytest_configure(config):
    # tests/run.py runs tests/integration in pytest-xdist workers; a test marked `serial`
    # runs after the others, alone (one that needs the cores or a fixed port to itself).
    config.addinivalue_line("markers", "serial: runs alone, after the tier's parallel tests "
                                       "(tests/run.py)")


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
