"""``mpiexec -n N mpidl shard`` on real ranks: the dataset equals one process's, a write
failing on one rank (a real ``EFBIG``: a file-size limit on that process) leaves the old
dataset intact and no partial new one, ``--verify`` gives one verdict on every rank, and
the loader reads a dataset written by N ranks exactly (each sample once per epoch). Run
at 1, 2 and 3 ranks::

    mpiexec -n 3 python -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_shard_mpi.py
"""

from __future__ import annotations

import glob
import os
import resource
import signal
from pathlib import Path

import numpy
import pytest

from mpidl.comm import SingleCommunicator
from mpidl.data import DataLoader, DistributedSampler, ShardedDataset, read_manifest
from mpidl.data.command import main as shard_main
from mpidl.testing import assert_all_ranks
from mpidl.testing.datasets import dataset_differences, sharding_inputs

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

SENTENCES = Path(__file__).resolve().parents[1] / "data" / "sentiment-sentences" / "imdb.tsv"


@pytest.fixture
def inputs(comm, shared_dir):
    """The inputs (written by rank 0) and each kind's options, on every rank."""
    kinds = sharding_inputs(shared_dir, SENTENCES) if comm.rank == 0 else None
    return comm.bcast_obj(kinds)


def test_every_input_kind_gives_one_process_dataset(comm, shared_dir, inputs):
    problems = []
    for kind, options in inputs.items():
        argv = options + ["--rows-per-shard", "17", "--seed", "2"]
        one, many = (os.path.join(shared_dir, f"{kind}-{n}") for n in ("one", "many"))
        if comm.rank == 0:
            problems += [f"{kind}: one process exit {s}" for s in
                         [shard_main(argv + [one], comm=SingleCommunicator())] if s]
        status = shard_main(argv + [many], comm=comm)
        comm.barrier()
        if status:
            problems.append(f"{kind}: exit {status} on rank {comm.rank}")
        elif comm.rank == 0:
            problems += [f"{kind}: {p}" for p in dataset_differences(many, one)]
    assert_all_ranks(comm, not problems, "; ".join(problems[:4]))


def _limit_file_size(limit):
    """Writes past ``limit`` bytes fail with EFBIG (not a SIGXFSZ kill); returns the
    function that lifts the limit again."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))

    def restore():
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)

    return restore


def test_a_write_failing_on_one_rank_keeps_the_old_dataset_and_leaves_no_new_one(
        comm, shared_dir, inputs, capsys):
    out = os.path.join(shared_dir, "d")
    argv = inputs["npz"] + ["--rows-per-shard", "10", out]
    assert_all_ranks(comm, shard_main(argv, comm=comm) == 0, "the first write failed")
    before = read_manifest(os.path.join(out, "train"))
    restore = _limit_file_size(4096) if comm.rank == comm.size - 1 else (lambda: None)
    try:  # a new seed: other shards; the last rank's first shard (~10 KB) cannot be written
        status = shard_main(inputs["npz"] + ["--rows-per-shard", "50", "--seed", "9",
                                             "--force", out], comm=comm)
    finally:
        restore()
    err = capsys.readouterr().err
    problems = []
    if status != 1:
        problems.append(f"exit {status}, not 1 (a storage failure)")
    if comm.rank == 0 and f"rank {comm.size - 1} of {comm.size}" not in err and comm.size > 1:
        problems.append(f"the error does not name the failing rank: {err!r}")
    after = read_manifest(os.path.join(out, "train"))
    if after.dataset_id != before.dataset_id:
        problems.append("the old dataset was replaced")
    left = glob.glob(os.path.join(out, ".mpidl-shard-*"))
    if left:
        problems.append(f"partial new dataset left behind: {left}")
    comm.barrier()
    status = shard_main(["--verify", out], comm=comm)  # the old one, whole
    assert_all_ranks(comm, not problems and status == 0, "; ".join(problems) or "verify failed")


def test_verify_on_every_rank_names_the_bad_shard(comm, shared_dir, inputs, capsys):
    out = os.path.join(shared_dir, "d")
    assert shard_main(inputs["csv"] + ["--rows-per-shard", "9", out], comm=comm) == 0
    bad = sorted(glob.glob(os.path.join(out, "train", "shard-*.h5")))[-1]
    comm.barrier()
    if comm.rank == 0:
        with open(bad, "r+b") as f:  # flip a byte inside the token ids
            f.seek(os.path.getsize(bad) - 100)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    comm.barrier()
    status = shard_main(["--verify", out], comm=comm)
    err = capsys.readouterr().err
    statuses = comm.allgather_obj(status)
    named = comm.allgather_obj(os.path.basename(bad) in err)
    assert_all_ranks(comm, statuses == [2] * comm.size and named[0],
                     f"exit statuses {statuses}; rank 0 names {os.path.basename(bad)}: {named[0]}")


def test_the_loader_reads_a_dataset_written_by_every_rank_exactly(comm, shared_dir, inputs):
    out = os.path.join(shared_dir, "d")
    assert shard_main(inputs["npz"] + ["--rows-per-shard", "7", "--test-fraction", "0",
                                       out], comm=comm) == 0
    ds = ShardedDataset(os.path.join(out, "train"), comm=comm)
    x_all = ds.read("x", numpy.arange(len(ds)))  # row i's bytes name sample i
    sampler = DistributedSampler(len(ds), 12, comm.rank, comm.size, seed=4, shuffle="block",
                                 block_size=3)
    loader = DataLoader(ds, sampler)
    problems = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        seen = []
        for step, (x, _, _) in enumerate(loader):
            ids = sampler.indices(step)
            if not numpy.array_equal(x, x_all[ids], equal_nan=True):
                problems.append(f"epoch {epoch} step {step}: rows differ from their ids'")
            seen.append(ids)
        everything = numpy.sort(comm.allgatherv(numpy.concatenate(seen)))
        if not numpy.array_equal(everything, numpy.arange(len(ds))):
            problems.append(f"epoch {epoch}: {len(everything)} ids read, "
                            f"{len(numpy.unique(everything))} distinct, of {len(ds)}")
    ds.close()
    assert_all_ranks(comm, not problems, "; ".join(problems[:3]))
