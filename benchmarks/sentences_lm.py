"""The 3,000 real review sentences of ../shared/data as a language-model dataset, for
trying ``mpidl train gpt`` (pipeline, precision, recomputation) on real text.

Word tokens (``mpidl.data.text.tokenize``), an ``<eos>`` after each sentence, words
seen once mapped to ``<unk>``; the token stream cut into windows of T + 1 tokens, every
10th window the test split. Not part of CI. From the repository root::

    .venv/bin/python benchmarks/sentences_lm.py ../shared/data/sentiment-sentences /tmp/lm
    .venv/bin/mpidl train gpt --data=/tmp/lm --epochs=15 --global-batch=32 \\
        --model.dim=64 --model.layers=4 --model.heads=4
    mpiexec -n 2 .venv/bin/mpidl train gpt --data=/tmp/lm --epochs=15 --global-batch=32 \\
        --model.dim=64 --model.layers=4 --model.heads=4 --pipeline-parallel=2 \\
        --microbatches=4 --precision=bf16 --recompute=selective

Results: docs/model-parallel.md ("On real text").
"""
from __future__ import annotations

import argparse
import collections
import glob
import os

import numpy

from mpidl.data.text import tokenize
from mpidl.data.writer import write_shards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="a folder of TSV files: a sentence, a tab, a label")
    p.add_argument("out", help="the dataset folder to write")
    p.add_argument("--length", type=int, default=32, help="tokens a window predicts (T)")
    args = p.parse_args()
    words: list[str] = []
    for path in sorted(glob.glob(os.path.join(args.source, "*.tsv"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                words.extend(tokenize(line.rsplit("\t", 1)[0]) + ["<eos>"])
    counts = collections.Counter(w for w in words if w != "<eos>")
    vocab = ["<pad>", "<unk>", "<eos>"] + [w for w, c in counts.most_common() if c >= 2]
    index = {w: i for i, w in enumerate(vocab)}
    ids = numpy.array([index.get(w, 1) for w in words], dtype=numpy.int32)
    t = args.length
    windows = numpy.stack([ids[i * t:i * t + t + 1] for i in range(len(ids) // t - 1)])
    test, train = windows[::10], numpy.delete(windows, numpy.s_[::10], axis=0)
    print(f"{len(words)} tokens, vocabulary {len(vocab)}, {len(train)} train and "
          f"{len(test)} test windows of {t + 1}")
    write_shards(args.out, {"x": train}, test_arrays={"x": test}, labels=None,
                 metadata={"vocab": vocab, "pad_id": 0, "length": t,
                           "source": f"{args.source} (benchmarks/sentences_lm.py)"},
                 shuffle=True, seed=0)


if __name__ == "__main__":
    main()
