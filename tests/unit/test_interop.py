"""``mpidl export`` / ``mpidl import`` without PyTorch: the safetensors format by hand,
GPT-2's names, and exports of real checkpoints read back by mpidl's own reader.

The same files read by the ``safetensors`` package, PyTorch and ``transformers``:
tests/unit/test_interop_peers.py (marked extra)."""
from __future__ import annotations

import json
import os
import struct

import numpy
import pytest

from mpidl import models
from mpidl.backend import named_dtype
from mpidl.interop import hf_gpt2, safetensors
from mpidl.interop.command import export, export_main, import_main
from mpidl.train.checkpoint import load_checkpoint, save_checkpoint
from mpidl.train.config import load_config, to_toml

DTYPES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "uint8", "bool"]


def _array(dtype: str, shape=(3, 5), seed=0) -> numpy.ndarray:
    rng = numpy.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if numpy.dtype(named_dtype(dtype)).kind in "iu":
        return rng.integers(0, 200, shape).astype(dtype)
    return rng.normal(size=shape).astype(named_dtype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_file_of_each_dtype_reads_back_bit_for_bit(tmp_path, dtype):
    arrays = {"a": _array(dtype), "b.c": _array(dtype, (7,), 1), "empty": _array(dtype, (0, 4))}
    path = tmp_path / "x.safetensors"
    size = safetensors.write(path, [(n, a.shape, a.dtype, lambda a=a: a) for n, a in
                                    arrays.items()], {"k": "v"})
    assert size == os.path.getsize(path)
    head, metadata, start = safetensors.read_header(path)
    assert metadata == {"k": "v"} and start % 8 == 0  # data aligned as the reference aligns it
    loaded = safetensors.load(path)
    assert list(loaded) == list(arrays)
    for name, a in arrays.items():
        assert loaded[name].dtype == a.dtype and loaded[name].shape == a.shape
        assert loaded[name].tobytes() == a.tobytes()


def test_the_header_follows_the_published_layout(tmp_path):
    a = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    b = numpy.arange(3, dtype=numpy.int64)
    path = tmp_path / "x.safetensors"
    safetensors.write(path, [("w", a.shape, a.dtype, lambda: a), ("b", b.shape, b.dtype,
                                                                  lambda: b)])
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    assert head == {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                    "b": {"dtype": "I64", "shape": [3], "data_offsets": [24, 48]}}
    assert raw[8 + n:] == a.astype("<f4").tobytes() + b.astype("<i8").tobytes()


@pytest.mark.parametrize("damage,says", [
    (lambda raw: raw[:-4], "truncated"),
    (lambda raw: raw + b"\0", "trailing"),
    (lambda raw: struct.pack("<Q", 1 << 40) + raw[8:], "header of"),
    (lambda raw: raw[:8] + b"x" + raw[9:], "not JSON"),
    (lambda raw: b"abc", "not a safetensors file"),
])
def test_a_damaged_file_is_an_error_naming_it(tmp_path, damage, says):
    a = numpy.ones((4,), numpy.float32)
    path = tmp_path / "x.safetensors"
    safetensors.write(path, [("w", a.shape, a.dtype, lambda: a)])
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(safetensors.SafetensorsError, match=says) as e:
        safetensors.load(path)
    assert str(path) in str(e.value)


def test_a_tensor_that_differs_from_its_header_is_refused(tmp_path):
    with pytest.raises(ValueError, match="its header says"):
        safetensors.write(tmp_path / "x", [("w", (2,), numpy.float32,
                                             lambda: numpy.ones(3, numpy.float32))])


def test_gpt_names_map_to_gpt2_and_back_one_to_one():
    for tie in (True, False):
        model = models.build("gpt", vocab=11, seq_len=6, dim=8, layers=2, heads=2,
                             tie_weights=tie, seed=0)
        names = list(model.state_dict())
        there = [hf_gpt2.hf_name(n) for n in names]
        assert len({t for t, _ in there}) == len(names)
        assert [hf_gpt2.mpidl_name(t) for t, _ in there] == [
            (n, tr) for n, (_, tr) in zip(names, there)]
        assert ("lm_head.weight" in {t for t, _ in there}) == (not tie)
    assert hf_gpt2.mpidl_name("h.0.attn.bias") is None  # GPT-2's causal-mask buffer
    with pytest.raises(hf_gpt2.ConversionError):
        hf_gpt2.mpidl_name("transformer.h.0.crossattention.c_attn.weight")


@pytest.mark.parametrize("key,value", [("activation_function", "relu"),
                                       ("scale_attn_by_inverse_layer_idx", True),
                                       ("layer_norm_epsilon", 1e-6),
                                       ("model_type", "llama")])
def test_a_gpt2_that_mpidl_cannot_reproduce_is_refused_with_the_option(key, value):
    hf = hf_gpt2.config({"vocab": 11, "seq_len": 6, "dim": 8, "layers": 1, "heads": 2})
    assert hf_gpt2.options(hf)["ffn"] == 32
    with pytest.raises(hf_gpt2.ConversionError, match=key if key != "model_type" else "gpt2"):
        hf_gpt2.options({**hf, key: value})


def _run(tmp_path, model_name, preset, overrides, **build):
    """A run directory with one checkpoint of a freshly built model."""
    config = load_config(preset, [f"--model={model_name}", *overrides])
    model = models.build(model_name, seed=0, **build)
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 5, model=model.state_dict(), optimizer={}, rng={},
                    sampler={}, config=to_toml(config))
    (run / "config.toml").write_text(to_toml(config))
    return run, model


