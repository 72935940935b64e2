"""Helpers for tests of mpidl code, ours and users': collective verdicts, tolerances.

Import from here: ``from mpidl.testing import assert_all_ranks, tolerance``.
"""
from mpidl.testing.collective import (
    assert_all_ranks,
    assert_allclose_all_ranks,
    describe_mismatch,
    raises_all_ranks,
)
from mpidl.testing.gradcheck import gradcheck, numerical_grad
from mpidl.testing.threads import ThreadCommunicator, run_ranks
from mpidl.testing.tolerance import allclose, tolerance

__all__ = [
    "assert_all_ranks",
    "assert_allclose_all_ranks",
    "describe_mismatch",
    "raises_all_ranks",
    "allclose",
    "gradcheck",
    "numerical_grad",
    "run_ranks",
    "ThreadCommunicator",
    "tolerance",
]
