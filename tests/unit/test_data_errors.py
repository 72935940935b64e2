"""Every bad input is a DataError naming the file and the problem; nothing is skipped."""

from __future__ import annotations

import os

import numpy
import pytest

from mpidl.data import (
    DataError,
    DataLoader,
    DistributedSampler,
    ShardedDataset,
    write_shards,
    write_text_shards,
)
from mpidl.data import csv_source
from mpidl.data.command import main as shard_main
from mpidl.data.sources import read_csv, read_folder
from mpidl.testing.datasets import edit_manifest, resync_shard

N, PER = 25, 10  # three shards: 10, 10, 5 rows


@pytest.fixture
def split(tmp_path):
    x = numpy.arange(N * 3, dtype=numpy.float32).reshape(N, 3)
    y = numpy.arange(N, dtype=numpy.int64) % 3
    write_shards(tmp_path / "d", {"x": x, "y": y}, rows_per_shard=PER, shuffle=False)
    return tmp_path / "d" / "train"


def rewrite_shard(split, index, arrays, attrs=None):
    """Replace shard ``index`` and update its size and checksum, so that only the
    contents differ from what the manifest says."""
    import h5py

    path = split / f"shard-{index:05d}.h5"
    with h5py.File(path, "r", locking=False) as f:
        old = dict(f.attrs)
    with h5py.File(path, "w", locking=False) as f:
        f.attrs.update({**old, **(attrs or {})})
        for k, v in arrays.items():
            f[k] = v
    return resync_shard(split, index)


def expect(split, match, **kw):
    with pytest.raises(DataError, match=match) as info:
        ShardedDataset(str(split), **kw)
    return str(info.value)


def test_missing_shard(split):
    os.remove(split / "shard-00001.h5")
    assert "shard-00001.h5: shard file is missing" in expect(split, "missing")


