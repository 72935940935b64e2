"""mpidl.storage: one rule tells a failure of storage from a bug, for the shard writer
and the checkpoints alike, in every shape HDF5 reports it (#38: a full disk during a
checkpoint came as a RuntimeError the checkpointer did not catch, and aborted the job)."""
from __future__ import annotations

import errno
import os

import pytest

from mpidl import storage

# As h5py 3.16 raised it here on a full tmpfs (closing a dataset while saving).
DECREMENT = ("Can't decrement id ref count (file write failed: time = Mon Dec  7 23:28:49 "
             "2026\n, filename = '/x/c.h5.part-00000.tmp', file descriptor = 16, errno = 28, "
             "error message = 'No space left on device', buf = 0x55986ad33ed0, total write "
             "size = 62568, bytes this sub-write = 62568, offset = 225280)")
WRITE = ("[Errno 27] Can't synchronously write data (file write failed: ..., errno = 27, "
         "error message = 'File too large', ...)")


def chained(outer, inner):
    try:
        try:
            raise inner
        except BaseException:
            raise outer
    except BaseException as e:
        return e


@pytest.mark.parametrize("error, number", [
    (RuntimeError(DECREMENT), errno.ENOSPC),                       # HDF5's close, alone
    (chained(RuntimeError("Can't decrement id ref count"),         # on top of the write's
             OSError(errno.EFBIG, WRITE)), errno.EFBIG),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), errno.EDQUOT),  # a plain one
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
    (OSError("Unable to synchronously create file (unable to truncate a file which is "
             "already open)"), errno.EIO),                         # HDF5's, no errno
])
def test_a_failure_of_storage_is_told_with_its_errno_and_the_file(error, number):
    failure = storage.storage_failure(error, "/x/c.h5")
    assert failure.errno == number and failure.filename == "/x/c.h5"
    assert failure.strerror == (os.strerror(number) if number != errno.EIO
                                else str(error))
    assert storage.write_error(error, "/x/c.h5").errno == number


@pytest.mark.parametrize("error", [RuntimeError("dictionary changed size during iteration"),
                                   RuntimeError("errno = 0"), ValueError("bad"),
                                   KeyError("w")])
def test_a_bug_is_not_a_failure_of_storage(error):
    assert storage.storage_failure(error, "/x/c.h5") is None


def test_check_room_refuses_a_file_the_filesystem_cannot_hold(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    storage.check_room(str(tmp_path / "a.h5"), 1)
    with pytest.raises(OSError) as info:
        storage.check_room(str(tmp_path / "a.h5"), free + (1 << 40))
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "a.h5")


def test_check_room_refuses_a_file_past_the_file_size_limit(tmp_path):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(OSError) as info:
            storage.check_room(str(tmp_path / "a.h5"), 2 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert info.value.errno == errno.EFBIG


def test_hdf5_bytes_bounds_the_files_the_checkpoint_writers_make(tmp_path):
    """The bound the room is checked against holds for a file of many small tensors
    (where HDF5's own bytes weigh most) and of a few large ones."""
    import numpy

    from mpidl.train import checkpoint as ckpt

    for count, size in [(1, 1), (300, 3), (4, 100_000)]:
        model = {f"w{i}": numpy.ones(size, numpy.float32) for i in range(count)}
        path = ckpt.save_checkpoint(tmp_path / str(count), 1, model=model, optimizer={},
                                    rng={}, sampler={})
        data = sum(a.nbytes for a in model.values())
        assert os.path.getsize(path) <= storage.hdf5_bytes(data, count)


def _save(comm, directory):
    """M.save_at at ZeRO-3; what the save raised, as text (None if nothing)."""
    from mpidl.comm import DistributedError

    try:
        _sharded_tests().save_at(comm, directory, 3)
    except DistributedError as e:
        return str(e)
    return None


def _sharded_tests():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi",
                        "test_sharded_checkpoint.py")
    spec = importlib.util.spec_from_file_location("_storage_sharded_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("raised", [RuntimeError(DECREMENT),
                                    OSError(errno.ENOSPC, "Can't write data")])
def test_a_full_disk_while_saving_is_said_on_every_rank_and_leaves_no_part(
        tmp_path, monkeypatch, raised):
    """The RuntimeError went past the checkpointer (it caught OSError): rank 1 aborted
    the job with "unhandled exception" and an h5py traceback (#38)."""
    from mpidl.testing import run_ranks
    from mpidl.train import sharded

    write_part = sharded.write_part

    def full(path, step, rank, held):  # rank 1 meets a full disk half-way through
        if rank == 1:
            with open(path + ".tmp", "wb") as f:
                f.write(b"\0" * 100)
            try:
                raise raised
            finally:
                os.remove(path + ".tmp")  # as write_part does on the way out
        return write_part(path, step, rank, held)

    monkeypatch.setattr(sharded, "write_part", full)
    said = run_ranks(2, _save, str(tmp_path), timeout=60)
    assert said[0] == said[1] and said[0] is not None
    part = tmp_path / sharded.part_name(2, 1)
    assert f"cannot write a checkpoint part {part}: No space left on device" in said[0]
    assert "--keep-checkpoints N needs room for N + 1" in said[0]
    assert os.listdir(tmp_path) == []  # rank 0's part removed, rank 1's .tmp too
