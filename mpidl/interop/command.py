"""``mpidl export`` and ``mpidl import``: a trained model out to the tools everyone uses,
and GPT-2 weights made elsewhere in.

Run (one process; no launcher needed)::

    mpidl export runs/reviews reviews.safetensors                  # newest checkpoint that loads
    mpidl export runs/reviews reviews.pt --format torch            # a PyTorch state dict
    mpidl export runs/gpt gpt2-folder --format hf-gpt2             # transformers' GPT2LMHeadModel
    mpidl import hf-gpt2 gpt2-folder runs/tuned                    # a run directory to fine-tune

An export reads the checkpoint one tensor at a time (a sharded one's pieces assembled
tensor by tensor): the process holds one tensor, never the model. Tensors keep mpidl's
names, which are PyTorch's for the matching modules (:mod:`mpidl.interop.torch_modules`);
``hf-gpt2`` renames and transposes them to GPT-2's (:mod:`mpidl.interop.hf_gpt2`).
Metadata (safetensors' ``__metadata__``; the state dict's ``_metadata["mpidl"]``) records
the model, its options, the checkpoint's step and the mpidl version.

Exit codes: 0 written; 2 bad input before any work (no checkpoint that loads, a model
the format cannot hold, an existing OUT without ``--force``, a missing extra).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from typing import Any, Callable, Sequence

from hpc.files import OutputError, check_output, replacing, write_text
from mpidl.interop import hf_gpt2, safetensors

EXIT_USAGE = 2
FORMATS = ("safetensors", "torch", "hf-gpt2")


class ExportError(ValueError):
    """Bad input to export or import; the message names the value and the fix."""


# -- reading a checkpoint's model, tensor by tensor -------------------------------------------

def _model_of(path: str, config_text: str) -> tuple[str, dict[str, Any]]:
    """The model's name and its options as the run built it: the configuration's,
    completed by the data when the run directory keeps its description (the statistics
    a model standardises with are buffers, exported as tensors: here only whether)."""
    from mpidl.data.description import read_description
    from mpidl.train.config import config_from_dict, tomllib
    from mpidl.train.consolidate import run_dir_of
    from mpidl.train.model import STATS_OPTIONS, model_options
    from mpidl.train.retention import DATASET_FILE

    config = config_from_dict(tomllib.loads(config_text))
    options = dict(config.model.kwargs)
    description = os.path.join(run_dir_of(path), DATASET_FILE)
    if os.path.isfile(description):
        options = model_options(config, read_description(description))
    return config.model.name, {k: (v is not None) if k in STATS_OPTIONS else
                               list(v) if isinstance(v, tuple) else v
                               for k, v in options.items()}


def checkpoint_tensors(path: str) -> tuple[Any, list[tuple[str, tuple, Any, Callable]], Any]:
    """``(checkpoint, [(name, shape, dtype, make)], source)`` of the model in checkpoint
    ``path`` (any format), in the model's order; close ``source`` when done."""
    from mpidl.backend import named_dtype
    from mpidl.parallel.holdings import Key
    from mpidl.train import checkpoint as ckpt
    from mpidl.train.pieces import assemble

    state = ckpt.load_checkpoint(path, "none")
    if state.index is not None:
        from mpidl.train.sharded import ShardedSource

        source = ShardedSource(state.path, state.index)
        names = list(source.meta["order"]) + list(source.meta.get("buffers", []))
    else:
        from mpidl.train.pieces import file_source

        # The optimizer's arrays are named by parameter index; an export reads none of
        # them, so any list at least as long as the parameters serves as the order.
        import h5py

        with h5py.File(path, "r", locking=False) as f:
            names = [n for n, v in f["model"].items() if not hasattr(v, "keys")]
        source = file_source(path, names)
    tensors = []
    for name in names:
        key = Key("model", name)
        if key not in source.keys:
            continue
        shape, dtype = source.keys[key]
        tensors.append((name, tuple(shape), named_dtype(dtype),
                        lambda key=key: assemble(source, key)))
    return state, tensors, source


