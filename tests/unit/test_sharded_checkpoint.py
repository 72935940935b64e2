"""Sharded checkpoints without MPI: the run arithmetic, part and index round trips,
damage named, old formats, and resharding between rank counts and layouts on thread
ranks (the bodies of tests/mpi/test_sharded_checkpoint.py, and more)."""
from __future__ import annotations

import importlib.util
import json
import os
import types

import numpy
import pytest

from mpidl.models import gpt, mlp
from mpidl.optim import SGD, AdamW
from mpidl.parallel import ShardedDataParallel, parallel_gpt
from mpidl.parallel.holdings import Held, Key, clip, merge, overlap, runs_array
from mpidl.parallel.tensor import Shard, shard_runs
from mpidl.testing import run_ranks
from mpidl.testing.models import full_parameters
from mpidl.train import checkpoint as ckpt
from mpidl.train.checkpoint import CheckpointError
from mpidl.train.checkpointer import LoadError, choose_checkpointer
from mpidl.train.layout import Layout, LayoutPlan
from mpidl.train.pieces import load as load_pieces

_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi",
                     "test_sharded_checkpoint.py")
_spec = importlib.util.spec_from_file_location("_threads_sharded_checkpoint", _path)
M = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(M)


# -- runs -------------------------------------------------------------------------------------

def elements(runs):
    return numpy.concatenate([numpy.arange(s, s + n) for s, n in runs]) if len(runs) else \
        numpy.zeros(0, dtype=numpy.int64)


def test_clip_takes_local_elements_across_run_boundaries():
    runs = runs_array([(10, 3), (20, 4), (30, 2)])  # local 0-2, 3-6, 7-8
    for lo in range(10):
        for hi in range(lo, 10):
            assert list(elements(clip(runs, lo, hi))) == list(elements(runs)[lo:hi])


def test_merge_joins_adjacent_runs_only():
    assert merge(runs_array([(0, 2), (2, 3), (6, 1), (7, 1)])).tolist() == [[0, 5], [6, 2]]


def test_overlap_maps_shared_elements_between_two_orders():
    rng = numpy.random.default_rng(0)
    for _ in range(200):
        a = numpy.sort(rng.choice(60, size=rng.integers(0, 40), replace=False))
        b = numpy.sort(rng.choice(60, size=rng.integers(0, 40), replace=False))
        ra, rb = merge(runs_array([(x, 1) for x in a])), merge(runs_array([(x, 1) for x in b]))
        got = {}
        for mine, theirs, n in overlap(ra, rb):
            for k in range(n):
                got[a[mine + k]] = b[theirs + k]
        shared = set(a) & set(b)
        assert got == {x: x for x in shared}


@pytest.mark.parametrize("shape,axis,groups", [((6, 4), 0, 1), ((6, 4), 1, 1), ((3, 12, 2), 1, 3),
                                               ((12,), 0, 3), ((5, 7), 1, 1)])
def test_a_tensor_parallel_shard_runs_name_exactly_the_elements_take_keeps(shape, axis, groups):
    full = numpy.arange(int(numpy.prod(shape))).reshape(shape)
    n = shape[axis] // groups
    for size in range(1, min(n, 3) + 1):
        counts = tuple(numpy.diff(numpy.linspace(0, n, size + 1).astype(int)))
        for rank in range(size):
            shard = Shard(axis, counts, types.SimpleNamespace(rank=rank, size=size), groups)
            local = shard.take(full)
            p = types.SimpleNamespace(shard=shard)
            got_shape, runs = shard_runs(p, local.shape)
            assert got_shape == shape
            assert elements(runs).tolist() == local.reshape(-1).tolist()


# -- resharding on thread ranks ------------------------------------------------------------------

