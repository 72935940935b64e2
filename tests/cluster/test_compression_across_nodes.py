"""PowerSGD across virtual nodes: a compressed 2-node run over the shaped links trains,
compresses after its uncompressed first steps, and resumes bit for bit from the
checkpoint of its error feedback.

The tiny float64 `mpidl train gpt` of the layout tests, one rank on each of two nodes
(TCP over the veth links the session shapes to 10 Gbit/s), rank 1 from step 5.
"""
from __future__ import annotations

import numpy
import pytest

# the single-machine layout tests' configuration and checks (conftest puts them on the path)
from test_gpt_model_parallel import (  # noqa: F401  (gpt_cache, single: fixtures)
    STEPS, losses, parameters, gpt_cache, single)
from test_modes_across_nodes import train

pytestmark = [pytest.mark.timeout(600)]

POWERSGD = ["--compression=powersgd:1", "--start-powersgd-iter=4"]


def test_a_compressed_two_node_run_resumes_bit_for_bit(cluster, tmp_path, gpt_cache, single):
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves")
    result = train(cluster, (2, 1), whole, gpt_cache, f"--steps={STEPS}", *POWERSGD)
    assert result.returncode == 0, result.output
    ours, theirs = losses(whole), losses(single)
    # steps 1-4 (the first record) uncompressed: data parallelism, the single run's loss;
    # then rank-1 gradients: another, still finite, training
    assert ours[0] == pytest.approx(theirs[0], rel=1e-9), (ours, theirs)
    assert ours[1:] != pytest.approx(theirs[1:], rel=1e-9), (ours, theirs)
    assert numpy.isfinite(ours).all(), ours
    result = train(cluster, (2, 1), halves, gpt_cache, f"--steps={STEPS}", "--stop-at-step=6",
                   *POWERSGD)
    assert result.returncode == 0, result.output
    result = train(cluster, (2, 1), halves, gpt_cache, f"--steps={STEPS}", *POWERSGD)
    assert result.returncode == 0 and "resumed from" in result.output, result.output
    got, want = parameters(halves, STEPS), parameters(whole, STEPS)
    differ = [name for name, value in want.model.items()
              if not numpy.array_equal(got.model[name], value)]
    assert not differ, f"not bit-identical after resuming at step 6: {differ}"