def test_an_export_holds_every_tensor_of_the_checkpoint_and_says_what_model(tmp_path):
    run, model = _run(tmp_path, "gpt", "gpt", ["--model.heads=2"], vocab=11, seq_len=6, dim=8,
                      layers=2, heads=2)
    path, out = export(str(run), str(tmp_path / "m.safetensors"))
    assert path.endswith("checkpoint-00000005.h5")
    loaded = safetensors.load(out)
    assert set(loaded) == set(model.state_dict())
    for name, value in model.state_dict().items():
        numpy.testing.assert_array_equal(loaded[name], value)
    _, metadata, _ = safetensors.read_header(out)
    assert metadata["mpidl_model"] == "gpt" and metadata["mpidl_step"] == "5"
    assert json.loads(metadata["mpidl_options"])["heads"] == 2
    assert metadata["mpidl_version"] and metadata["format"] == "pt"


def test_an_export_casts_when_asked(tmp_path):
    run, _ = _run(tmp_path, "mlp", "reviews", [], sizes=(4, 3, 2))
    _, out = export(str(run), str(tmp_path / "m.safetensors"), dtype="bfloat16")
    assert {a.dtype.name for a in safetensors.load(out).values()} == {"bfloat16"}


def test_hf_gpt2_export_writes_a_config_and_weights_that_import_back_exactly(tmp_path):
    run, model = _run(tmp_path, "gpt", "gpt", ["--model.heads=2"], vocab=11, seq_len=6, dim=8,
                      layers=2, heads=2)
    folder = tmp_path / "hf"
    export(str(run), str(folder), "hf-gpt2")
    config = json.loads((folder / "config.json").read_text())
    assert (config["n_embd"], config["n_layer"], config["n_head"], config["vocab_size"],
            config["n_positions"]) == (8, 2, 2, 11, 6)
    tensors = safetensors.load(folder / "model.safetensors")
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (8, 24)  # Conv1D: (in, out)
    assert import_main(["hf-gpt2", str(folder), str(tmp_path / "back"), "gpt",
                        "--data.vocab-size=11"]) == 0
    back = load_checkpoint(tmp_path / "back" / "checkpoints" / "checkpoint-00000000.h5")
    assert set(back.model) == set(model.state_dict())
    for name, value in model.state_dict().items():
        numpy.testing.assert_array_equal(back.model[name], value)


@pytest.mark.parametrize("argv,says", [
    (["{run}", ""], "OUT is empty"),
    (["{run}", "{tmp}/exists.safetensors"], "already exists; name another OUT, or pass --force"),
    (["{run}", "{run}/checkpoints/x.safetensors"], "which this command reads"),
    (["{run}/checkpoints/checkpoint-00000005.h5", "{run}/checkpoints/checkpoint-00000005.h5",
      "--force"], "never written over, even with --force"),
    (["{run}", "{tmp}/nowhere/x.safetensors"], "does not exist"),
    (["{run}", "{tmp}", "--format", "torch"], "is a directory"),
    (["{run}", "{tmp}/hf", "--format", "hf-gpt2"], "exports a gpt"),
    (["{tmp}/norun", "{tmp}/x.safetensors"], "no such checkpoint"),
])
def test_bad_export_input_exits_2_before_writing(tmp_path, capsys, argv, says):
    run, _ = _run(tmp_path, "mlp", "reviews", [], sizes=(4, 3, 2))
    (tmp_path / "exists.safetensors").write_text("precious")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    args = [a.format(run=run, tmp=tmp_path) for a in argv]
    assert export_main(args) == 2
    assert says in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "exists.safetensors").read_text() == "precious"


def test_force_replaces_an_existing_export(tmp_path):
    run, _ = _run(tmp_path, "mlp", "reviews", [], sizes=(4, 3, 2))
    out = tmp_path / "m.safetensors"
    out.write_text("old")
    assert export_main([str(run), str(out), "--force"]) == 0
    assert "layers.0.weight" in safetensors.load(out)


def test_import_refuses_a_pickle_without_pytorch_or_a_folder_without_weights(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_gpt2.config(
        {"vocab": 11, "seq_len": 6, "dim": 8, "layers": 1, "heads": 2})))
    assert import_main(["hf-gpt2", str(folder), str(tmp_path / "r")]) == 2
    assert "has no model.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
