"""hpc.env and hpc.gpu under a real launcher: the environment agrees with MPI, at any size.

Run as ``mpiexec -n N python -m pytest --with-mpi tests/mpi/test_env_mpi.py`` (N = 1, 2, 3);
every test ends in a collective verdict.
"""
from __future__ import annotations

import socket

import numpy
import pytest

from hpc import cuda_aware, env, gpu
from mpidl.testing import assert_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]


def test_detect_agrees_with_the_world_communicator(comm):
    job = env.detect()
    ok = (job.rank, job.size) == (comm.rank, comm.size)
    assert_all_ranks(comm, ok, f"detect() says rank {job.rank}/{job.size}, MPI says "
                               f"{comm.rank}/{comm.size} (launcher {job.launcher})")


def test_local_ranks_from_the_launcher_number_each_node_from_zero(comm):
    # Open MPI 5 numbers local ranks in its mapping order, not by world rank, so they
    # may differ from Split_type's; what binding needs is that each node's local ranks
    # are 0..local_size-1, each once.
    job = env.detect()
    everyone = comm.allgather_obj((socket.gethostname(), job.local_rank, job.local_size))
    mine = [(lr, ls) for host, lr, ls in everyone if host == everyone[comm.rank][0]]
    ok = (sorted(lr for lr, _ in mine) == list(range(len(mine)))
          and all(ls == len(mine) == comm.local_size for _, ls in mine))
    assert_all_ranks(comm, ok, f"(host, local rank, local size) per rank: {everyone}; "
                               f"Split_type local size {comm.local_size}")


def test_from_mpi_counts_nodes_by_shared_memory_groups(comm):
    if comm.mpi_comm is None:
        pytest.skip("no MPI communicator (size-1 world without a launcher)")
    job = env.from_mpi(comm)
    hosts = comm.allgather_obj(socket.gethostname())
    indices = comm.allgather_obj(job.node_index)
    same_node = all(indices[r] == job.node_index for r in range(comm.size)
                    if hosts[r] == hosts[comm.rank])
    ok = ((job.rank, job.size) == (comm.rank, comm.size)
          and (job.local_rank, job.local_size) == (comm.local_rank, comm.local_size)
          and job.nodes == len(set(hosts)) and same_node
          and sorted(set(indices)) == list(range(job.nodes)))
    assert_all_ranks(comm, ok, f"from_mpi gave {job} for hosts {hosts}, node indices {indices}")


def test_several_ranks_are_recognised_as_an_mpi_launch(comm):
    ok = env.is_mpi_launch() or comm.size == 1
    assert_all_ranks(comm, ok, f"is_mpi_launch() is False on a world of {comm.size}")


def test_every_rank_takes_rank_0s_cuda_aware_verdict(comm):
    verdict = gpu.cuda_aware_mpi(comm=comm)
    everyone = comm.allgather_obj(verdict)
    assert_all_ranks(comm, all(v == everyone[0] for v in everyone),
                     f"verdicts differ across ranks: {everyone}")


def test_verdict_broadcast_works_through_a_plain_mpi4py_communicator(comm):
    if comm.mpi_comm is None:
        pytest.skip("no MPI communicator (size-1 world without a launcher)")
    verdict = gpu.cuda_aware_mpi(comm=comm.mpi_comm)
    everyone = comm.allgather_obj(verdict)
    assert_all_ranks(comm, all(v == everyone[0] for v in everyone), f"{everyone}")


def test_probe_child_is_a_singleton_even_when_started_by_a_rank(comm):
    # Each rank starts its own child at once: each must be a size-1 MPI job, not a
    # process trying to join this launch.
    verdict = cuda_aware.run_probe_child(cuda_aware.probe_command(None), timeout=60)
    assert_all_ranks(comm, verdict.aware, verdict.reason)


def test_node_local_exchange_gives_every_rank_the_same_answer(comm):
    if comm.mpi_comm is None:
        pytest.skip("no MPI communicator (size-1 world without a launcher)")
    result = cuda_aware.node_local_exchange(comm.mpi_comm, numpy, timeout=30)
    everyone = comm.allgather_obj(result)
    shares = comm.local_size > 1
    expected = "ok: ranks 0/1 on" if shares else "skipped: no two ranks share a node"
    assert_all_ranks(comm, all(r == everyone[0] for r in everyone) and
                     result.startswith(expected), f"{everyone}")


def test_node_local_exchange_fails_a_pair_without_cupy(comm):
    if comm.mpi_comm is None or comm.local_size < 2:
        pytest.skip("needs two ranks on one node")
    result = cuda_aware.node_local_exchange(comm.mpi_comm, None, timeout=30)
    assert_all_ranks(comm, result.startswith("FAILED: rank 0 on") and
                     "CuPy cannot be imported" in result, result)


def test_an_aware_verdict_is_confirmed_between_ranks_of_a_node(comm, monkeypatch):
    # The child's cases passed (faked here); the node-local exchange then runs in the
    # job, on numpy buffers standing in for device ones.
    if comm.mpi_comm is None:
        pytest.skip("no MPI communicator (size-1 world without a launcher)")
    passed = {"sendrecv": "ok", "allreduce": "ok", "iallreduce": "ok"}
    monkeypatch.setattr(cuda_aware, "_decide",
                        lambda *a: gpu.Verdict(True, "probe passed", "functional", passed))
    monkeypatch.setattr(gpu, "cupy_module", lambda: numpy)
    verdict = gpu.cuda_aware_mpi(comm=comm, environ={})
    local = verdict.cases.get(cuda_aware.NODE_LOCAL, "")
    ok = verdict.aware and local.startswith("ok" if comm.local_size > 1 else "skipped")
    assert_all_ranks(comm, ok and "node-local sendrecv" in verdict.reason, f"{verdict}")
