"""``mpidl shard``: write a sharded HDF5 dataset, or verify one.

Examples::

    mpidl shard --from-csv IMDB.csv --text-col review --label-col sentiment data/imdb
    mpidl shard --from-csv imdb.tsv --no-header --text-col 0 --label-col 1 data/sent
    mpidl shard --from-folder aclImdb data/aclimdb        # train/{pos,neg}, test/{pos,neg}
    mpidl shard --from-npz mnist.npz data/mnist           # x_train, y_train, x_test, y_test
    mpidl shard --from-h5 big.h5 --features x,y --compression gzip data/big
    mpidl shard --verify data/imdb                        # every checksum, shape and label
    mpiexec -n 8 mpidl shard --from-csv IMDB.csv ...      # 8 ranks convert, one dataset
    mpiexec -n 8 mpidl shard --verify data/imdb           # each rank checks 1/8 of the shards

Text is cut or padded to ``--length`` tokens per sample: by default (``auto``) the
smallest multiple of 8 that 99% of the training texts fit in, at most 512
(:func:`mpidl.data.text.choose_length`); ``--length N`` forces N.

Output: ``OUT_DIR/train/`` and, when the input has a test split or ``--test-fraction`` is
above 0, ``OUT_DIR/test/`` (see :mod:`mpidl.data.format`), written beside what is there
and put in place only when complete (``--force`` replaces a dataset; a failure keeps it).
It prints what the data is, and stores it in each split's manifest
(:mod:`mpidl.data.stats`): the length chosen and the texts cut, class counts, token-length
percentiles and the unknown-token rate (text), each feature's value range and NaN/inf
count (arrays).
``--verify`` names each bad file, and each split that disagrees with ``train``
(:mod:`mpidl.data.splits`).

Exit status (docs/exit-status.md): 0 done; 2 bad input, checked before anything is
written (an option, an unreadable or malformed input file, a dataset that fails
``--verify``), one message naming the file, the value and the fix; 1 the storage failed
while writing (a full disk, a quota: the old dataset stays as it was).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Sequence

from hpc.argtypes import nonnegative_int, output_dir_problem, positive_int
from mpidl.comm import world
from mpidl.data import partition, sources
from mpidl.data.format import DataError, Manifest
from mpidl.data.hdf5 import verify_dataset
from mpidl.data.parallel import agreed, write_shards_parallel, write_text_shards_parallel
from mpidl.data.publish import StorageError
from mpidl.data.text import check_length
from mpidl.data.writer import write_shards, write_text_shards


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpidl shard",
        description="Write or verify a sharded HDF5 dataset.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Output:")[0],
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--from-csv", metavar="FILE", help="CSV/TSV file with a text and a label column"
    )
    src.add_argument(
        "--from-folder",
        metavar="DIR",
        help="one sub-folder of text files per class "
        "(optionally under train/ and test/, the aclImdb layout)",
    )
    src.add_argument(
        "--from-npz", metavar="FILE", help=".npz of arrays (x, y or x_train, ..., y_test)"
    )
    src.add_argument(
        "--from-h5", metavar="FILE", help="HDF5 file of datasets (root or train/ and test/ groups)"
    )
    src.add_argument(
        "--verify",
        metavar="DIR",
        help="check every shard of a dataset: size, sha256, datasets, dtypes, shapes, labels "
        "and token ids; and that its splits agree (features, vocabulary, classes)",
    )
    p.add_argument("out_dir", nargs="?", metavar="OUT_DIR", help="dataset directory to write")
    t = p.add_argument_group("text inputs (--from-csv, --from-folder)")
    t.add_argument("--text-col", help="text column: a header name or a 0-based number")
    t.add_argument("--feature-cols", help="numeric CSV instead of text: the feature columns "
                   "(comma-separated names or 0-based numbers), with --target-cols or "
                   "--label-col")
    t.add_argument("--target-cols", help="with --feature-cols: the float target columns "
                   "(regression: mpidl train fits them with a squared-error loss)")
    t.add_argument("--label-col", help="label column: a header name or a 0-based number "
                   "(class names, or integers)")
    t.add_argument(
        "--delimiter",
        help="field separator (default: tab for .tsv, else ','); '\\t' or 'tab' for tab",
    )
    t.add_argument("--no-header", action="store_true", help="the CSV has no header line")
    t.add_argument(
        "--quoting",
        choices=("minimal", "none"),
        help="CSV quoting (default: none for tab-separated files, minimal otherwise)",
    )
    t.add_argument(
        "--classes", help="comma-separated class names in id order (default: sorted labels)"
    )
    t.add_argument(
        "--vocab-size", type=positive_int, default=20000, help="vocabulary size incl. <pad>, <unk> (20000)"
    )
    t.add_argument("--min-freq", type=positive_int, default=1, help="rarer training words become <unk> (1)")
    t.add_argument(
        "--length",
        type=_length_arg,
        default="auto",
        help="tokens per sample, cut or padded: a number, or 'auto' (default): the smallest "
        "multiple of 8 that 99%% of the training texts fit in, at most 512",
    )
    a = p.add_argument_group("array inputs (--from-npz, --from-h5)")
    a.add_argument("--features", help="comma-separated datasets/arrays to take (default: all)")
    a.add_argument(
        "--labels",
        default="auto",
        help="integer label feature to range-check " "('auto': y if integer; 'none')",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--rows-per-shard", type=positive_int, help="rows per shard file (default: ~256 MiB per shard)"
    )
    o.add_argument(
        "--test-fraction",
        type=float,
        default=0.1,
        help="fraction of rows held out as test when the input has no test split (0.1; 0: none)",
    )
    o.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the row shuffle and the split (0)")
    o.add_argument(
        "--no-shuffle", action="store_true", help="keep input row order (not recommended)"
    )
    o.add_argument(
        "--compression",
        choices=("none", "gzip", "lzf"),
        default="none",
        help="none (contiguous, fastest reads; default) or chunked gzip/lzf",
    )
    o.add_argument(
        "--force",
        action="store_true",
        help="replace a dataset already in OUT_DIR (only once the new one is complete)",
    )
    o.add_argument(
        "--level", choices=("size", "sha256"), default="sha256", help="--verify depth (sha256)"
    )
    return p


def _length_arg(value: str) -> int | str:
    try:
        return check_length(value if value == "auto" else int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither 'auto' nor a number of tokens >= 1") from None


def _percent(share: float) -> str:
    return "<0.1%" if 0 < share < 0.001 else f"{share:.1%}"


def _length_line(manifests: dict[str, Manifest]) -> str | None:
    """``length 40 (auto: 99% of the 2700 training texts have <= 36 tokens; 21 train and
    2 test texts cut)``, from the manifests of a text dataset; None for arrays."""
    meta = manifests["train"].metadata
    choice, length = meta.get("length_choice"), meta.get("length")
    if not isinstance(choice, dict):
        return None
    n = meta["stats"]["samples"]
    covers = (f"{choice['percentile']}% of the {n} training texts have <= "
              f"{choice['percentile_tokens']} tokens")
    if choice["chosen"] == "auto":
        why = f"auto: {covers}"
        if choice["percentile_tokens"] > choice["cap"]:
            why += f", more than the cap {choice['cap']}"
    else:
        why = f"given; {covers}, so auto would choose {choice['auto']}"
    cuts = " and ".join(f"{m.metadata['stats']['tokens']['cut']} {split}"
                        for split, m in manifests.items())
    return f"length {length} ({why}; {cuts} texts cut)"


def _stats_lines(m: Manifest) -> list[str]:
    """What ``m``'s split is, from its ``metadata["stats"]``, one indented line per topic."""
    stats = m.metadata.get("stats")
    if not isinstance(stats, dict):
        return []
    lines = []
    counts = stats.get("classes")
    if counts:
        n = max(1, stats["samples"])
        items = [f"{name} {c} ({_percent(c / n)})" for name, c in counts.items()]
        if len(items) > 10:
            big = max(counts, key=lambda k: counts[k])
            small = min(counts, key=lambda k: counts[k])
            items = [f"{len(counts) + stats.get('classes_omitted', 0)} classes, largest "
                     f"{big} {counts[big]} ({_percent(counts[big] / n)}), smallest {small} "
                     f"{counts[small]} ({_percent(counts[small] / n)})"]
        lines.append("classes: " + ", ".join(items))
    t = stats.get("tokens")
    if t and t["max"] is not None:
        line = (f"tokens per text: p50 {t['p50']}, p90 {t['p90']}, p99 {t['p99']}, max "
                f"{t['max']} (mean {t['mean']:.1f}); {t['cut']} cut to "
                f"{m.metadata.get('length')}; {_percent(t['unk_rate'])} of the stored tokens "
                "are <unk>")
        if t["empty"]:
            line += f"; {t['empty']} texts have no token (all padding)"
        lines.append(line)
    for name, f in (stats.get("features") or {}).items():
        if f["min"] is None and not f["nan"] + f["inf"]:
            continue
        if f["min"] is not None:
            lines.append(f"{name}: min {f['min']:.6g}, max {f['max']:.6g}, mean {f['mean']:.6g}, "
                         f"std {f['std']:.6g}")
        if f["nan"] or f["inf"]:
            lines.append(
                f"warning: {name} holds {f['nan']} NaN and {f['inf']} infinite value(s); a "
                "model trained on them gets a NaN loss: replace them (numpy.nan_to_num) or "
                "drop those rows")
    return lines


