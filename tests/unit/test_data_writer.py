"""Writers round-trip: arrays, .npz, HDF5, CSV/TSV and a text-folder tree, API and CLI."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy
import pytest

from mpidl.data import DataError, ShardedDataset, read_manifest, write_shards, write_text_shards
from mpidl.data.command import main as shard_main
from mpidl.data.text import encode, tokenize

REPO = Path(__file__).resolve().parents[2]


def read_all(path):
    ds = ShardedDataset(str(path), verify="sha256")
    ids = numpy.arange(len(ds))
    out = {f: ds.read(f, ids) for f in ds.features}
    ds.close()
    return ds, out


def test_arrays_round_trip_over_uneven_shards(tmp_path):
    n = 103
    x = numpy.stack([numpy.arange(n), numpy.arange(n) * 2.0, -numpy.arange(n)], axis=1).astype(
        numpy.float32
    )
    y = (numpy.arange(n) % 3).astype(numpy.int64)
    manifests = write_shards(tmp_path / "d", {"x": x, "y": y}, rows_per_shard=40, seed=1)
    assert list(manifests) == ["train"]
    assert [s.rows for s in manifests["train"].shards] == [40, 40, 23]
    ds, got = read_all(tmp_path / "d" / "train")
    assert ds.num_classes == 3 and ds.features["x"].shape == (3,)
    assert len(ShardedDataset(str(tmp_path / "d"), split="train")) == n
    order = numpy.argsort(got["x"][:, 0])  # rows were shuffled once, at write time
    numpy.testing.assert_array_equal(got["x"][order], x)
    numpy.testing.assert_array_equal(got["y"][order], y)
    assert not numpy.array_equal(got["x"], x)


def test_no_shuffle_keeps_order_and_test_fraction_splits_rows(tmp_path):
    x = numpy.arange(50, dtype=numpy.int32).reshape(50, 1)
    write_shards(
        tmp_path / "d",
        {"x": x, "y": numpy.zeros(50, numpy.int64)},
        test_fraction=0.2,
        shuffle=False,
        rows_per_shard=7,
    )
    _, train = read_all(tmp_path / "d" / "train")
    _, test = read_all(tmp_path / "d" / "test")
    assert len(train["x"]) == 40 and len(test["x"]) == 10
    assert numpy.all(numpy.diff(train["x"][:, 0]) > 0) and numpy.all(
        numpy.diff(test["x"][:, 0]) > 0
    )
    assert sorted(numpy.concatenate([train["x"][:, 0], test["x"][:, 0]]).tolist()) == list(
        range(50)
    )


def test_compressed_shards_round_trip(tmp_path):
    x = numpy.random.default_rng(0).integers(0, 5, size=(300, 20)).astype(numpy.float32)
    write_shards(tmp_path / "d", {"x": x}, compression="gzip", rows_per_shard=128, shuffle=False)
    m = read_manifest(str(tmp_path / "d" / "train"))
    assert m.storage["layout"] == "chunked" and m.labels is None
    _, got = read_all(tmp_path / "d" / "train")
    numpy.testing.assert_array_equal(got["x"], x)


def test_npz_with_splits_round_trips_through_the_cli(tmp_path):
    rng = numpy.random.default_rng(0)
    arrays = {
        "x_train": rng.random((30, 4)).astype(numpy.float32),
        "y_train": rng.integers(0, 10, 30),
        "x_test": rng.random((12, 4)).astype(numpy.float32),
        "y_test": rng.integers(0, 10, 12),
    }
    numpy.savez(tmp_path / "in.npz", **arrays)
    assert (
        shard_main(["--from-npz", str(tmp_path / "in.npz"), str(tmp_path / "d"), "--no-shuffle"])
        == 0
    )
    for split in ("train", "test"):
        ds, got = read_all(tmp_path / "d" / split)
        numpy.testing.assert_array_equal(got["x"], arrays[f"x_{split}"])
        numpy.testing.assert_array_equal(got["y"], arrays[f"y_{split}"])
        assert ds.num_classes == max(arrays["y_train"].max(), arrays["y_test"].max()) + 1


def test_h5_input_round_trips_through_the_cli(tmp_path):
    import h5py

    x = numpy.arange(60, dtype=numpy.float64).reshape(20, 3)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["x"], f["y"], f["other"] = x, numpy.arange(20) % 2, numpy.zeros(5)
    rc = shard_main(
        [
            "--from-h5",
            str(tmp_path / "in.h5"),
            "--features",
            "x,y",
            "--test-fraction",
            "0",
            "--rows-per-shard",
            "6",
            "--no-shuffle",
            str(tmp_path / "d"),
        ]
    )
    assert rc == 0
    ds, got = read_all(tmp_path / "d" / "train")
    assert len(ds.manifest.shards) == 4
    numpy.testing.assert_array_equal(got["x"], x)


def write_csv(path, rows, header=("review", "sentiment")):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def test_csv_round_trip_with_quoted_commas_and_newlines(tmp_path):
    rows = [
        ("Great, great film!<br />Loved it.", "positive"),
        ('Awful "plot", bad\nacting.', "negative"),
    ] * 10
    write_csv(tmp_path / "r.csv", rows)
    rc = shard_main(
        [
            "--from-csv",
            str(tmp_path / "r.csv"),
            "--text-col",
            "review",
            "--label-col",
            "sentiment",
            "--test-fraction",
            "0",
            "--length",
            "8",
            str(tmp_path / "d"),
        ]
    )
    assert rc == 0
    ds, got = read_all(tmp_path / "d" / "train")
    assert ds.classes == ["negative", "positive"] and ds.vocab[:2] == ["<pad>", "<unk>"]
    expected = {1: encode([rows[0][0]], ds.vocab, 8)[0], 0: encode([rows[1][0]], ds.vocab, 8)[0]}
    for xi, yi in zip(got["x"], got["y"]):
        numpy.testing.assert_array_equal(xi, expected[int(yi)])
    assert (got["y"] == 1).sum() == 10


def test_a_numeric_csv_with_a_label_column_is_a_classification_dataset(tmp_path, capsys):
    rows = [(f"{i % 7}", f"{i * 100}", ("red", "blue", "green")[i % 3]) for i in range(30)]
    write_csv(tmp_path / "t.csv", rows, header=("hue", "proline", "kind"))
    base = ["--from-csv", str(tmp_path / "t.csv"), "--feature-cols", "hue,proline",
            "--label-col", "kind", "--test-fraction", "0", "--no-shuffle"]
    assert shard_main([*base, str(tmp_path / "d")]) == 0
    ds, got = read_all(tmp_path / "d" / "train")
    assert ds.classes == ["blue", "green", "red"] and ds.num_classes == 3
    assert got["x"].dtype == numpy.float32 and got["x"][4].tolist() == [4.0, 400.0]
    assert got["y"].dtype == numpy.int64 and got["y"][:3].tolist() == [2, 0, 1]
    # --classes fixes the ids; a label outside them names the file and the label
    assert shard_main([*base, "--classes", "red,green,blue", str(tmp_path / "e")]) == 0
    assert read_all(tmp_path / "e" / "train")[1]["y"][:3].tolist() == [0, 2, 1]
    capsys.readouterr()
    assert shard_main([*base, "--classes", "red,blue", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 't.csv'}:4: label column 'kind' holds 'green'" in err
    # targets and a label column at once: which is it?
    assert shard_main([*base, "--target-cols", "hue", str(tmp_path / "g")]) == 2
    assert "either --target-cols" in capsys.readouterr().err


def test_text_writer_is_deterministic_and_builds_vocab_on_train_only(tmp_path):
    train = ["good film", "bad film", "good good plot", "bad acting"]
    test = ["unseenword good"]
    kw = dict(test_texts=test, test_labels=["pos"], vocab_size=50, length=5, seed=3)
    write_text_shards(tmp_path / "a", train, ["pos", "neg", "pos", "neg"], **kw)
    write_text_shards(tmp_path / "b", train, ["pos", "neg", "pos", "neg"], **kw)
    a, b = read_all(tmp_path / "a" / "train"), read_all(tmp_path / "b" / "train")
    assert a[0].vocab == b[0].vocab and "unseenword" not in a[0].vocab
    numpy.testing.assert_array_equal(a[1]["x"], b[1]["x"])
    test_ds, test_got = read_all(tmp_path / "a" / "test")
    assert test_ds.vocab == a[0].vocab and test_got["x"][0, 0] == 1  # <unk>


def make_tree(root, splits=("train", "test"), extra="unsup"):
    texts = {
        "pos": ["A wonderful film!", "Loved it", "great cast"],
        "neg": ["Terrible.", "boring, dull"],
    }
    for split in splits:
        for cls, items in texts.items():
            d = root / split / cls
            d.mkdir(parents=True)
            for i, t in enumerate(items):
                (d / f"{i}_7.txt").write_text(t, encoding="utf-8")
    if extra:
        (root / splits[0] / extra).mkdir()
        (root / splits[0] / extra / "0_0.txt").write_text("unlabelled", encoding="utf-8")
    return texts


def test_folder_tree_in_aclimdb_layout_round_trips(tmp_path):
    texts = make_tree(tmp_path / "aclImdb")
    rc = shard_main(
        ["--from-folder", str(tmp_path / "aclImdb"), "--length", "6", str(tmp_path / "d")]
    )
    assert rc == 0
    for split in ("train", "test"):
        ds, got = read_all(tmp_path / "d" / split)
        assert ds.classes == ["neg", "pos"] and len(ds) == 5  # unsup left out
        want = sorted(
            tuple(encode([t], ds.vocab, 6)[0]) + (c,)
            for c, ts in ((0, texts["neg"]), (1, texts["pos"]))
            for t in ts
        )
        have = sorted(tuple(xi) + (int(yi),) for xi, yi in zip(got["x"], got["y"]))
        assert have == want
    assert "unlabelled" not in ds.vocab


def test_folder_without_splits_uses_test_fraction(tmp_path):
    make_tree(tmp_path / "t", splits=(".",), extra=None)
    rc = shard_main(
        ["--from-folder", str(tmp_path / "t"), "--test-fraction", "0.4", str(tmp_path / "d")]
    )
    assert rc == 0
    assert len(ShardedDataset(str(tmp_path / "d" / "train"))) == 3
    assert len(ShardedDataset(str(tmp_path / "d" / "test"))) == 2


def test_overwrite_needs_force(tmp_path, capsys):
    write_shards(tmp_path / "d", {"x": numpy.zeros((4, 1))})
    numpy.savez(tmp_path / "in.npz", x=numpy.ones((3, 1)))
    assert shard_main(["--from-npz", str(tmp_path / "in.npz"), str(tmp_path / "d")]) == 2
    assert "already holds a dataset" in capsys.readouterr().err
    assert (
        shard_main(
            [
                "--from-npz",
                str(tmp_path / "in.npz"),
                "--force",
                "--test-fraction",
                "0",
                str(tmp_path / "d"),
            ]
        )
        == 0
    )
    assert len(ShardedDataset(str(tmp_path / "d" / "train"))) == 3
    assert not os.path.exists(tmp_path / "d" / "test" / "manifest.json")


def test_a_bad_option_with_force_keeps_the_old_dataset(tmp_path, capsys):
    write_shards(tmp_path / "d", {"x": numpy.zeros((4, 1))}, test_fraction=0.5)
    numpy.savez(tmp_path / "in.npz", x=numpy.ones((3, 1)))
    for bad in (["--rows-per-shard", "0"], ["--test-fraction", "1.5"]):
        try:
            rc = shard_main(["--from-npz", str(tmp_path / "in.npz"), "--force", *bad,
                             str(tmp_path / "d")])
        except SystemExit as e:  # argparse refuses --rows-per-shard 0 as it reads it
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and "mpidl shard: error:" in err, err
        assert len(ShardedDataset(str(tmp_path / "d" / "train"))) == 2  # untouched
        assert len(ShardedDataset(str(tmp_path / "d" / "test"))) == 2


def test_real_sentiment_sentences_shard_through_the_tsv_path(tmp_path, capsys,
                                                             sentiment_sentences):
    src = sentiment_sentences
    for name in ("imdb", "amazon", "yelp"):
        out = tmp_path / name
        rc = shard_main(
            [
                "--from-csv",
                str(src / f"{name}.tsv"),
                "--no-header",
                "--text-col",
                "0",
                "--label-col",
                "1",
                "--length",
                "64",
                "--rows-per-shard",
                "256",
                str(out),
            ]
        )
        assert rc == 0
        assert shard_main(["--verify", str(out)]) == 0
        train, test = ShardedDataset(str(out / "train")), ShardedDataset(str(out / "test"))
        assert (len(train), len(test)) == (900, 100)  # all 1000 lines, unbalanced quotes and all
        assert train.classes == ["0", "1"] and train.vocab == test.vocab
        labels = numpy.concatenate([d.read("y", numpy.arange(len(d))) for d in (train, test)])
        assert numpy.bincount(labels).tolist() == [500, 500]
    assert tokenize("Qu?bec isn't bad!") == ["qu", "?", "bec", "isn't", "bad", "!"]


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    assert shard_main(["--from-csv", str(tmp_path / "r.csv"), str(tmp_path / "d")]) == 2
    assert "--text-col" in capsys.readouterr().err
    assert shard_main(["--from-npz", str(tmp_path / "x.npz")]) == 2
    assert "OUT_DIR is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        shard_main([str(tmp_path / "d")])  # no source: argparse exits with status 2


def test_mpidl_shard_entry_point_is_this_main(tmp_path):
    from mpidl.cli import COMMANDS, _resolve

    shard = _resolve(COMMANDS["shard"][0])  # what `mpidl shard` runs (without the global hook)
    numpy.savez(tmp_path / "in.npz", x=numpy.ones((6, 2)), y=numpy.arange(6) % 2)
    assert shard(["--from-npz", str(tmp_path / "in.npz"), str(tmp_path / "d")]) == 0
    assert shard(["--verify", str(tmp_path / "d")]) == 0


_SHARD_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
# Writes past the limit fail with EFBIG ("File too large"), as a full disk fails with
# ENOSPC: the same OSError path through HDF5. SIGXFSZ would kill the process instead.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from mpidl.data.command import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_forced_rewrite_that_runs_out_of_space_keeps_the_old_dataset(tmp_path):
    import subprocess
    import sys

    data = tmp_path / "d"
    write_shards(data, {"x": numpy.zeros((4, 1))}, test_fraction=0.5)
    before = {s: (data / s / "manifest.json").read_text() for s in ("train", "test")}
    numpy.savez(tmp_path / "in.npz", x=numpy.random.default_rng(0).random((20000, 8)))
    result = subprocess.run(
        [sys.executable, "-c", _SHARD_UNDER_A_FILE_SIZE_LIMIT, str(256 << 10), "--from-npz",
         str(tmp_path / "in.npz"), "--force", str(data)],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{data / 'train' / 'shard-00000.h5'}: cannot write the new dataset (File too " \
           "large)" in result.stderr, result.stderr
    assert "unchanged" in result.stderr and "`ulimit -f`" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert sorted(os.listdir(data)) == ["test", "train"]  # the partial new one removed
    for split in ("train", "test"):
        assert (data / split / "manifest.json").read_text() == before[split]
    assert shard_main(["--verify", str(data)]) == 0


def test_a_forced_rewrite_keeps_files_that_are_not_the_datasets(tmp_path):
    data = tmp_path / "d"
    write_shards(data, {"x": numpy.zeros((4, 1))}, test_fraction=0.5)
    (data / "README").write_text("notes")
    (data / "train" / "notes.txt").write_text("mine")
    numpy.savez(tmp_path / "in.npz", x=numpy.ones((6, 1)))
    assert shard_main(["--from-npz", str(tmp_path / "in.npz"), "--force", "--test-fraction",
                       "0", str(data)]) == 0
    assert (data / "README").read_text() == "notes"
    assert (data / "train" / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(data)) == ["README", "train"]  # the old test split went too
    assert len(ShardedDataset(str(data / "train"))) == 6


def test_a_full_disk_names_the_file_the_cause_and_the_fix(tmp_path, monkeypatch):
    import errno

    from mpidl.data import shard_writer

    write_file = shard_writer.write_file

    def fill_the_disk(path, arrays, storage, attrs):  # the second shard finds the disk full
        if path.endswith("shard-00001.h5"):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise shard_writer.write_error(OSError(errno.ENOSPC, "Can't write data"), path)
        write_file(path, arrays, storage, attrs)

    monkeypatch.setattr(shard_writer, "write_file", fill_the_disk)
    data = tmp_path / "d"
    with pytest.raises(DataError) as info:
        write_shards(data, {"x": numpy.zeros((30, 2))}, rows_per_shard=10)
    assert str(info.value).startswith(
        f"{data / 'train' / 'shard-00001.h5'}: cannot write the new dataset (No space left on "
        "device); no dataset was there and the partial new one was removed: free space")
    assert os.listdir(data) == []