def save_then_load(tmp_path, saved, loaded):
    """Save at ``saved`` = (ranks, layout), load at ``loaded``; the loaded parameters and
    one more step equal one rank's (the reference of the same global batches)."""
    directory = str(tmp_path / f"{saved}-{loaded}")
    ranks, layout = saved
    run_ranks(ranks, M.save_at, directory, layout, timeout=60)
    path = os.path.join(directory, ckpt.checkpoint_name(2))

    def load(comm):
        model, wrapper, opt = M.build(comm, loaded[1], seed=9)
        checkpointer = choose_checkpointer(comm, None, wrapper, model, opt)
        read = checkpointer.load(ckpt.load_checkpoint(path, "none"))
        held = checkpointer.holdings()[0]
        got = full_parameters(wrapper)
        return read, sum(h.count for h in held), got, model, wrapper, opt
    return run_ranks(loaded[0], load, timeout=60)


@pytest.mark.parametrize("saved,loaded", [((3, 3), (2, 1)), ((3, 3), (1, 0)), ((2, 0), (3, 2)),
                                          ((1, 0), (3, 3)), ((2, 2), (3, 3))])
def test_a_checkpoint_reshards_to_another_rank_count_and_stage_reading_only_its_share(
        tmp_path, saved, loaded):
    results = save_then_load(tmp_path, saved, loaded)
    # The reference batches are the saving run's: its rank count sets their size.
    expected, _ = M.reference(types.SimpleNamespace(size=saved[0]), 2)
    for read, held, got, *_ in results:
        assert read == held
        for name, q in expected.named_parameters():
            numpy.testing.assert_allclose(got[name], q.data, rtol=1e-12, atol=1e-12)
    if loaded[1]:  # ZeRO: the ranks' reads add up to the state once
        total = 3 * sum(p.size for p in expected.parameters())
        assert sum(r for r, *_ in results) == total


def test_only_one_replica_writes_replicated_state(tmp_path):
    run_ranks(3, M.save_at, str(tmp_path), 0, timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-00000002.h5",
                                            "checkpoint-00000002.h5.part-00000"]