def _cast(tensors: list, dtype: str | None) -> list:
    """Floating tensors cast to ``dtype`` as they are made (None: as stored)."""
    if dtype is None:
        return tensors
    import numpy

    from mpidl.backend import is_half, named_dtype

    want = named_dtype(dtype)

    def floating(d: Any) -> bool:
        return numpy.dtype(d).kind == "f" or is_half(d)

    return [(n, s, want, lambda m=m: numpy.asarray(m()).astype(want)) if floating(d)
            else (n, s, d, m) for n, s, d, m in tensors]


def _gpt_options(options: dict[str, Any], tensors: list) -> dict[str, Any]:
    """The gpt's full options: the run's, completed from the tensors' shapes (vocab,
    positions, width, layers and FFN width are in the shapes; heads only in the run's
    configuration or the model's default)."""
    import inspect

    from mpidl import models

    shapes = {n: s for n, s, _, _ in tensors}
    defaults = {k: p.default for k, p in inspect.signature(models.gpt).parameters.items()
                if p.default is not inspect.Parameter.empty}
    layers = len({n.split(".")[1] for n in shapes if n.startswith("blocks.")})
    return {"vocab": shapes["tok.weight"][0], "seq_len": shapes["pos"][0],
            "dim": shapes["tok.weight"][1], "layers": layers,
            "heads": int(options.get("heads", defaults["heads"])),
            "ffn": shapes["blocks.0.linear1.weight"][0] if layers else 4 * shapes["pos"][1],
            "dropout": float(options.get("dropout", 0.0)),
            "tie_weights": "head.weight" not in shapes}


def _metadata(model: str, options: dict[str, Any], step: int) -> dict[str, str]:
    from mpidl.train.checkpoint_file import _mpidl_version

    return {"format": "pt",  # transformers' loader asks safetensors files for it
            "mpidl_model": model, "mpidl_options": json.dumps(options, sort_keys=True,
                                                              default=str),
            "mpidl_step": str(step), "mpidl_version": _mpidl_version()}


# -- writing ---------------------------------------------------------------------------------

def _write_torch(out: str, tensors: list, metadata: dict[str, str]) -> None:
    """A state dict for ``torch.load(..., weights_only=True)``. ``torch.save`` takes every
    tensor at once, so they are views of a safetensors file written first and memory-
    mapped: the data stays in the page cache (file pages the kernel can drop), not in the
    process's own memory."""
    try:
        import torch  # here: --format torch alone needs PyTorch
    except ImportError:
        raise ExportError("--format torch needs PyTorch: pip install torch (or export "
                          "--format safetensors, which PyTorch reads with the safetensors "
                          "package)") from None
    import collections

    import numpy

    folder = os.path.dirname(os.path.abspath(out))
    with tempfile.TemporaryDirectory(prefix="mpidl-export-", dir=folder) as scratch:
        flat = os.path.join(scratch, "model.safetensors")
        safetensors.write(flat, tensors)
        head, _, start = safetensors.read_header(flat)
        raw = numpy.memmap(flat, dtype=numpy.uint8, mode="r")
        state: dict[str, Any] = collections.OrderedDict()
        for name, _, dtype, _ in tensors:
            begin, stop = head[name]["data_offsets"]
            data = raw[start + begin:start + stop]
            with warnings.catch_warnings():  # read-only on purpose: torch.save only reads
                warnings.simplefilter("ignore", UserWarning)
                if numpy.dtype(dtype).name == "bfloat16":  # torch has no view of ml_dtypes'
                    t = torch.from_numpy(data.view(numpy.int16)).view(torch.bfloat16)
                else:
                    t = torch.from_numpy(data.view(dtype))
            state[name] = t.reshape(head[name]["shape"])
        state._metadata = collections.OrderedDict(mpidl=dict(metadata))  # type: ignore
        with replacing(out) as tmp:
            torch.save(state, tmp)
        del raw


