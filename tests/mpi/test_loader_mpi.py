"""The loader on real ranks over a dataset written by rank 0: exact coverage, the rows
match the ids, global counts add up, exact evaluation, and bad shards raise on every
rank. Run at 1, 2 and 3 ranks::

    mpiexec -n 3 python -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_loader_mpi.py
"""

from __future__ import annotations

import os

import h5py
import numpy
import pytest

from mpidl.data import (
    DataError,
    DataLoader,
    DistributedSampler,
    ExactAccuracy,
    ShardedDataset,
    write_shards,
    write_text_shards,
)
from mpidl.data import loader as loader_module
from mpidl.testing import assert_all_ranks
from mpidl.testing.datasets import edit_manifest, resync_shard

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

N = 233  # not a multiple of the batch or of 2 or 3 ranks


def write_dataset(comm, root, **kw):
    """Rank 0 writes x[i] = (i, -i), y[i] = i % 5 in order (so a row names its sample id)
    into shards of 60, 60, 60, 53 rows; all ranks wait."""
    if comm.rank == 0:
        ids = numpy.arange(N)
        write_shards(
            os.path.join(root, "d"),
            {"x": numpy.stack([ids, -ids], 1).astype(numpy.float32), "y": ids % 5},
            rows_per_shard=60,
            shuffle=False,
            **kw,
        )
    comm.barrier()
    return os.path.join(root, "d", "train")


@pytest.mark.parametrize("reader", ["loop", "thread"])
@pytest.mark.parametrize("mode", ["block", "full"])
def test_every_sample_read_once_and_rows_match_ids(comm, shared_dir, mode, reader, monkeypatch):
    if reader == "thread":  # the reader thread from the second batch on, whatever the loop does
        monkeypatch.setattr(loader_module, "_PROBE_STEPS", 0)
    ds = ShardedDataset(write_dataset(comm, shared_dir), comm=comm)
    sampler = DistributedSampler(
        len(ds), 32, comm.rank, comm.size, seed=7, shuffle=mode, block_size=5
    )
    loader = DataLoader(ds, sampler)
    problems, ids = [], []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        ids = []
        for step, (x, y, count) in enumerate(loader):
            mine = x[:, 0].astype(numpy.int64)
            if not numpy.array_equal(mine, sampler.indices(step)) or not numpy.array_equal(
                y, mine % 5
            ):
                problems.append(f"epoch {epoch} step {step}: rows do not match the sampler's ids")
            total = comm.allreduce(numpy.array([len(x)], dtype=numpy.int64))
            if int(total[0]) != count:
                problems.append(
                    f"step {step}: ranks hold {int(total[0])} samples, global_count {count}"
                )
            ids.append(mine)
        if loader.prefetching != (reader == "thread"):
            problems.append(f"epoch {epoch}: prefetching {loader.prefetching} with {reader}")
    everything = numpy.sort(comm.allgatherv(numpy.concatenate(ids)))
    if not numpy.array_equal(everything, numpy.arange(N)):
        problems.append(
            f"epoch union has {len(everything)} ids, {len(numpy.unique(everything))} distinct"
        )
    assert_all_ranks(comm, not problems, "; ".join(problems[:3]))


def test_exact_accuracy_equals_the_single_process_count(comm, shared_dir):
    ds = ShardedDataset(write_dataset(comm, shared_dir), comm=comm)
    loader = DataLoader(ds, DistributedSampler(len(ds), 50, comm.rank, comm.size, shuffle="none"))
    acc = ExactAccuracy()
    for x, y, _ in loader:
        acc.update((x[:, 0].astype(numpy.int64) % 3), y)  # "predict" i % 3 for label i % 5
    expected = int(numpy.count_nonzero(numpy.arange(N) % 3 == numpy.arange(N) % 5))
    assert_all_ranks(
        comm, acc.counts(comm) == (expected, N), f"counts {acc.counts(comm)} != {(expected, N)}"
    )


def open_error(comm, path, **kw):
    """The DataError message that opening ``path`` gave this rank ("no error" if none),
    and whether every rank got the same one. Collective."""
    try:
        ShardedDataset(path, comm=comm, **kw)
        message = "no error"
    except DataError as e:
        message = str(e)
    return message, len(set(comm.allgather_obj(message))) == 1


@pytest.mark.parametrize("fault", ["missing", "flipped"])
def test_a_bad_shard_raises_the_same_error_on_every_rank(comm, shared_dir, fault):
    path = write_dataset(comm, shared_dir)
    if comm.rank == 0:
        shard = os.path.join(path, "shard-00002.h5")
        if fault == "missing":
            os.remove(shard)
        else:
            with open(shard, "r+b") as f:
                f.seek(-16, os.SEEK_END)
                f.write(b"\xee" * 16)
    comm.barrier()
    message, same = open_error(comm, path, verify="sha256")
    ok = "shard-00002.h5" in message and (
        "missing" in message if fault == "missing" else "sha256" in message
    )
    assert_all_ranks(
        comm,
        ok and same,
        f"expected the same DataError naming shard-00002.h5 everywhere, got {message!r}",
    )


def test_manifest_error_is_raised_on_every_rank(comm, shared_dir):
    message, same = open_error(comm, os.path.join(shared_dir, "nothing-here"))
    assert_all_ranks(comm, "no manifest.json" in message and same, message)


@pytest.mark.parametrize("change, expected", [
    (lambda m: m["shards"][1].update(file="shard-0\x000001.h5"), "holds a NUL byte"),
    (lambda m: m["labels"].update(num_classes=10**9), "num_classes 1000000000 is more than"),
], ids=["nul-in-shard-name", "absurd-num-classes"])
def test_a_corrupt_manifest_raises_the_same_data_error_on_every_rank(
        comm, shared_dir, change, expected):
    path = write_dataset(comm, shared_dir)
    if comm.rank == 0:
        edit_manifest(path, change)
    comm.barrier()
    message, same = open_error(comm, path)
    ok = message.startswith(os.path.join(path, "manifest.json")) and expected in message
    assert_all_ranks(comm, ok and same, f"expected one DataError everywhere, got {message!r}")


def test_a_token_id_out_of_range_raises_the_same_error_on_every_rank(comm, shared_dir):
    path = os.path.join(shared_dir, "t", "train")
    if comm.rank == 0:
        texts = [f"{w} film {i}" for i, w in enumerate(["good", "bad"] * 50)]
        write_text_shards(os.path.join(shared_dir, "t"), texts, ["pos", "neg"] * 50, length=4,
                          rows_per_shard=30, shuffle=False)
        with h5py.File(os.path.join(path, "shard-00002.h5"), "r+") as f:
            f["x"][7, 1] = 99999
        resync_shard(path, 2)
    comm.barrier()
    message, same = open_error(comm, path, verify="sha256")
    ok = "shard-00002.h5: token id 99999 at row 7" in message and "split 'train'" in message
    assert_all_ranks(comm, ok and same, f"expected one DataError everywhere, got {message!r}")