def _describe(path: str, m: Manifest) -> str:
    feats = ", ".join(f"{n} {f.dtype.name}{list(f.shape)}" for n, f in m.features.items())
    extra = ""
    if "vocab" in m.metadata:
        extra += f"; vocabulary {len(m.metadata['vocab'])}"
    if "classes" in m.metadata:
        extra += f"; classes {m.metadata['classes']}"
    return f"{path}: {m.num_samples} samples in {len(m.shards)} shard(s); {feats}{extra}"


def _delimiter(args: argparse.Namespace) -> str | None:
    """``--delimiter``, with ``\\t`` and ``tab`` meaning a tab; None: by the file name."""
    if not args.delimiter:
        return None
    return {"\\t": "\t", "tab": "\t"}.get(args.delimiter, args.delimiter)


def _check_inputs_kept(args: argparse.Namespace) -> None:
    """OutputError (a ValueError: exit 2) when the input is a file of the dataset that
    OUT_DIR holds, which the new one replaces: never written over, even with --force
    (:func:`hpc.files.check_output`); DataError when OUT_DIR holds a dataset and --force
    is not given. Before the input is read: the same rule holds again when the splits
    are published, but an hour's conversion must not end in it."""
    from hpc.files import check_output
    from mpidl.data.publish import dataset_files, old_files

    reads = [p for p in (args.from_csv, args.from_folder, args.from_npz, args.from_h5) if p]
    for split in ("train", "test"):
        folder = os.path.join(args.out_dir, split)
        for name in dataset_files(folder):
            check_output(os.path.join(folder, name), force=True, reads=reads,
                         instead="another OUT_DIR")
    old_files(args.out_dir, args.force, ("train", "test"))


