"""Every parallel mode across virtual nodes gives the single-rank result in float64.

`mpidl train gpt` (the tiny float64 configuration of the single-machine layout tests)
at 2 nodes x 2 ranks and 3 nodes x 1 rank: data parallelism flat and overlapped, ZeRO
1-3, tensor parallelism inside a node with data or sequence parallelism across nodes,
pipeline stages across nodes (with data or tensor parallelism inside);
a checkpoint written on one layout resumes on another. Under MPICH too (Hydra's
mpiexec, the ranks in the MPICH wheel's venv): data parallelism, ZeRO-3 and tensor x
ring at 2 nodes x 2 ranks, against the same single-rank run. The hierarchical exchange, which
`mpidl train` does not offer, runs tests/mpi's own checks of it on the nodes. Traffic
between nodes is TCP over the veth links; inside a node, shared memory.
"""
from __future__ import annotations

import sys

import numpy
import pytest

# the single-machine layout tests' configuration and checks (conftest puts them on the path)
from test_gpt_model_parallel import (  # noqa: F401  (gpt_cache, single: fixtures)
    GPT, STEPS, accuracies, assert_same_model, evals, gpt_cache, losses, parameters, single)

from clusterci import mpi as named, param

pytestmark = [pytest.mark.timeout(600)]


def train(cluster, layout, run, cache, *args, prefix=(), mpi=None):
    """``mpidl train`` on the nodes, with ``mpi`` (a :class:`clusterci.Mpi`; Open MPI
    and this Python if None)."""
    python = mpi.python if mpi else sys.executable
    cmd = [*prefix, python, "-m", "mpidl", "train", *GPT, f"--data.cache-dir={cache}",
           f"--run-dir={run}", *args]
    return cluster.mpiexec(layout, cmd, timeout=400, mpi=mpi)


def assert_trains_like_one_rank(run, single, what):
    numpy.testing.assert_allclose(losses(run), losses(single), rtol=1e-9, err_msg=what)
    assert_same_model(parameters(run, STEPS), parameters(single, STEPS), what)
    ours, theirs = evals(run)[-1], evals(single)[-1]
    assert ours["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-9), what
    assert accuracies(run) == accuracies(single), what


MODES = [
    ((2, 2), ["--overlap=false"]),                                   # flat data parallel
    ((2, 2), ["--overlap=true"]),
    ((2, 2), ["--zero=1"]),
    ((2, 2), ["--zero=2"]),
    ((2, 2), ["--zero=3"]),
    ((2, 2), ["--tensor-parallel=2"]),                               # tensor in, data across
    ((2, 2), ["--tensor-parallel=2", "--sequence-parallel=ring"]),   # ... sequence across
    # The pipeline is the outermost axis: its two stages on the two nodes, activations
    # and their gradients point to point over TCP (the single run with the same batch:
    # two microbatches' gradients summed equal the batch's to rounding).
    ((2, 2), ["--pipeline-parallel=2", "--microbatches=2"]),          # stages across, data in
    ((2, 2), ["--pipeline-parallel=2", "--tensor-parallel=2", "--microbatches=2"]),
    ((3, 1), ["--overlap=false"]),
    ((3, 1), ["--overlap=true"]),
    ((3, 1), ["--zero=1"]),
    ((3, 1), ["--zero=2"]),
    ((3, 1), ["--zero=3"]),
    ((3, 1), ["--sequence-parallel=ulysses"]),                       # 3 heads over 3 nodes
]
# MPICH (Hydra launches the nodes' proxies through the same agent): data parallelism,
# ZeRO-3 and tensor x ring sequence parallelism, with traffic inside and between nodes.
MPICH_MODES = [
    ((2, 2), ["--overlap=false"]),
    ((2, 2), ["--overlap=true"]),
    ((2, 2), ["--zero=3"]),
    ((2, 2), ["--tensor-parallel=2", "--sequence-parallel=ring"]),
]
RUNS = [param(name, (n, k), args, id=f"{n}x{k}-" + "-".join(a.lstrip("-") for a in args))
        for name, modes in (("openmpi", MODES), ("mpich", MPICH_MODES))
        for (n, k), args in modes]


@pytest.mark.parametrize("mpi,layout,mode", RUNS)
def test_every_mode_across_nodes_trains_the_single_rank_models_steps(
        cluster, tmp_path, gpt_cache, single, mpi, layout, mode):
    mpi = named(mpi)
    run = str(tmp_path / "run")
    result = train(cluster, layout, run, gpt_cache, f"--steps={STEPS}", *mode, mpi=mpi)
    assert result.returncode == 0, result.output
    assert_trains_like_one_rank(run, single, f"{mpi.name} " + " ".join(mode))


def test_a_checkpoint_from_two_nodes_resumes_on_three(cluster, tmp_path, gpt_cache, single):
    """Steps 1-6 with tensor parallelism in each of 2 nodes and ZeRO-2 across them, 7-12
    on 3 nodes with ZeRO-3: the single-rank run's steps."""
    run = str(tmp_path / "run")
    result = train(cluster, (2, 2), run, gpt_cache, f"--steps={STEPS}", "--stop-at-step=6",
                   "--tensor-parallel=2", "--zero=2")
    assert result.returncode == 0, result.output
    result = train(cluster, (3, 1), run, gpt_cache, f"--steps={STEPS}", "--zero=3")
    assert result.returncode == 0, result.output
    assert "resumed from" in result.output
    assert_same_model(parameters(run, STEPS), parameters(single, STEPS), "2x2 -> 3x1")


# tests/mpi's checks of the hierarchical exchange (node-local reduce, leaders' allreduce
# over the network, node-local broadcast) against one rank, and of DataParallel's other
# transports. Not test_hierarchical_with_compression_compresses_between_nodes_only: it
# expects the real nodes to be one node.
HIERARCHICAL = ("test_hierarchical_allreduce_matches_flat or "
                "test_a_parameter_only_rank_0_reaches_gets_its_gradient_on_every_rank or "
                "test_a_bucket_sent_in_several_messages_is_summed_whole")


@pytest.mark.parametrize("layout", [(2, 2), (3, 1)], ids=["2x2", "3x1"])
def test_the_hierarchical_exchange_across_nodes_matches_one_rank(cluster, layout):
    result = cluster.mpiexec(layout, [
        sys.executable, "-m", "pytest", "--with-mpi", "-p", "no:cacheprovider", "-q",
        "tests/mpi/test_data_parallel.py", "-k", HIERARCHICAL],
        timeout=300)
    assert result.returncode == 0, result.output
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout
