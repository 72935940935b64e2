"""``mpidl shard`` on several ranks writes one process's dataset: the same samples in
each split, the same vocabulary, classes, length, labels and statistics (to rounding
for a feature's mean and std), whatever the number of ranks. Thread ranks run the
command's own code path (:func:`mpidl.data.command.main` with a communicator); the
real-MPI run, a failure injected on one rank and the loader's exactness over the
result are tests/mpi/test_shard_mpi.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy
import pytest

from mpidl.data import read_manifest
from mpidl.data.command import main as shard_main
from mpidl.data.parallel import write_shards_parallel
from mpidl.data.partition import csv_span
from mpidl.data.sources import load_npz, read_csv
from mpidl.data.text import covering, covering_counts
from mpidl.testing import run_ranks
from mpidl.testing.datasets import dataset_differences, sharding_inputs

REPO = Path(__file__).resolve().parents[2]
SENTENCES = REPO / "tests" / "data" / "sentiment-sentences" / "imdb.tsv"


def shard_on(size, argv):
    """``mpidl shard ARGV`` on ``size`` thread ranks; each rank's exit status."""
    return run_ranks(size, lambda comm: shard_main(argv, comm=comm), timeout=60)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return root, sharding_inputs(root, SENTENCES)


@pytest.mark.parametrize("case", ["csv", "folder", "npz", "table", "h5"])
def test_two_and_three_ranks_write_one_process_dataset(tmp_path, inputs, case):
    argv = inputs[1][case] + ["--rows-per-shard", "23", "--seed", "5"]
    assert shard_on(1, argv + [str(tmp_path / "one")]) == [0]
    for size in (2, 3):
        out = tmp_path / f"ranks{size}"
        assert shard_on(size, argv + [str(out)]) == [0] * size
        assert dataset_differences(out, tmp_path / "one") == []
        # each rank wrote its own shards: more of them, still numbered in order
        shards = read_manifest(str(out / "train")).shards
        assert [s.file for s in shards] == [f"shard-{i:05d}.h5" for i in range(len(shards))]


def test_csv_spans_tile_the_file_at_record_boundaries(inputs):
    path = str(inputs[0] / "reviews.csv")
    whole = read_csv(path, "text", "label")
    for size in (1, 2, 3, 7):
        spans = run_ranks(size, lambda comm: csv_span(comm, path, quoted=True))
        assert spans[0].start == 0 and spans[-1].end == os.path.getsize(path)
        assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
        parts = [read_csv(path, "text", "label", span=s) for s in spans]
        assert sum((p[0] for p in parts), []) == whole[0]
        assert sum((p[1] for p in parts), []) == whole[1]