def _check_out_dir(path: str) -> None:
    # Before the input is read: a conversion of an hour must not end in a failed write.
    # On every rank (agreed): under mpiexec each rank writes its own shards into it.
    problem = output_dir_problem(path)
    if problem is not None:
        raise DataError(f"OUT_DIR {problem}")


def _write(args: argparse.Namespace, comm: Any) -> dict[str, Manifest]:
    """Read the input and write the dataset: as one process, or, on several ranks, each
    rank its share (:mod:`mpidl.data.parallel`)."""
    parallel = comm.size > 1
    common = {
        "rows_per_shard": args.rows_per_shard,
        "seed": args.seed,
        "shuffle": not args.no_shuffle,
        "compression": None if args.compression == "none" else args.compression,
        "overwrite": args.force,
    }
    classes = args.classes.split(",") if args.classes else None
    text = {
        "vocab_size": args.vocab_size,
        "min_freq": args.min_freq,
        "length": args.length,
        "classes": classes,
    }
    write_text, write_arrays = write_text_shards, write_shards
    if parallel:
        write_text = functools.partial(write_text_shards_parallel, comm)
        write_arrays = functools.partial(write_shards_parallel, comm)
    if args.from_csv and args.feature_cols:
        targets = args.target_cols.split(",") if args.target_cols else []
        read = functools.partial(partition.read_csv_arrays_share, comm) if parallel \
            else sources.read_csv_arrays
        arrays, names = read(
            args.from_csv, args.feature_cols.split(","), targets, label_col=args.label_col,
            classes=classes, delimiter=_delimiter(args), header=not args.no_header)
        if names is None:  # regression: the target names (or numbers) are what predict prints
            return write_arrays(args.out_dir, arrays, test_fraction=args.test_fraction,
                                labels=None, source=args.from_csv,
                                metadata={"targets": targets}, **common)
        return write_arrays(args.out_dir, arrays, test_fraction=args.test_fraction,
                            labels="y", num_classes=len(names), source=args.from_csv,
                            metadata={"classes": names}, **common)
    if args.from_csv:
        csv_options = {"delimiter": _delimiter(args), "header": not args.no_header,
                       "quoting": args.quoting}
        if parallel:
            texts, labels = partition.read_csv_share(comm, args.from_csv, args.text_col,
                                                     args.label_col, **csv_options)
        else:
            texts, labels = sources.read_csv(args.from_csv, args.text_col, args.label_col,
                                             **csv_options)
        return write_text(
            args.out_dir,
            texts,
            labels,
            test_fraction=args.test_fraction,
            source=args.from_csv,
            **text,
            **common,
        )
    if args.from_folder:
        if parallel:
            splits, found = partition.read_folder_share(comm, args.from_folder, classes)
        else:
            splits, found = sources.read_folder(args.from_folder, classes)
        train, test = splits["train"], splits.get("test")
        return write_text(
            args.out_dir,
            *train,
            test_texts=test and test[0],
            test_labels=test and test[1],
            test_fraction=0.0 if test else args.test_fraction,
            source=args.from_folder,
            **{**text, "classes": found},
            **common,
        )
    features = args.features.split(",") if args.features else None
    part = (comm.rank, comm.size) if parallel else None
    if args.from_npz:
        source = args.from_npz
        splits = agreed(comm, sources.load_npz, source, part)
        if features:
            missing = [f for f in features if f not in splits["train"]]
            if missing:
                raise DataError(
                    f"{source}: no array(s) {missing}; it has {sorted(splits['train'])}"
                )
            splits = {s: {f: a[f] for f in features} for s, a in splits.items()}
    else:
        source = args.from_h5
        splits = agreed(comm, sources.load_h5, source, features, part)
    labels = None if args.labels == "none" else args.labels
    return write_arrays(
        args.out_dir,
        splits["train"],
        test_arrays=splits.get("test"),
        test_fraction=0.0 if "test" in splits else args.test_fraction,
        labels=labels,
        source=source,
        **common,
    )


