"""Fixtures of the integration tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A corpus cache directory shared by every test that trains on the small corpus."""
    return str(tmp_path_factory.mktemp("corpus"))