def test_a_tensor_parallel_grid_and_a_grid_with_zero_save_the_single_rank_model(tmp_path):
    kw = dict(vocab=11, seq_len=16, dim=8, layers=2, heads=4, ffn=24, seed=2, dtype="float64")
    expected = gpt(**kw).state_dict()

    def save(comm, zero, directory):
        layout = Layout(LayoutPlan(tensor=2, data=comm.size // 2, zero=zero), comm)
        model = parallel_gpt(layout.grid, **kw)
        wrapper = (ShardedDataParallel(model, layout.replicas, stage=zero) if zero
                   else types.SimpleNamespace())
        opt = AdamW(wrapper.parameters() if zero else model.parameters(), lr=0.1)
        path = choose_checkpointer(comm, layout, wrapper, model, opt).save(
            directory, 1, rng={}, sampler={})
        layout.free()
        return path

    for zero in (0, 3):
        directory = str(tmp_path / str(zero))
        path = run_ranks(4, save, zero, directory, timeout=60)[0]
        full = ckpt.load_checkpoint(path, "model")
        assert list(full.model) == list(expected)
        for name, value in expected.items():
            numpy.testing.assert_array_equal(full.model[name], value, err_msg=name)

        def load(comm):  # the other way: into a grid of another tensor size
            layout = Layout(LayoutPlan(tensor=3, data=1), comm)
            model = parallel_gpt(layout.grid, **dict(kw, seed=5))
            opt = AdamW(model.parameters(), lr=0.1)
            choose_checkpointer(comm, layout, None, model, opt).load(
                ckpt.load_checkpoint(path, "none"), optimizer=False)
            got = model.full_state_dict()
            layout.free()
            return got
        for got in run_ranks(3, load, timeout=60):
            for name, value in expected.items():
                numpy.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("size, layout", [(1, 0), (1, 3), (3, 0), (3, 1), (3, 2), (3, 3)])
def test_batch_norm_statistics_come_back_from_a_sharded_checkpoint_on_thread_ranks(
        tmp_path, size, layout):
    # Read whole (consolidate, eval, predict) and resumed in another layout.
    body = M.test_batch_norm_statistics_come_back_from_a_sharded_checkpoint_whole_and_resharded
    run_ranks(size, body, str(tmp_path), layout, timeout=60)


# -- formats -------------------------------------------------------------------------------------

def one_rank_saved(tmp_path, layout=3):
    return run_ranks(1, M.save_at, str(tmp_path), layout)[0]


def test_a_sharded_checkpoint_reads_back_whole_or_model_only_or_just_its_index(tmp_path):
    path = one_rank_saved(tmp_path)
    full = ckpt.load_checkpoint(path)
    assert full.format_version == 3 and full.step == 2 and full.config == "x = 1"
    assert full.rng == {"numpy": {"seed": 1}} and full.sampler == {"epoch": 0, "index": 2}
    assert {"step", "lr", "state.0.exp_avg", "state.3.step"} <= set(full.optimizer)
    assert set(ckpt.load_checkpoint(path, "model").optimizer) == set()
    none = ckpt.load_checkpoint(path, "none")
    assert none.model == {} and none.index is not None


def flip_a_byte(path, dataset):
    import h5py

    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 3)
        byte = fh.read(1)
        fh.seek(offset + 3)
        fh.write(bytes([byte[0] ^ 0xFF]))


def load_fresh(path, layout=0, optimizer=None):
    def body(comm):
        model, wrapper, opt = M.build(comm, layout, seed=9)
        opt = optimizer(wrapper.parameters()) if optimizer else opt
        choose_checkpointer(comm, None, wrapper, model, opt).load(
            ckpt.load_checkpoint(path, "none"))
    return body


def test_a_corrupt_piece_is_named_with_its_part_and_tensor(tmp_path):
    path = one_rank_saved(tmp_path)
    part = path + ".part-00000"
    flip_a_byte(part, "0")
    with pytest.raises(LoadError, match=r"part-00000 is corrupt: piece 0 \(model:layers"):
        run_ranks(1, load_fresh(path))
    with pytest.raises(CheckpointError, match="part-00000 is corrupt"):
        ckpt.load_checkpoint(path)


def held_of(key, runs, shape):
    """A record of ``runs`` of the tensor ``key`` that keeps what a load writes into it."""
    got = {}
    runs = runs_array(runs)
    return got, Held(key, shape, numpy.dtype(numpy.float64), runs, lambda: None,
                     lambda values: got.setdefault("values", values.copy()))


def load_records(path, key, runs, shape):
    got, held = held_of(key, runs, shape)
    with ckpt.open_source(ckpt.load_checkpoint(path, "none"), []) as source:
        read = load_pieces(source, [held])
    return read, got["values"]


def test_a_record_of_any_runs_loads_exactly_those_elements(tmp_path):
    """The index's [first, last) bound of each piece is exclusive: a record that needs
    only a piece's first or last element still finds that piece."""
    path = one_rank_saved(tmp_path, layout=0)  # one piece per tensor, held whole
    full = ckpt.load_checkpoint(path, "model").model["layers.0.weight"].reshape(-1)  # (77,)
    for runs in [[(0, 1)], [(76, 1)], [(0, 1), (76, 1)], [(5, 20)], [(70, 7)], [(0, 77)]]:
        read, values = load_records(path, Key("model", "layers.0.weight"), runs, (11, 7))
        want = numpy.concatenate([full[s:s + n] for s, n in runs])
        assert read == want.size
        numpy.testing.assert_array_equal(values, want, err_msg=str(runs))


def test_a_rank_reads_only_the_blocks_of_a_piece_that_hold_its_elements(tmp_path,
                                                                       monkeypatch):
    """Damage in a block the record does not need goes unread; in one it needs, it is
    named by its elements."""
    import h5py

    from mpidl.train import sharded

    monkeypatch.setattr(sharded, "BLOCK_BYTES", 64)  # 8 float64 elements a block
    path = one_rank_saved(tmp_path, layout=0)
    full = ckpt.load_checkpoint(path, "model").model["layers.0.weight"].reshape(-1)  # (77,)
    part = path + ".part-00000"
    with h5py.File(part, "r") as f:
        name = next(n for n, ds in f.items() if not n.endswith(".runs") and
                    json.loads(ds.attrs["key"]) == ["model", "layers.0.weight", ""])
        assert f[name].attrs["block"] == 8 and f[name].size == 77
        offset = f[name].id.get_offset()
    with open(part, "r+b") as fh:  # element 74, in the last block (72-76)
        fh.seek(offset + 74 * 8)
        byte = fh.read(1)
        fh.seek(offset + 74 * 8)
        fh.write(bytes([byte[0] ^ 0xFF]))
    key = Key("model", "layers.0.weight")
    read, values = load_records(path, key, [(0, 10), (40, 32)], (11, 7))  # blocks 0-1, 5-8
    assert read == 42
    numpy.testing.assert_array_equal(values, numpy.concatenate([full[:10], full[40:72]]))
    with pytest.raises(CheckpointError, match=r"elements 72-76 fail their checksum"):
        load_records(path, key, [(71, 2)], (11, 7))


def test_a_missing_part_is_named_before_any_state_is_read(tmp_path):
    path = run_ranks(2, M.save_at, str(tmp_path), 2)[0]
    os.remove(path + ".part-00001")
    with pytest.raises(CheckpointError, match="lacks 1 of its parts.*part-00001"):
        ckpt.load_checkpoint(path, "none")
    with pytest.warns(RuntimeWarning, match="skipping checkpoint"):
        assert ckpt.latest_checkpoint(str(tmp_path)) is None


def test_another_model_or_optimizer_is_said_so(tmp_path):
    path = one_rank_saved(tmp_path)

    def other_model(comm):
        model = mlp(sizes=(7, 12, 5), seed=1, dtype="float64")
        opt = AdamW(model.parameters(), lr=0.1)
        choose_checkpointer(comm, None, types.SimpleNamespace(), model, opt).load(
            ckpt.load_checkpoint(path, "none"))
    with pytest.raises(LoadError, match="shape") as e:
        run_ranks(1, other_model)
    assert e.value.kind == "model"
    with pytest.raises(LoadError, match="unexpected keys") as e:
        run_ranks(1, load_fresh(path, optimizer=lambda ps: SGD(ps, lr=0.1, momentum=0.9)))
    assert e.value.kind == "optimizer"


@pytest.mark.parametrize("layout", [0, 1, 3])
def test_a_format_2_file_loads_into_any_layout(tmp_path, layout):
    model, opt = M.reference(types.SimpleNamespace(size=2), 2)
    path = ckpt.save_checkpoint(str(tmp_path), 2, model=model.state_dict(),
                                optimizer=opt.state_dict(), rng={}, sampler={})

    def body(comm):
        fresh, wrapper, fresh_opt = M.build(comm, layout, seed=9)
        choose_checkpointer(comm, None, wrapper, fresh, fresh_opt).load(
            ckpt.load_checkpoint(path, "none"))
        return full_parameters(wrapper)
    for got in run_ranks(3, body):
        for name, q in model.named_parameters():
            numpy.testing.assert_array_equal(got[name], q.data)


def test_a_format_2_checkpoint_with_zero_companions_still_loads(tmp_path):
    from mpidl.parallel.zero_state import state_pieces

    def save_old(comm):  # what the trainer wrote before format 3
        model, wrapper, opt = M.build(comm, 2)
        M.train(comm, wrapper, opt, M.batches(2, M.PER_RANK * comm.size))
        pieces, optimizer = state_pieces(wrapper, opt)
        if comm.rank:
            ckpt.save_companion(str(tmp_path), 2, comm.rank, model=pieces, optimizer=optimizer)
        comm.barrier()
        if comm.rank == 0:
            ckpt.save_checkpoint(str(tmp_path), 2, model=pieces, optimizer=optimizer, rng={},
                                 sampler={}, extra={"layout": {
                                     "kind": "pieces", "ranks": comm.size, "zero": 2,
                                     "order": [n for n, _ in model.named_parameters()]}})
    run_ranks(2, save_old)
    path = os.path.join(str(tmp_path), ckpt.checkpoint_name(2))
    expected, _ = M.reference(types.SimpleNamespace(size=2), 2)

    def body(comm):
        fresh, wrapper, opt = M.build(comm, 3, seed=9)
        choose_checkpointer(comm, None, wrapper, fresh, opt).load(
            ckpt.load_checkpoint(path, "none"))
        return full_parameters(wrapper)
    for got in run_ranks(3, body):
        for name, q in expected.named_parameters():
            numpy.testing.assert_allclose(got[name], q.data, rtol=1e-12, atol=1e-12)


def test_keep_last_removes_old_parts_and_parts_without_an_index(tmp_path):
    for step in (1, 2, 3):
        def save(comm, step=step):
            model, wrapper, opt = M.build(comm, 3)
            choose_checkpointer(comm, None, wrapper, model, opt).save(
                str(tmp_path), step, rng={}, sampler={})
        run_ranks(2, save)
    os.remove(tmp_path / ckpt.checkpoint_name(3))  # killed before its index
    ckpt.keep_last(str(tmp_path), 1)
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint-00000002.h5", "checkpoint-00000002.h5.part-00000",
        "checkpoint-00000002.h5.part-00001"]