def test_truncated_shard(split):
    path = split / "shard-00000.h5"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert "shard-00000.h5: size" in expect(split, "truncated")
    # even when the manifest is edited to match, HDF5 refuses the truncated file
    edit_manifest(split, lambda d: d["shards"][0].update(bytes=len(data) // 2))
    assert "shard-00000.h5: cannot be opened as HDF5" in expect(split, "corrupt")


def test_a_shard_truncated_while_open_is_an_error_naming_it(split):
    """Shards are read through a memory map, where a file that shrank would fault
    (SIGBUS) instead of reading short: the size is checked before each read."""
    ds = ShardedDataset(str(split), cache_bytes=0)
    numpy.testing.assert_array_equal(ds.read_runs("x", [[0, 2]])[:, 0], [0, 3])  # now open
    path = split / "shard-00000.h5"
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(DataError, match="shard-00000.h5: .* shrank to"):
        ds.read_runs("x", [[0, 2]])


def test_reads_without_a_memory_map_give_the_same_rows(split, monkeypatch):
    """Where a filesystem refuses maps, os.preadv reads the same bytes."""
    from mpidl.data import shard

    runs = [[3, 7], [21, 25], [0, 1], [9, 12]]
    mapped = ShardedDataset(str(split), cache_bytes=0)
    want = mapped.read_batch(("x", "y"), runs)
    assert mapped._handle(0).bytes is not None
    monkeypatch.setattr(shard, "_map_file", lambda fd, size, offsets: (None, None))
    unmapped = ShardedDataset(str(split), cache_bytes=0)
    for a, b in zip(want, unmapped.read_batch(("x", "y"), runs)):
        numpy.testing.assert_array_equal(a, b)
    assert unmapped._handle(0).bytes is None


def test_checksum_mismatch_is_found_by_verify(split, capsys):
    path = split / "shard-00002.h5"
    data = bytearray(path.read_bytes())
    data[-8:] = b"\xff" * 8  # flip bytes inside the raw data: the file still opens
    path.write_bytes(bytes(data))
    ShardedDataset(str(split))  # the cheap start-up check cannot see it (documented)
    assert "shard-00002.h5: sha256" in expect(split, "corrupt or was modified", verify="sha256")
    assert shard_main(["--verify", str(split.parent)]) == 2  # bad data: bad input
    err = capsys.readouterr().err
    assert "shard-00002.h5" in err and "sha256" in err


def test_verify_names_the_bad_files_of_every_split(tmp_path, capsys):
    x = numpy.arange(40 * 3, dtype=numpy.float32).reshape(40, 3)
    write_shards(tmp_path / "d", {"x": x, "y": numpy.arange(40) % 2}, rows_per_shard=PER,
                 test_fraction=0.5)
    (tmp_path / "d" / "test" / "shard-00001.h5").unlink()
    train = tmp_path / "d" / "train" / "shard-00000.h5"
    data = bytearray(train.read_bytes())
    data[-8:] = b"\xff" * 8
    train.write_bytes(bytes(data))
    assert shard_main(["--verify", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "train/shard-00000.h5" in err and "test/shard-00001.h5" in err, err


def test_missing_dataset(split):
    path = rewrite_shard(split, 1, {"x": numpy.zeros((PER, 3), numpy.float32)})
    assert path in expect(split, "missing dataset 'y'")


def test_dtype_different_from_manifest(split):
    rewrite_shard(
        split, 0, {"x": numpy.zeros((PER, 3), numpy.float64), "y": numpy.zeros(PER, numpy.int64)}
    )
    expect(split, r"shard-00000.h5: dataset 'x' has dtype <f8, the manifest says <f4")


@pytest.mark.parametrize("shape", [(PER, 4), (PER - 1, 3)])
def test_shape_different_from_manifest(split, shape):
    rewrite_shard(
        split, 0, {"x": numpy.zeros(shape, numpy.float32), "y": numpy.zeros(shape[0], numpy.int64)}
    )
    expect(
        split,
        rf"shard-00000.h5: dataset 'x' has shape \({shape[0]}, {shape[1]}\), "
        r"the manifest says \(10, 3\)",
    )


def test_shard_from_another_dataset(split):
    rewrite_shard(
        split,
        0,
        {"x": numpy.zeros((PER, 3), numpy.float32), "y": numpy.zeros(PER, numpy.int64)},
        attrs={"dataset_id": "someone-else"},
    )
    expect(split, "belongs to dataset 'someone-else'")


@pytest.mark.parametrize("name", ["../escape.h5", "/etc/passwd", "sub/../../x.h5", "a\\..\\b.h5"])
def test_shard_name_escaping_the_directory(split, name):
    edit_manifest(split, lambda d: d["shards"][0].update(file=name))
    expect(split, "escapes the dataset directory", verify="none")


def test_labels_out_of_range_fail_on_read_and_verify(split):
    y = numpy.zeros(PER, numpy.int64)
    y[7] = 3  # num_classes is 3
    rewrite_shard(split, 1, {"x": numpy.zeros((PER, 3), numpy.float32), "y": y})
    ds = ShardedDataset(str(split), cache_bytes=0)  # labels read per batch: found by the read
    loader = DataLoader(ds, DistributedSampler(len(ds), 8, 0, 1, shuffle="none"), prefetch=2)
    with pytest.raises(
        DataError, match=r"shard-00001.h5: label 3 at row 7 is outside \[0, 3\)"
    ):
        list(loader)
    expect(split, "label 3 at row 7")  # small enough to cache: found at start-up
    expect(split, "label 3 at row 7", verify="sha256")


def test_writer_rejects_labels_out_of_range(tmp_path):
    with pytest.raises(DataError, match=r"label 2 of sample 1 is outside \[0, 2\)"):
        write_shards(
            tmp_path / "d", {"x": numpy.zeros((3, 1)), "y": numpy.array([0, 2, 1])}, num_classes=2
        )
    with pytest.raises(DataError, match="outside"):
        write_shards(tmp_path / "e", {"x": numpy.zeros((2, 1)), "y": numpy.array([0, -1])})


def test_several_bad_files_are_all_listed(split):
    os.remove(split / "shard-00000.h5")
    os.remove(split / "shard-00002.h5")
    msg = expect(split, "2 bad shard file")
    assert "shard-00000.h5" in msg and "shard-00002.h5" in msg


def test_manifest_problems(split):
    assert "pass" in expect(split.parent, "no manifest.json")  # a hint to pass d/train
    edit_manifest(split, lambda d: d.update(format_version=2))
    expect(split, "format_version 2 is newer than this reader")
    (split / "manifest.json").write_text("{not json")
    expect(split, "not valid JSON")


def test_features_with_different_row_counts_or_non_numeric_dtypes_are_rejected(tmp_path):
    with pytest.raises(DataError, match="different numbers of rows"):
        write_shards(tmp_path / "d", {"x": numpy.zeros((3, 2)), "y": numpy.zeros(4, numpy.int64)})
    with pytest.raises(DataError, match="feature 'x' has dtype <U3; only numeric arrays"):
        write_shards(tmp_path / "d", {"x": numpy.array(["abc", "de"])})


def test_bad_csv_inputs_name_file_and_line(tmp_path):
    p = tmp_path / "r.csv"
    p.write_text("review,sentiment\ngood,positive\nno label here\n")
    with pytest.raises(DataError, match=r"r.csv:3: 1 field\(s\), need at least 2"):
        read_csv(str(p), "review", "sentiment")
    with pytest.raises(DataError, match="no label column 'label'"):
        read_csv(str(p), "review", "label")
    p.write_text("review,sentiment\ngood,\n")
    with pytest.raises(DataError, match=r"r.csv:2: empty label"):
        read_csv(str(p), "review", "sentiment")
    with pytest.raises(DataError, match="no such file"):
        read_csv(str(tmp_path / "absent.csv"), 0, 1)
    p.write_bytes(b"review,sentiment\n\xff\xfe,positive\n")
    with pytest.raises(DataError, match="r.csv:2: not valid utf-8 text: byte offset 17 "):
        read_csv(str(p), "review", "sentiment")


def test_a_byte_that_is_not_utf8_is_named_by_its_file_offset_and_line(tmp_path, monkeypatch):
    # Past the decoder's first read-ahead block, whose position the error used to give
    # ("position 4096"), with characters of 2, 3 and 4 bytes cut by the search's blocks.
    lines = [f"caf\u00e9 {i:05d} \u20ac\U0001d11e,pos" for i in range(800)]
    data = bytearray("\n".join(["review,sentiment", *lines, ""]).encode())
    at = data.index(b"caf\xc3\xa9 00500")
    data[at] = 0xE9  # Latin-1's \u00e9 where the c was
    p = tmp_path / "r.csv"
    p.write_bytes(bytes(data))
    for block in (1, 2, 3, 4096, 1 << 20):
        monkeypatch.setattr(csv_source, "_SCAN_BLOCK", block)
        with pytest.raises(DataError) as exc:
            read_csv(str(p), "review", "sentiment")
        assert str(exc.value).startswith(
            f"{p}:502: not valid utf-8 text: byte offset {at} holds b'\\xe9' (invalid "
            "continuation byte); save the file as utf-8"), (block, str(exc.value))


def test_a_text_cut_by_an_unquoted_delimiter_is_an_error_naming_the_line(tmp_path):
    p = tmp_path / "r.csv"
    p.write_text("sentiment,review\npositive,Great movie, loved it\nnegative,Bad\n")
    with pytest.raises(DataError, match=r"r.csv:2: 3 fields where the header has 2"):
        read_csv(str(p), "review", "sentiment")
    p.write_text("positive,Great\nnegative,Bad, awful\n")  # no header: the first line
    with pytest.raises(DataError, match=r"r.csv:2: 3 fields where the first line has 2"):
        read_csv(str(p), 1, 0, header=False)
    p.write_text('sentiment,review\npositive,"Great movie, loved it"\n')  # quoted: fine
    assert read_csv(str(p), "review", "sentiment") == (["Great movie, loved it"], ["positive"])


def test_a_byte_order_mark_is_not_part_of_the_first_name_or_label(tmp_path):
    p = tmp_path / "r.csv"
    p.write_bytes("review,sentiment\ngood,positive\n".encode("utf-8-sig"))
    assert read_csv(str(p), "review", "sentiment") == (["good"], ["positive"])
    p.write_bytes("positive\tgood\nnegative\tbad\n".encode("utf-8-sig"))
    assert read_csv(str(p), 1, 0, header=False, delimiter="\t")[1] == ["positive", "negative"]


def test_bad_folder_inputs(tmp_path):
    with pytest.raises(DataError, match="no such folder"):
        read_folder(str(tmp_path / "absent"))
    (tmp_path / "t" / "pos").mkdir(parents=True)
    (tmp_path / "t" / "neg").mkdir(parents=True)
    (tmp_path / "t" / "pos" / "1.txt").write_text("fine")
    with pytest.raises(DataError, match="neg: class folder holds no text files"):
        read_folder(str(tmp_path / "t"))
    (tmp_path / "t" / "neg" / "1.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(DataError, match="1.txt: not valid UTF-8"):
        read_folder(str(tmp_path / "t"))
    with pytest.raises(DataError, match="class folder 'meh' is missing"):
        read_folder(str(tmp_path / "t"), classes=["pos", "meh"])


def test_cli_reports_bad_input_and_exits_2_as_train_eval_and_predict_do(tmp_path, capsys):
    rc = shard_main(["--from-npz", str(tmp_path / "absent.npz"), str(tmp_path / "d")])
    assert rc == 2 and "absent.npz: no such file" in capsys.readouterr().err


@pytest.fixture
def text_split(tmp_path):
    texts = [f"{w} film number {i}" for i, w in enumerate(["good", "bad"] * 12)]
    labels = ["pos", "neg"] * 12
    write_text_shards(str(tmp_path / "t"), texts, labels, length=6, rows_per_shard=10,
                      shuffle=False)
    return tmp_path / "t" / "train"


@pytest.mark.parametrize("token", [60000, -3])
def test_a_token_id_out_of_range_names_the_shard_split_value_and_limit(text_split, token):
    ds = ShardedDataset(str(text_split))
    x, y = ds.read("x", range(10, 20)), ds.read("y", range(10, 20))
    x[4, 2] = token
    ds.close()
    path = rewrite_shard(text_split, 1, {"x": x, "y": y})
    words = len(ds.vocab)
    ds = ShardedDataset(str(text_split), cache_bytes=0)  # ids read per batch: found by the read
    loader = DataLoader(ds, DistributedSampler(len(ds), 8, 0, 1, shuffle="none"))
    with pytest.raises(DataError) as info:
        list(loader)
    found_by_the_read = str(info.value)
    found_at_start_up = expect(text_split, "outside")  # small enough to cache
    for message in (found_by_the_read, found_at_start_up):
        assert message.startswith(f"{path}: token id {token} at row 4 is outside [0, {words})")
        assert "split 'train'" in message and f"vocabulary has {words} words" in message
        assert "rewrite the dataset with `mpidl shard`" in message
    assert f"token id {token} at row 4" in expect(text_split, "outside", verify="sha256")


def test_verify_finds_a_token_id_out_of_range(text_split, capsys):
    ds = ShardedDataset(str(text_split))
    x, y = ds.read("x", range(0, 10)), ds.read("y", range(0, 10))
    x[9, 0] = len(ds.vocab)
    ds.close()
    rewrite_shard(text_split, 0, {"x": x, "y": y})
    assert shard_main(["--verify", str(text_split.parent)]) == 2
    assert f"shard-00000.h5: token id {len(ds.vocab)} at row 9" in capsys.readouterr().err


def test_a_nul_byte_in_a_shard_name_is_a_data_error_naming_the_manifest(split, capsys):
    edit_manifest(split, lambda d: d["shards"][0].update(file="shard-0\x000000.h5"))
    message = expect(split, "holds a NUL byte", verify="none")
    assert message.startswith(str(split / "manifest.json"))
    assert shard_main(["--verify", str(split)]) == 2  # bad data is bad input, as in train
    assert "NUL byte" in capsys.readouterr().err


def test_an_absurd_num_classes_in_a_manifest_is_refused_naming_it(split):
    edit_manifest(split, lambda d: d["labels"].update(num_classes=10**9))
    message = expect(split, "num_classes 1000000000 is more than the 16777216", verify="none")
    assert message.startswith(str(split / "manifest.json")) and "`mpidl shard`" in message


def test_the_writer_refuses_labels_that_cannot_be_class_ids(tmp_path):
    with pytest.raises(DataError, match="num_classes 1000000001 is more than .* `--labels none`"):
        write_shards(tmp_path / "d", {"x": numpy.zeros((2, 1)), "y": numpy.array([0, 10**9])})


def test_a_file_that_is_not_an_npz_is_named_as_such_with_no_advice_to_unpickle(tmp_path):
    from mpidl.data.sources import load_npz

    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file")
    with pytest.raises(DataError, match=r"garbage.npz: not an .npz file \(it starts with "
                                        r"b'not a zi'.*numpy.savez") as info:
        load_npz(str(garbage))
    assert "allow_pickle" not in str(info.value)


def test_an_npz_of_python_objects_is_refused_because_unpickling_runs_code(tmp_path):
    from mpidl.data.sources import load_npz

    numpy.savez(tmp_path / "objects.npz", x=numpy.array([{"a": 1}], dtype=object))
    with pytest.raises(DataError, match="holds an array of Python objects, which mpidl never "
                                        "loads") as info:
        load_npz(str(tmp_path / "objects.npz"))
    assert "allow_pickle" not in str(info.value)