def main(argv: Sequence[str] | None = None, comm: Any = None) -> int:
    """Run ``mpidl shard``; returns the exit status (2 for bad input, 1 for a failed write).

    Under ``mpiexec -n P`` (P > 1) the ranks share the work (:mod:`mpidl.data.parallel`;
    ``--verify``: each rank checks a share of the shards) and every rank returns the same
    status; rank 0 alone prints. ``comm`` (default: the job's :func:`mpidl.comm.world`)
    lets tests run it on thread ranks.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    comm = comm or world()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    try:
        if args.verify:
            datasets = verify_dataset(args.verify, level=args.level,
                                      comm=comm if comm.size > 1 else None)
            for ds in datasets:
                say(f"OK {_describe(ds.path, ds.manifest)} ({args.level} checked"
                    + (f" by {comm.size} ranks)" if comm.size > 1 else ")"))
            return 0
        if not args.out_dir:
            say("mpidl shard: OUT_DIR is required when writing a dataset", file=sys.stderr)
            return 2
        if args.from_csv and args.feature_cols and \
                bool(args.target_cols) == (args.label_col is not None):
            say("mpidl shard: --feature-cols needs either --target-cols (regression "
                "targets) or --label-col (a class label per row)", file=sys.stderr)
            return 2
        if args.from_csv and not args.feature_cols and (args.text_col is None
                                                        or args.label_col is None):
            say(
                "mpidl shard: --from-csv needs --text-col and --label-col (names, or 0-based "
                "numbers with --no-header)",
                file=sys.stderr,
            )
            return 2
        _check_inputs_kept(args)
        agreed(comm, _check_out_dir, args.out_dir)
        manifests = _write(args, comm)
        length = _length_line(manifests)
        if length:
            say(length)
        for split, manifest in manifests.items():
            say(f"wrote {_describe(f'{args.out_dir}/{split}', manifest)}")
            for line in _stats_lines(manifest):
                say(f"  {line}")
        return 0
    except StorageError as e:
        say(f"mpidl shard: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # DataError too: bad input, found before anything is written
        say(f"mpidl shard: error: {e}", file=sys.stderr)
        return 2