# -- mpidl checkpoint consolidate ----------------------------------------------------------------

def test_consolidate_writes_one_full_format_2_file_equal_to_the_sharded_one(tmp_path, capsys):
    from mpidl.train.consolidate import main

    run = tmp_path / "run"
    path = run_ranks(3, M.save_at, str(run / "checkpoints"), 3)[0]
    assert main(["consolidate", str(run)]) == 0
    out = run / "consolidated" / "checkpoint-00000002.h5"
    assert f"-> {out}" in capsys.readouterr().out
    full, sharded = ckpt.load_checkpoint(str(out)), ckpt.load_checkpoint(path)
    assert full.format_version == 2 and full.index is None and full.step == 2
    assert list(full.model) == list(sharded.model) and full.optimizer.keys() == \
        sharded.optimizer.keys()
    for name in full.model:
        numpy.testing.assert_array_equal(full.model[name], sharded.model[name])
    for key, value in full.optimizer.items():
        numpy.testing.assert_array_equal(value, sharded.optimizer[key])
    assert (full.rng, full.sampler, full.config) == (sharded.rng, sharded.sampler, "x = 1")
    assert main(["consolidate", path, str(tmp_path / "mine.h5")]) == 0
    assert ckpt.load_checkpoint(str(tmp_path / "mine.h5")).step == 2


