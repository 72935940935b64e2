"""mpidl's defaults against scikit-learn's first try, on the same splits (#47).

For each dataset, what a user does: write it as a CSV, ``mpidl shard`` it with the
defaults, ``mpiexec -n RANKS mpidl train --data DIR`` with no model options (the model,
its options and the epochs follow the data), over several seeds; and what they would
try in five minutes, on the very rows of mpidl's train and test splits:

- the 3,000 UCI review sentences (tests/data): ``LogisticRegression(C=10)`` on the word
  counts of the same tokens (the issue's setting; scikit-learn's CountVectorizer gives
  0.817 on its own tokens);
- scikit-learn's bundled tables, breast cancer, wine and digits: ``StandardScaler`` +
  ``LogisticRegression()``; diabetes (regression): ``StandardScaler`` + ``Ridge()``;
- the generated reviews (``mpidl train`` with no arguments, the README's command):
  ``LogisticRegression(C=10)`` on the counts of its tokens.

Classification is scored by test accuracy, regression by the test RMSE. The margins of
issue #47: the mean over seeds within 1 point of accuracy or one test row, whichever is
larger; for regression within 2% of the RMSE. scikit-learn is deterministic here, so
it runs once. From the repository root::

    .venv/bin/python benchmarks/baselines.py                      # all, 3 seeds, 2 ranks
    .venv/bin/python benchmarks/baselines.py --datasets sentences,wine --seeds 0 --json out.json

Results: docs/data.md ("Against scikit-learn").
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy

from mpidl.data import ShardedDataset
from mpidl.testing.launch import mpiexec

HERE = os.path.dirname(os.path.abspath(__file__))
SENTENCES = os.path.join(os.path.dirname(HERE), "tests", "data", "sentiment-sentences")
TABLES = {"breast_cancer": "load_breast_cancer", "wine": "load_wine",
          "digits": "load_digits", "diabetes": "load_diabetes"}
DATASETS = ("sentences", *TABLES, "reviews")
MPIDL = [sys.executable, "-m", "mpidl"]


def _run(args: list[str], timeout: float = 600) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def write_dataset(name: str, root: str) -> str:
    """``name`` as a user's CSV, sharded by ``mpidl shard`` with its defaults: the dataset
    directory (the generated reviews: "" for mpidl's own corpus)."""
    if name == "reviews":
        return ""
    path, out = os.path.join(root, f"{name}.csv"), os.path.join(root, name)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if name == "sentences":
            w.writerow(["text", "label"])
            for part in ("imdb", "amazon", "yelp"):
                with open(os.path.join(SENTENCES, f"{part}.tsv"), encoding="utf-8") as src:
                    for line in src:
                        w.writerow(line.rstrip("\n").rsplit("\t", 1))
            args = ["--text-col", "text", "--label-col", "label"]
        else:
            from sklearn import datasets

            table = getattr(datasets, TABLES[name])()
            cols = [f"f{i}" for i in range(table.data.shape[1])]
            w.writerow([*cols, "target"])
            for row, t in zip(table.data, table.target):
                w.writerow([f"{v:.17g}" for v in row] + [f"{t:.17g}"])
            target = "--target-cols" if name == "diabetes" else "--label-col"
            args = ["--feature-cols", ",".join(cols), target, "target"]
    _run([*MPIDL, "shard", "--from-csv", path, *args, out])
    return out


def _split(data: str, name: str) -> tuple[numpy.ndarray, numpy.ndarray, ShardedDataset]:
    ds = ShardedDataset(os.path.join(data, name))
    ids = numpy.arange(len(ds))
    return ds.read("x", ids), ds.read("y", ids), ds


def _counts(x: numpy.ndarray, vocab: int, pad: int) -> object:
    import scipy.sparse

    rows = numpy.repeat(numpy.arange(len(x)), x.shape[1])
    ids = x.reshape(-1)
    keep = ids != pad
    return scipy.sparse.csr_matrix((numpy.ones(int(keep.sum())), (rows[keep], ids[keep])),
                                   shape=(len(x), vocab))


def sklearn_score(data: str) -> tuple[str, float]:
    """scikit-learn's first try on ``data``'s own train and test rows: ``(metric, value)``."""
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    xtr, ytr, train = _split(data, "train")
    xte, yte, _ = _split(data, "test")
    if train.vocab:
        pad = train.manifest.pad_id
        model = LogisticRegression(C=10, max_iter=5000)
        model.fit(_counts(xtr, len(train.vocab), pad), ytr)
        return "accuracy", float(model.score(_counts(xte, len(train.vocab), pad), yte))
    xtr, xte = xtr.reshape(len(xtr), -1), xte.reshape(len(xte), -1)
    if ytr.dtype.kind == "f":
        model = make_pipeline(StandardScaler(), Ridge()).fit(xtr, ytr)
        return "rmse", float(numpy.sqrt(numpy.mean((model.predict(xte) - yte) ** 2)))
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000)).fit(xtr, ytr)
    return "accuracy", float(model.score(xte, yte))


