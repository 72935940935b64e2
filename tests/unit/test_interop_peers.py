"""mpidl's exports and imports checked against the peers' own code: the ``safetensors``
package, PyTorch's ``load_state_dict(strict=True)`` and ``transformers``' GPT-2.

Needs the [interop] extra (torch, transformers, safetensors): README's install skips these,
and `tests/run.py --extras` runs them. Tolerances: 1e-5 in float32, 1e-10 in float64.
"""
from __future__ import annotations

import json

import numpy
import pytest

from mpidl import models
from mpidl.interop import safetensors as ours
from mpidl.interop.command import export, export_main, import_main
from mpidl.interop.torch_modules import torch_module
from mpidl.train.checkpoint import load_checkpoint, save_checkpoint
from mpidl.train.config import load_config, to_toml

TOL = {"float32": 1e-5, "float64": 1e-10}


def _run(tmp_path, model_name, preset, overrides, dtype, **build):
    config = load_config(preset, [f"--model={model_name}", *overrides])
    model = models.build(model_name, seed=0, dtype=dtype, **build)
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 3, model=model.state_dict(), optimizer={}, rng={},
                    sampler={}, config=to_toml(config))
    (run / "config.toml").write_text(to_toml(config))
    return run, model


def _close(a, b, dtype):
    numpy.testing.assert_allclose(numpy.asarray(a), numpy.asarray(b), rtol=TOL[dtype],
                                  atol=TOL[dtype])


@pytest.mark.extra("safetensors")
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16", "int64", "uint8"])
def test_the_safetensors_package_reads_what_mpidl_writes_and_the_reverse(tmp_path, dtype):
    st = pytest.importorskip("safetensors.numpy")
    from mpidl.backend import named_dtype

    rng = numpy.random.default_rng(0)
    arrays = {"a": (rng.normal(size=(3, 4)) * 50).astype(named_dtype(dtype)),
              "b": (rng.normal(size=(5,)) * 50).astype(named_dtype(dtype))}
    path = tmp_path / "x.safetensors"
    ours.write(path, [(n, a.shape, a.dtype, lambda a=a: a) for n, a in arrays.items()])
    if dtype != "bfloat16":  # safetensors.numpy has no bfloat16 (NumPy lacks it)
        theirs = st.load_file(str(path))
        for n, a in arrays.items():
            assert theirs[n].tobytes() == a.tobytes()
        st.save_file(arrays, str(tmp_path / "theirs.safetensors"))
        back = ours.load(tmp_path / "theirs.safetensors")
        assert all(back[n].tobytes() == a.tobytes() for n, a in arrays.items())
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    loaded = load_file(str(path))
    for n, a in arrays.items():
        t = loaded[n]
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        assert raw.numpy().tobytes() == a.tobytes()


@pytest.mark.extra("torch")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_an_exported_mlp_and_bag_of_words_load_strictly_into_pytorch_and_agree(
        tmp_path, dtype, fmt):
    torch = pytest.importorskip("torch")
    rng = numpy.random.default_rng(1)
    cases = [("mlp", "reviews", [], dict(sizes=(6, 5, 3), input_stats=(
                  rng.normal(size=6).tolist(), (rng.random(6) + 0.5).tolist())),
              rng.normal(size=(4, 6))),
             ("bow", "reviews", [], dict(vocab=13, dim=4, hidden=5, classes=3, pad_id=0),
              numpy.array([[3, 4, 0, 0], [5, 6, 7, 12], [0, 0, 0, 9]]))]
    for name, preset, overrides, build, x in cases:
        case = tmp_path / name
        run, model = _run(case, name, preset, overrides, dtype, **build)
        out = case / ("m.pt" if fmt == "torch" else "m.safetensors")
        export(str(run), str(out), fmt)
        if fmt == "torch":
            state = torch.load(out, weights_only=True)
            metadata = state._metadata["mpidl"]
        else:
            from safetensors.torch import load_file
            state = load_file(str(out))
            _, metadata, _ = ours.read_header(out)
        options = {**json.loads(metadata["mpidl_options"]), **build}
        module = torch_module(metadata["mpidl_model"], options)
        module = module.to(getattr(torch, dtype))
        module.load_state_dict(state, strict=True)
        want = model(x.astype(dtype) if name == "mlp" else x).data
        got = module(torch.from_numpy(x.astype(dtype) if name == "mlp" else x)).detach()
        _close(got.numpy(), want, dtype)


def _tiny_gpt2(transformers, torch, tie=True, seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=29, n_positions=12, n_embd=16, n_layer=2,
                                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, tie_word_embeddings=tie)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # LayerNorms and biases start at 1 and 0: make them count
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


IDS = numpy.array([[1, 5, 7, 3, 28, 0, 2], [4, 4, 9, 11, 2, 13, 17]])


@pytest.mark.extra("transformers")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tie", [True, False])
def test_a_gpt2_made_by_transformers_imports_with_the_same_logits(tmp_path, dtype, tie):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = _tiny_gpt2(transformers, torch, tie)
    folder = tmp_path / "hf"
    hf.save_pretrained(folder, safe_serialization=True)
    assert import_main(["hf-gpt2", str(folder), str(tmp_path / "run"), "gpt",
                        "--data.vocab-size=29"]) == 0
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "checkpoint-00000000.h5")
    options = json.loads(json.dumps({"vocab": 29, "seq_len": 12, "dim": 16, "layers": 2,
                                     "heads": 4, "tie_weights": tie}))
    model = models.build("gpt", **options, dtype=dtype)
    model.load_state_dict({k: numpy.asarray(v).astype(dtype) for k, v in state.model.items()})
    hf = hf.to(getattr(torch, dtype))
    with torch.no_grad():
        want = hf(torch.from_numpy(IDS)).logits.numpy()
    _close(model(IDS).data, want, dtype)


@pytest.mark.extra("transformers")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tie", [True, False])
def test_an_exported_gpt_loads_in_transformers_with_the_same_logits(tmp_path, dtype, tie):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    run, model = _run(tmp_path, "gpt", "gpt", ["--model.heads=4"], dtype, vocab=29,
                      seq_len=12, dim=16, layers=2, heads=4, tie_weights=tie)
    folder = tmp_path / "hf"
    assert export_main([str(run), str(folder), "--format", "hf-gpt2"]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, torch_dtype=getattr(torch, dtype))
    hf.eval()
    with torch.no_grad():
        got = hf(torch.from_numpy(IDS)).logits.numpy()
    _close(got, model(IDS).data, dtype)


@pytest.mark.extra("torch")
def test_a_pickle_loads_only_through_weights_only_and_one_with_code_is_refused(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = _tiny_gpt2(transformers, torch)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(hf.config.to_json_string())
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    assert import_main(["hf-gpt2", str(folder), str(tmp_path / "ok"), "gpt",
                        "--data.vocab-size=29"]) == 0
    torch.save({"w": torch.ones(2), "code": print}, folder / "pytorch_model.bin")
    assert import_main(["hf-gpt2", str(folder), str(tmp_path / "bad"), "gpt"]) == 2
    assert "weights_only" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