def test_consolidate_names_a_damaged_part_and_writes_nothing(tmp_path, capsys):
    from mpidl.train.consolidate import main

    path = run_ranks(2, M.save_at, str(tmp_path), 1)[0]
    flip_a_byte(path + ".part-00001", "0")
    assert main(["consolidate", path, str(tmp_path / "out.h5")]) == 2
    assert "part-00001 is corrupt" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out.h5")
    assert main(["consolidate", str(tmp_path / "nothing")]) == 2


def consolidate_main(*argv):
    from mpidl.train.consolidate import main

    return main(["consolidate", *map(str, argv)])


def two_checkpoints(tmp_path):
    """A run with sharded checkpoints at steps 2 and 4 (2 ranks, ZeRO-1)."""
    directory = str(tmp_path / "run" / "checkpoints")
    run_ranks(2, M.save_at, directory, 1)
    return tmp_path / "run", run_ranks(2, M.save_at, directory, 1, 4)[0]


def test_consolidate_never_writes_over_a_file_of_the_checkpoints_it_reads(tmp_path, capfd):
    run, newest = two_checkpoints(tmp_path)
    older = str(run / "checkpoints" / "checkpoint-00000002.h5")
    for out in (newest + ".part-00000", older, older + ".part-00001", newest):
        for force in ((), ("--force",)):
            assert consolidate_main(run, out, *force) == 2, out
            err = capfd.readouterr().err
            assert f"{out} lies in {run / 'checkpoints'}, which this command reads: it is " \
                   "never written over, even with --force; name another file" in err, err
    # a checkpoint named outside a run: its own files and its neighbours' are refused too
    assert consolidate_main(older, newest + ".part-00001", "--force") == 2
    assert "never written over" in capfd.readouterr().err
    for path in (older, newest):
        assert ckpt.load_checkpoint(path).step in (2, 4)  # both still load, whole