def test_a_bad_line_on_one_rank_is_named_with_its_line_on_every_rank(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    rows = [f"text {i},pos" if i % 2 else f"text {i},neg" for i in range(40)]
    rows[31] = "no label here"
    path.write_text("text,label\n" + "\n".join(rows) + "\n")
    errors = run_ranks(3, lambda comm: shard_main(
        ["--from-csv", str(path), "--text-col", "text", "--label-col", "label",
         str(tmp_path / "out")], comm=comm), return_exceptions=True)
    assert errors == [2, 2, 2]  # every rank exits 2; rank 0 alone says why
    err = capsys.readouterr().err
    assert err.count("error") == 1 and f"rank 2 of 3: {path}:33: 1 field(s)" in err, err
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_a_byte_that_is_not_utf8_is_named_alike_at_any_rank_count(tmp_path, capsys):
    # Each rank decodes its own bytes: the error's position was within that rank's
    # buffer (4096 at 1 rank, 2460 at 2), not in the file.
    path = tmp_path / "latin1.csv"
    data = bytearray(("text,label\n" + "".join(
        f"review {i:04d} of one stay that was fine enough,{('neg', 'pos')[i % 2]}\n"
        for i in range(400))).encode())
    data[12288] = 0xE9  # Latin-1's \u00e9, on line 252
    path.write_bytes(bytes(data))
    argv = ["--from-csv", str(path), "--text-col", "text", "--label-col", "label"]
    for size in (1, 2, 3):
        assert shard_on(size, argv + [str(tmp_path / "out")]) == [2] * size
        err = capsys.readouterr().err
        assert err.count("error") == 1, err
        assert f"{path}:252: not valid utf-8 text: byte offset 12288 holds b'\\xe9'" in err, err


def test_an_out_dir_under_a_file_is_refused_before_the_input_is_read(tmp_path, capsys, inputs):
    (tmp_path / "file").write_text("mine")
    out = tmp_path / "file" / "data"
    # a garbage input: the error names OUT_DIR, so OUT_DIR was checked first
    (tmp_path / "garbage.npz").write_bytes(b"not a zip file")
    for size in (1, 2, 3):
        for argv in (inputs[1]["csv"], ["--from-npz", str(tmp_path / "garbage.npz")]):
            assert shard_on(size, argv + [str(out)]) == [2] * size
            err = capsys.readouterr().err
            assert err.count("error") == 1, err
            assert f"OUT_DIR '{out}': '{tmp_path / 'file'}' is a file, so no directory" in err
    assert (tmp_path / "file").read_text() == "mine"


def test_covering_counts_is_numpys_inverted_cdf_percentile():
    rng = numpy.random.default_rng(0)
    for n in (1, 2, 3, 10, 99, 100, 101, 1000):
        lengths = rng.integers(0, 40, n)
        for q in (0, 1, 50, 90, 95, 99, 100):
            assert covering_counts(numpy.bincount(lengths), q) == covering(lengths, q)


def test_ranks_called_with_different_options_are_told_so_on_every_rank(tmp_path):
    def write(comm):
        x = numpy.arange(10 * comm.rank, 10 * comm.rank + 10, dtype=numpy.float32)[:, None]
        try:
            write_shards_parallel(comm, str(tmp_path / "d"), {"x": x}, seed=comm.rank)
        except ValueError as e:
            return str(e)

    messages = run_ranks(3, write)
    assert len(set(messages)) == 1 and "rank 1 was called with" in messages[0], messages
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("save", [numpy.savez, numpy.savez_compressed])
def test_npz_shares_read_by_rows_tile_each_array(tmp_path, save):
    rng = numpy.random.default_rng(0)
    arrays = {"x": rng.normal(size=(101, 3, 2)).astype(numpy.float32), "y": numpy.arange(101),
              "f": numpy.asfortranarray(rng.normal(size=(101, 4))), "s": numpy.array(5.0)}
    save(tmp_path / "a.npz", **arrays)  # savez: stored members, read by rows
    for size in (1, 2, 3, 7):
        parts = [load_npz(str(tmp_path / "a.npz"), (r, size))["train"] for r in range(size)]
        for k in ("x", "y", "f"):
            numpy.testing.assert_array_equal(numpy.concatenate([p[k] for p in parts]), arrays[k])
        assert all(float(p["s"]) == 5.0 for p in parts)


def test_a_record_longer_than_a_share_leaves_ranks_empty_and_the_dataset_whole(tmp_path):
    # one quoted review of ~40 KB with newlines among 30 short ones: at 4 ranks the cuts
    # of two ranks fall inside it, so they find no record boundary and get nothing
    path = tmp_path / "long.csv"
    long = "\n".join(f"line {i}, with a comma and \"\"quotes\"\"" for i in range(1000))
    rows = [f"short review {i},{'pos' if i % 2 else 'neg'}" for i in range(30)]
    path.write_text("text,label\n" + "\n".join(rows[:3]) + f'\n"{long}",pos\n'
                    + "\n".join(rows[3:]) + "\n")
    spans = run_ranks(4, lambda comm: csv_span(comm, str(path), quoted=True))
    assert [s.end - s.start == 0 for s in spans].count(True) >= 1, spans
    argv = ["--from-csv", str(path), "--text-col", "text", "--label-col", "label",
            "--rows-per-shard", "4"]
    assert shard_on(1, argv + [str(tmp_path / "one")]) == [0]
    assert shard_on(4, argv + [str(tmp_path / "four")]) == [0] * 4
    assert dataset_differences(tmp_path / "four", tmp_path / "one") == []