def export(source: str, out: str, fmt: str = "safetensors", dtype: str | None = None,
           force: bool = False) -> tuple[str, str]:
    """Export the model of ``source`` (a run directory: its newest checkpoint that loads;
    or a checkpoint file) to ``out`` in ``fmt``; returns ``(checkpoint, out)``."""
    from mpidl.train.consolidate import find_checkpoint

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    if not out:
        raise ExportError("OUT is empty: name the file (or, for hf-gpt2, the folder) to write")
    path = find_checkpoint(source)
    _check_out(out, fmt, force, path)
    state, tensors, reader = checkpoint_tensors(path)
    with reader:
        model, options = _model_of(path, state.config)
        if fmt == "hf-gpt2" and model != "gpt":
            raise ExportError(f"--format hf-gpt2 exports a gpt; {path} holds a {model!r} "
                              "(use --format safetensors or torch)")
        if model == "gpt":
            options = _gpt_options(options, tensors)
        tensors = _cast(tensors, dtype)
        metadata = _metadata(model, options, state.step)
        if fmt == "safetensors":
            with replacing(out) as tmp:
                safetensors.write(tmp, tensors, metadata)
        elif fmt == "torch":
            _write_torch(out, tensors, metadata)
        else:
            os.makedirs(out, exist_ok=True)
            stored = {str(d) for _, _, d, _ in tensors}
            config = hf_gpt2.config(options, dtype=stored.pop() if len(stored) == 1
                                    else "float32")
            with replacing(os.path.join(out, "model.safetensors")) as tmp:
                safetensors.write(tmp, hf_gpt2.to_hf(tensors), metadata)
            write_text(os.path.join(out, "config.json"), json.dumps(config, indent=2) + "\n")
    return path, out


def _check_out(out: str, fmt: str, force: bool, checkpoint: str) -> None:
    """Refuse an OUT that exists without ``--force`` and, even with it, one inside the
    run's checkpoints or the checkpoint read (:func:`hpc.files.check_output`)."""
    from mpidl.train.consolidate import run_dir_of

    reads = [checkpoint, os.path.join(run_dir_of(checkpoint), "checkpoints")]
    if fmt == "hf-gpt2":
        if os.path.exists(out) and not os.path.isdir(out):
            raise ExportError(f"OUT {out} is a file; --format hf-gpt2 writes a folder")
        for name in ("config.json", "model.safetensors"):
            check_output(os.path.join(out, name), force=force, reads=reads,
                         instead="another OUT folder")
        where = os.path.dirname(os.path.abspath(out))
    else:
        if os.path.isdir(out):
            raise ExportError(f"OUT {out} is a directory; name the file to write")
        check_output(out, force=force, reads=reads, instead="another OUT")
        where = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(where):
        raise ExportError(f"the directory {where} does not exist; create it (mkdir -p "
                          f"{where}) or name another OUT")


# -- importing -------------------------------------------------------------------------------

def hf_tensors(folder: str) -> dict[str, Any]:
    """A Hugging Face model folder's tensors: ``model.safetensors`` (or its sharded
    index), or a pickle ``pytorch_model.bin`` loaded only with ``weights_only=True``."""
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    binary = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(single):
        return safetensors.load(single)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        tensors: dict[str, Any] = {}
        for name in files:
            tensors.update(safetensors.load(os.path.join(folder, name)))
        return tensors
    if os.path.isfile(binary):
        try:
            import torch
        except ImportError:
            raise ExportError(f"{binary} is a pickle, which can run code when loaded; mpidl "
                              "loads one only through torch.load(weights_only=True), which "
                              "needs PyTorch (pip install torch), or convert it to "
                              "safetensors") from None
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:  # torch's refusal of a pickle that holds more than tensors
            raise ExportError(f"{binary} does not load with weights_only=True ({e}); mpidl "
                              "does not run the code a pickle may hold") from None
        return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy()
                for k, v in state.items()}
    raise ExportError(f"{folder} has no model.safetensors, model.safetensors.index.json or "
                      "pytorch_model.bin")