def test_consolidate_writes_over_an_existing_file_only_with_force(tmp_path, capfd):
    run, _ = two_checkpoints(tmp_path)
    precious = tmp_path / "precious.csv"
    precious.write_text("a,b\n")
    assert consolidate_main(run, precious) == 2
    err = capfd.readouterr().err
    assert f"{precious} already exists; name another file, or pass --force" in err, err
    assert precious.read_text() == "a,b\n"
    assert consolidate_main(run, precious, "--force") == 0
    assert ckpt.load_checkpoint(str(precious)).step == 4
    assert consolidate_main(run) == 0  # the default file, then again: refused
    assert consolidate_main(run) == 2
    assert "checkpoint-00000004.h5 already exists" in capfd.readouterr().err


def test_consolidate_refuses_an_empty_or_unwritable_out_with_status_2(tmp_path, capfd):
    run, _ = two_checkpoints(tmp_path)
    assert consolidate_main(run, "") == 2
    assert "OUT '' is an empty file name" in capfd.readouterr().err
    assert not (tmp_path / "consolidated").exists() and not os.path.exists("consolidated")
    (tmp_path / "plain").write_text("")
    assert consolidate_main(run, tmp_path / "plain" / "sub" / "out.h5") == 2
    err = capfd.readouterr().err
    assert f"{tmp_path / 'plain'} is a file, not a directory" in err and "Traceback" not in err


def test_consolidate_falls_back_past_a_newest_checkpoint_that_does_not_load(tmp_path, capfd):
    run, newest = two_checkpoints(tmp_path)
    flip_a_byte(newest + ".part-00001", "0")
    assert consolidate_main(run) == 0
    err = capfd.readouterr().err
    assert f"note: skipped {newest}" in err and "part-00001 is corrupt" in err, err
    assert ckpt.load_checkpoint(str(run / "consolidated" / "checkpoint-00000002.h5")).step == 2
    assert not (run / "consolidated" / "checkpoint-00000004.h5").exists()
    # a missing part: passed over with a plain note, no RuntimeWarning and its source line
    os.remove(str(run / "checkpoints" / "checkpoint-00000002.h5.part-00000"))
    assert consolidate_main(run, tmp_path / "none.h5") == 2
    err = capfd.readouterr().err
    assert "Warning" not in err and "warnings.warn" not in err, err
    assert "holds 2 checkpoint(s) and none loads" in err and "lacks 1 of its parts" in err, err
    assert not (tmp_path / "none.h5").exists()


@pytest.fixture
def full_disk(tmp_path):
    """A 16 KiB filesystem (tmpfs): needs root, else skipped."""
    import subprocess

    where = tmp_path / "small"
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_consolidate_onto_a_full_disk_exits_1_before_writing(tmp_path, full_disk, capfd):
    # HDF5 running out of space mid-file crashed the process (signal 11, exit 139); the
    # storage is not the input: 1, with the room needed and free.
    run, _ = two_checkpoints(tmp_path)
    assert consolidate_main(run, full_disk / "out.h5") == 1
    err = capfd.readouterr().err
    assert f"cannot write {full_disk / 'out.h5'} (No space left on device)" in err, err
    assert "free space there" in err and os.listdir(full_disk) == []
