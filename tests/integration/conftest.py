"""Fixtures of the integration tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A corpus cache directory shared by every test that trains on the small corpus."""
    return str(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def two_epoch_run(tmp_path_factory, cache):
    """An uninterrupted 2-epoch run of the small corpus at 2 ranks (checkpoints at both
    epoch ends), made once per worker (about 12 s on the 2-core CI machine) for
    test_train.py and test_train_reliability.py; a test that writes into it works on a
    copy (trainjob.copy_run)."""
    from trainjob import train

    run = str(tmp_path_factory.mktemp("two-epochs") / "run")
    result = train(2, run, cache, "--epochs=2")
    assert result.returncode == 0, result.output
    return run