def import_hf_gpt2(folder: str, run_dir: str, preset: str | None, overrides: Sequence[str],
                   force: bool = False) -> str:
    """Write ``run_dir``: the configuration of ``preset`` with the GPT-2's model options,
    and a step-0 checkpoint of its weights; returns the checkpoint's path."""
    import numpy

    from mpidl.train.build import build_optimizer
    from mpidl.train.checkpoint import save_checkpoint
    from mpidl.train.config import ConfigError, load_config, to_toml
    from mpidl.train.rundir import CONFIG_FILE, checkpoint_dir

    config_json = os.path.join(folder, "config.json")
    if not os.path.isfile(config_json):
        raise ExportError(f"{folder} has no config.json: is it a Hugging Face model folder?")
    with open(config_json) as f:
        hf = json.load(f)
    opts = hf_gpt2.options(hf)
    if os.path.exists(run_dir) and os.listdir(run_dir) and not force:
        raise ExportError(f"{run_dir} exists and is not empty; pass --force to write into "
                          "it, or name a new run directory")
    state = hf_gpt2.from_hf(hf_tensors(folder))
    if opts["tie_weights"]:
        state.pop("head.weight", None)
    model_args = [f"--model.{k}={json.dumps(v) if isinstance(v, bool) else v}"
                  for k, v in opts.items()]
    try:
        config = load_config(preset or "gpt", ["--model=gpt", *model_args, *overrides])
    except ConfigError as e:
        raise ExportError(str(e)) from None
    from mpidl import models

    dtype = {numpy.asarray(v).dtype for v in state.values()}
    built = models.build("gpt", **opts, dtype=dtype.pop() if len(dtype) == 1 else None)
    try:
        built.load_state_dict(state)
    except (KeyError, ValueError) as e:
        raise ExportError(f"{folder}'s weights do not fit its config.json: {e}") from None
    text = to_toml(config)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, CONFIG_FILE), "w") as f:
        f.write(text)
    # A fresh optimizer's state (step 0, the configured rate): a resume sets it as a
    # first run would, and fine-tuning starts from the imported weights.
    optimizer = build_optimizer(config, list(built.parameters())).state_dict()
    return save_checkpoint(checkpoint_dir(run_dir), 0, model=built.state_dict(),
                           optimizer=optimizer, rng={}, sampler={"epoch": 0, "step": 0},
                           config=text,
                           extra={"imported_from": os.path.abspath(folder)})


# -- the commands ----------------------------------------------------------------------------

def export_main(argv: Sequence[str]) -> int:
    """``mpidl export RUN_DIR|CHECKPOINT OUT [--format F] [--dtype D] [--force]``."""
    parser = argparse.ArgumentParser(
        prog="mpidl export", description="Write a run's model for other tools: safetensors, "
                                         "a PyTorch state dict, or a Hugging Face GPT-2.")
    parser.add_argument("source", metavar="RUN_DIR|CHECKPOINT",
                        help="a run directory (its newest checkpoint that loads) or a checkpoint")
    parser.add_argument("out", metavar="OUT", help="the file (for hf-gpt2, the folder) to write")
    parser.add_argument("--format", default="safetensors", choices=FORMATS)
    parser.add_argument("--dtype", choices=("float64", "float32", "float16", "bfloat16"),
                        help="cast floating tensors (default: as stored)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT")
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    from mpidl.train.checkpoint_file import CheckpointError

    try:
        path, out = export(args.source, args.out, args.format, args.dtype, args.force)
    except (ExportError, OutputError, FileNotFoundError, CheckpointError,
            hf_gpt2.ConversionError) as e:
        print(f"mpidl export: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{path} -> {out} ({args.format})")
    return 0


def import_main(argv: Sequence[str]) -> int:
    """``mpidl import hf-gpt2 FOLDER RUN_DIR [PRESET] [--key=value ...] [--force]``."""
    parser = argparse.ArgumentParser(
        prog="mpidl import", description="Make a run directory from weights made elsewhere, "
                                         "for mpidl train (fine-tuning), eval and predict.")
    parser.add_argument("format", choices=("hf-gpt2",))
    parser.add_argument("folder", help="a Hugging Face GPT-2 folder (config.json and weights)")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory to make")
    parser.add_argument("preset", nargs="?", default=None,
                        help="the preset or config file for training (default: gpt)")
    parser.add_argument("--force", action="store_true",
                        help="write into a run directory that is not empty")
    try:
        args, overrides = parser.parse_known_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    try:
        written = import_hf_gpt2(args.folder, args.run_dir, args.preset, overrides, args.force)
    except (ExportError, hf_gpt2.ConversionError, safetensors.SafetensorsError,
            FileNotFoundError) as e:
        print(f"mpidl import: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{args.folder} -> {written}")
    print(f"fine-tune: mpiexec -n 2 mpidl train {os.path.join(args.run_dir, 'config.toml')} "
          f"--run-dir {args.run_dir}")
    return 0


__all__ = ["ExportError", "FORMATS", "checkpoint_tensors", "export", "hf_tensors",
           "import_hf_gpt2", "export_main", "import_main"]