def mpidl_score(data: str, seed: int, ranks: int, run_dir: str,
                cache: str) -> tuple[str, float, float, str]:
    """``mpidl train --data DIR --seed S`` on ``ranks`` ranks, no other option:
    ``(metric, value, seconds, model)``; the generated reviews with no --data."""
    args = [*MPIDL, "train", f"--run-dir={run_dir}", "--progress=never", f"--seed={seed}",
            "--baseline=off", f"--data.cache-dir={cache}"]
    if data:
        args.append(f"--data={data}")
    start = time.perf_counter()
    done = mpiexec(ranks, args, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"mpidl train exited {done.returncode}:\n{done.output[-3000:]}")
    seconds = time.perf_counter() - start
    with open(os.path.join(run_dir, "config.toml"), encoding="utf-8") as f:
        model = next(line.split('"')[1] for line in f if line.startswith("name = "))
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        last = [r for r in map(json.loads, f) if r["kind"] == "eval"][-1]
    if "test_accuracy" in last:
        return "accuracy", float(last["test_accuracy"]), seconds, model
    return "rmse", math.sqrt(last["test_mse"]), seconds, model


def generated_reviews(cache: str) -> str:
    """The dataset directory ``mpidl train`` generated into ``cache``."""
    found = [os.path.dirname(p) for p in glob.glob(os.path.join(cache, "*", "train"))]
    if len(found) != 1:
        raise RuntimeError(f"expected one generated corpus in {cache}, found {found}")
    return found[0]


def within(metric: str, mine: float, theirs: float, test_rows: int) -> bool:
    """Issue #47's margins: accuracy within max(1 point, one test row) below
    scikit-learn's (or above it); RMSE at most 2% above."""
    if metric == "rmse":
        return mine <= 1.02 * theirs
    return mine >= theirs - max(0.01, 1.0 / test_rows) - 1e-9


def benchmark(names: list[str], seeds: list[int], ranks: int, root: str) -> list[dict]:
    rows = []
    for name in names:
        data = write_dataset(name, root)
        cache = os.path.join(root, f"cache-{name}")
        scores, seconds, model = [], [], "?"
        for seed in seeds:
            metric, value, took, model = mpidl_score(
                data, seed, ranks, os.path.join(root, f"run-{name}-{seed}"), cache)
            scores.append(value)
            seconds.append(took)
        data = data or generated_reviews(cache)
        _, theirs = sklearn_score(data)
        test_rows = len(ShardedDataset(os.path.join(data, "test")))
        mean = float(numpy.mean(scores))
        rows.append({"dataset": name, "metric": metric, "model": model,
                     "mpidl": scores, "mpidl_mean": mean, "sklearn": theirs,
                     "test_rows": test_rows, "seconds": seconds,
                     "within": within(metric, mean, theirs, test_rows)})
        print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    each = ", ".join(f"{v:.4g}" for v in r["mpidl"])
    return (f"| {r['dataset']} | {r['model']} | {r['metric']} | {r['mpidl_mean']:.4g} "
            f"({each}) | {r['sklearn']:.4g} | {r['test_rows']} | "
            f"{'yes' if r['within'] else 'NO'} | {numpy.median(r['seconds']):.0f} s |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", default=",".join(DATASETS),
                   help=f"comma-separated, of {', '.join(DATASETS)} (all)")
    p.add_argument("--seeds", default="0,1,2", help="training seeds (0,1,2)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of each mpidl train (2)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--keep", help="work in this folder and keep it (default: a temporary one)")
    args = p.parse_args()
    names = args.datasets.split(",")
    unknown = sorted(set(names) - set(DATASETS))
    if unknown:
        p.error(f"unknown datasets {unknown}; choose from {', '.join(DATASETS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"mpidl's defaults against scikit-learn on the same splits: seeds {seeds}, "
          f"{args.ranks} ranks\n\n| dataset | mpidl model | metric | mpidl mean (each seed) "
          "| scikit-learn | test rows | within #47's margin | mpidl train (median) |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        rows = benchmark(names, seeds, args.ranks, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="mpidl-baselines-") as root:
            rows = benchmark(names, seeds, args.ranks, root)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
