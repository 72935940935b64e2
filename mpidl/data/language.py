"""A generated language corpus with learnable structure, for the ``gpt`` task.

Sentences of a small probabilistic grammar over a vocabulary of ``vocab`` tokens: each
sentence picks a *topic*, which its first word announces, and every next word depends on
the word before and the topic (a Markov chain per topic, each word allowing only
``branching`` successors with Zipf-like weights), until an end-of-sentence token or the
length limit; shorter sentences are padded. A model must learn the transitions and keep
the topic in mind across the sentence to predict well: the uniform guess has perplexity
``vocab``, a bigram model that forgets the topic about ``topics x branching``, and the
generating chain itself about ``branching``, the floor (stored as the test split's
``best_perplexity``, so the gap a model leaves is visible).

Token ids: 0 ``<pad>``, 1 ``<unk>`` (unused, as text datasets have it), 2 ``<eos>``,
then ``w3``...; the dataset is written like a text dataset (``x`` int32 rows, a
vocabulary, ``pad_id`` 0), without labels.
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy

PAD, UNK, EOS = 0, 1, 2


def _chains(vocab: int, topics: int, branching: int, rng: numpy.random.Generator) -> tuple:
    """Per topic and word: ``branching`` successors and their probabilities."""
    words = numpy.arange(3, vocab)
    succ = rng.choice(words, size=(topics, vocab, branching))
    weights = 1.0 / numpy.arange(1, branching + 1)
    probs = numpy.broadcast_to(weights / weights.sum(), succ.shape).copy()
    return succ, probs


# The smallest corpus the chains make sense for: <pad>, <unk>, <eos> and five words; a
# topic word, a word and <eos> in a row.
MIN_VOCAB, MIN_SEQ_LEN = 8, 4


def generate_language(num_train: int, num_test: int, seq_len: int = 32, vocab: int = 64,
                      topics: int = 4, branching: int = 3, seed: int = 0
                      ) -> tuple[numpy.ndarray, numpy.ndarray, float]:
    """``(train ids, test ids, the chain's perplexity on the test split)``.

    Rows of ``seq_len`` int32 token ids, each a sentence then ``<pad>``; the same seed
    gives the same corpus. The perplexity is the generating chain's, per predicted
    token (every real token after the first two), the best any model can do.
    """
    if vocab < MIN_VOCAB or seq_len < MIN_SEQ_LEN:
        raise ValueError(f"generate_language needs vocab >= {MIN_VOCAB} and seq_len >= "
                         f"{MIN_SEQ_LEN}, got {vocab}, {seq_len}")
    rng = numpy.random.default_rng(seed)
    succ, probs = _chains(vocab, topics, branching, rng)
    n = num_train + num_test
    ids = numpy.full((n, seq_len), PAD, dtype=numpy.int32)
    topic = rng.integers(0, topics, n)
    # The first two words pick the topic's register: from a topic's own quarter of words.
    band = max(1, (vocab - 3) // topics)
    ids[:, 0] = 3 + topic * band + rng.integers(0, band, n)
    ids[:, 1] = 3 + rng.integers(0, vocab - 3, n)
    alive = numpy.ones(n, dtype=bool)
    nll, count = 0.0, 0
    test = numpy.arange(n) >= num_train
    weights = probs[0, 0]
    for t in range(2, seq_len):
        options = succ[topic, ids[:, t - 1]]             # (n, branching)
        pick = (rng.random(n)[:, None] > numpy.cumsum(weights)).sum(axis=1)
        pick = numpy.minimum(pick, options.shape[1] - 1)
        nxt = options[numpy.arange(n), pick]
        # A sentence ends with <eos>; after the first ~third of the row it becomes likelier.
        if t > seq_len // 3:
            stop = rng.random(n) < 0.08
            nxt = numpy.where(stop, EOS, nxt)
        chosen = alive & test
        if chosen.any():
            p = (weights[None, :] * (options == nxt[:, None])).sum(axis=1)
            if t > seq_len // 3:
                p = numpy.where(nxt == EOS, 0.08 + 0.92 * p, 0.92 * p)
            nll -= float(numpy.log(p[chosen]).sum())
            count += int(chosen.sum())
        ids[alive, t] = nxt[alive]
        alive &= nxt != EOS
    perplexity = math.exp(nll / max(count, 1))
    return ids[:num_train], ids[num_train:], perplexity


def vocabulary(vocab: int) -> list[str]:
    return ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(3, vocab)]


def write_language(out_dir: str, num_train: int, num_test: int, seq_len: int, vocab: int,
                   seed: int) -> dict[str, Any]:
    """Generate the corpus and write it as a dataset (``x`` only; ``pad_id`` 0)."""
    from mpidl.data.writer import write_shards

    train, test, perplexity = generate_language(num_train, num_test, seq_len, vocab,
                                                seed=seed)
    metadata = {"vocab": vocabulary(vocab), "pad_id": PAD, "length": seq_len,
                "source": "mpidl.data.language.generate_language", "seed": seed,
                "best_perplexity": perplexity}
    return write_shards(os.fspath(out_dir), {"x": train}, test_arrays={"x": test},
                        labels=None, metadata=metadata, shuffle=False)
