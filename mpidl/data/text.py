"""Text to fixed-length int32 token ids: a regex word tokenizer and a vocabulary.

The tokenizer (``TOKENIZER`` records its settings in the manifest):

1. lowercases the text and turns HTML line breaks (``<br />``, common in IMDB reviews)
   and the typographic apostrophe (U+2019) into a space and ``'``;
2. keeps, in order, the matches of ``[^\\W_]+(?:'[^\\W_]+)*|[!?]``: words of Unicode letters
   and digits with their contractions kept whole (``don't``, ``isn't``, ``it's``, which
   keeps negation visible to a bag-of-words model), and ``!`` and ``?`` as tokens of their
   own (they carry sentiment); all other punctuation is dropped.

``"This movie isn't GOOD!!<br />"`` becomes ``["this", "movie", "isn't", "good", "!", "!"]``.
It is a single compiled ``re.findall`` per text: about a million words per second.

The vocabulary is deterministic: ids 0 and 1 are ``<pad>`` and ``<unk>``, then the words
of the training texts by decreasing count, ties broken alphabetically, so the same texts
always give the same ids whatever the order of files or hash seeds.

The length (tokens per sample) is chosen from the training texts by default
(:func:`choose_length`): long enough for 99% of them, a multiple of 8, at most 512.
"""

from __future__ import annotations

import collections
import math
import numbers
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy

PAD, UNK = "<pad>", "<unk>"
PAD_ID, UNK_ID = 0, 1

# The automatic length rule (``length="auto"``, ``mpidl shard --length auto``), recorded
# in the manifest with the choice. Why these numbers:
# - percentile 99, not 95: a longer length costs compute linearly (padding is masked, so
#   it costs no accuracy), while a cut text loses words the model never sees, often its
#   end, where a review's verdict tends to be. On the 3,000 UCI sentiment sentences
#   (mean 12 tokens) the 95th percentile (26 tokens -> length 32) cuts 62 texts (2.1%),
#   the 99th (36 -> 40) cuts 21 (0.7%), for 25% more positions.
# - a multiple of 8: int32 rows of whole 32-byte sectors, GPU tiles and vector widths
#   divide it, and near-equal datasets get the same shape (and reuse a checkpoint).
# - at least 8: even one-word texts keep a batch shape worth the per-step overhead.
# - at most 512: the transformer's attention scores are (B, heads, T, T) per layer,
#   kept for backward: at the reference batch 32 with 4 heads, T = 512 is 128 MiB per
#   layer in float32 and T = 2048 would be 2 GiB; 512 is also the usual limit of text
#   classifiers (BERT). Longer texts are cut, and the count is reported.
AUTO_LENGTH = {"percentile": 99, "multiple": 8, "min": 8, "cap": 512}

_BREAK_RE = re.compile(r"<br\s*/?>", re.IGNORECASE)
_TOKEN_RE = re.compile(r"[^\W_]+(?:'[^\W_]+)*|[!?]")

TOKENIZER = {
    "name": "mpidl.words",
    "version": 1,
    "lowercase": True,
    "pattern": _TOKEN_RE.pattern,
    "replace": {"<br />": " ", "\u2019": "'"},
}


def tokenize(text: str) -> list[str]:
    """Split ``text`` into lowercase word tokens (see the module docstring)."""
    text = _BREAK_RE.sub(" ", text.lower()).replace("\u2019", "'")
    return _TOKEN_RE.findall(text)


def build_vocab(texts: Iterable[str], max_size: int = 20000, min_freq: int = 1) -> list[str]:
    """The most frequent words of ``texts``, as a list whose index is the token id.

    Args:
        texts: the training texts (never the test texts: the vocabulary must not see them).
        max_size: the vocabulary size including ``<pad>`` and ``<unk>`` (at least 2).
        min_freq: words seen fewer times are left out (they encode as ``<unk>``).

    Returns:
        ``["<pad>", "<unk>", word, ...]``: by decreasing count, ties alphabetical.
    """
    return vocab_from_tokens((tokenize(t) for t in texts), max_size, min_freq)


def vocab_from_tokens(
    token_lists: Iterable[Sequence[str]], max_size: int = 20000, min_freq: int = 1
) -> list[str]:
    """:func:`build_vocab` on texts already split by :func:`tokenize`."""
    if max_size < 2:
        raise ValueError(f"max_size {max_size} must be >= 2 (room for <pad> and <unk>)")
    if min_freq < 1:
        raise ValueError(f"min_freq {min_freq} must be >= 1")
    counts: collections.Counter[str] = collections.Counter()
    for tokens in token_lists:
        counts.update(tokens)
    return vocab_from_counts(counts, max_size, min_freq)


def vocab_from_counts(counts: Mapping[str, int], max_size: int = 20000,
                      min_freq: int = 1) -> list[str]:
    """:func:`build_vocab` from word counts (parts' counts added up: the same vocabulary
    as one process's, since ties are broken by the word, never by the order seen)."""
    if max_size < 2:
        raise ValueError(f"max_size {max_size} must be >= 2 (room for <pad> and <unk>)")
    if min_freq < 1:
        raise ValueError(f"min_freq {min_freq} must be >= 1")
    counts = collections.Counter(counts)
    counts.pop(PAD, None)
    counts.pop(UNK, None)
    words = sorted((w for w, c in counts.items() if c >= min_freq), key=lambda w: (-counts[w], w))
    return [PAD, UNK] + words[: max_size - 2]


def vocab_index(vocab: Sequence[str] | Mapping[str, int]) -> Mapping[str, int]:
    """A ``word -> id`` mapping from a vocabulary list (a mapping is returned as is)."""
    if isinstance(vocab, Mapping):
        return vocab
    return {w: i for i, w in enumerate(vocab)}


def encode(
    texts: Iterable[str], vocab: Sequence[str] | Mapping[str, int], length: int
) -> numpy.ndarray:
    """Token ids of ``texts`` as an int32 array of shape ``(len(texts), length)``.

    Texts longer than ``length`` tokens keep their first ``length`` tokens; shorter ones
    are padded with ``<pad>`` (id 0) at the end. Unknown words become ``<unk>`` (id 1).
    """
    return encode_tokens((tokenize(t) for t in texts), vocab, length)


def encode_tokens(
    token_lists: Iterable[Sequence[str]], vocab: Sequence[str] | Mapping[str, int], length: int
) -> numpy.ndarray:
    """:func:`encode` on texts already split by :func:`tokenize`."""
    if length < 1:
        raise ValueError(f"length {length} must be >= 1")
    index = vocab_index(vocab)
    rows = [[index.get(w, UNK_ID) for w in tokens[:length]] for tokens in token_lists]
    out = numpy.zeros((len(rows), length), dtype=numpy.int32)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = ids
    return out


def covering(lengths: Sequence[int] | numpy.ndarray, percentile: float) -> int:
    """The fewest tokens that ``percentile`` % of the texts fit in (0 for no texts).

    The inverted-CDF percentile: always one of ``lengths``, and at least ``percentile`` %
    of them are at most it, so "99% of the texts have <= p99 tokens" holds exactly.
    """
    if len(lengths) == 0:
        return 0
    return int(numpy.percentile(numpy.asarray(lengths), percentile, method="inverted_cdf"))


def covering_counts(counts: Sequence[int] | numpy.ndarray, percentile: float) -> int:
    """:func:`covering` from a histogram (``counts[v]`` texts have ``v`` tokens), so parts
    of a split add their histograms and get exactly one process's answer."""
    counts = numpy.asarray(counts, numpy.int64)
    n = int(counts.sum())
    if n == 0:
        return 0
    # NumPy's inverted CDF takes sorted index ceil(n q) - 1 (q = percentile / 100, in
    # float64 as NumPy computes it): the smallest value with at least ceil(n q) texts at
    # or below it.
    need = max(1, math.ceil(n * (percentile / 100)))
    return int(numpy.searchsorted(numpy.cumsum(counts), need, side="left"))


def choose_length(lengths: Sequence[int] | numpy.ndarray) -> int:
    """The automatic length for texts of ``lengths`` tokens (the training texts').

    The smallest multiple of 8 that 99% of them fit in, at least 8 and at most 512
    (:data:`AUTO_LENGTH`; why these numbers: the comment above it).
    """
    return _rounded(covering(lengths, AUTO_LENGTH["percentile"]))


def _rounded(need: int) -> int:
    rule = AUTO_LENGTH
    rounded = -(-need // rule["multiple"]) * rule["multiple"]
    return int(min(rule["cap"], max(rule["min"], rounded)))


def check_length(length: int | str) -> int | str:
    """``length`` if it is ``"auto"`` or an integer >= 1; ValueError (naming it) if not."""
    if isinstance(length, str) and length == "auto" or (
            isinstance(length, numbers.Integral) and not isinstance(length, bool) and length >= 1):
        return length
    raise ValueError(f"length {length!r} must be 'auto' (chosen from the training texts) "
                     "or an integer >= 1 (tokens per sample)")


def resolve_length(length: int | str, lengths: Sequence[int] | numpy.ndarray
                   ) -> tuple[int, dict[str, Any]]:
    """The tokens per sample for ``length`` (``"auto"`` or a number) and the training
    texts' ``lengths``, and the record of the choice the manifest keeps::

        {"chosen": "auto",            # or "given": a number was passed
         "percentile_tokens": 36,     # 99% of the training texts have at most 36 tokens
         "auto": 40,                  # what "auto" chooses for them
         "percentile": 99, "multiple": 8, "min": 8, "cap": 512}   # the rule
    """
    check_length(length)
    return _resolve(length, covering(lengths, AUTO_LENGTH["percentile"]))


def resolve_length_counts(length: int | str, counts: Sequence[int] | numpy.ndarray
                          ) -> tuple[int, dict[str, Any]]:
    """:func:`resolve_length` from a histogram of the training texts' token lengths."""
    check_length(length)
    return _resolve(length, covering_counts(counts, AUTO_LENGTH["percentile"]))


def _resolve(length: int | str, need: int) -> tuple[int, dict[str, Any]]:
    auto = _rounded(need)
    choice = {"chosen": "auto" if length == "auto" else "given",
              "percentile_tokens": need, "auto": auto, **AUTO_LENGTH}
    return (auto if length == "auto" else int(length)), choice


def _is_integer(label: str) -> bool:
    try:
        int(label)
    except ValueError:
        return False
    return True


def default_classes(distinct: Iterable[str]) -> list[str]:
    """The class names of these distinct labels in id order: sorted, numerically when
    every one is an integer (see :func:`encode_labels`)."""
    distinct = set(distinct)
    numeric = all(_is_integer(c) for c in distinct)
    return sorted(distinct, key=(lambda c: (int(c), c)) if numeric else None)


def encode_labels(
    labels: Sequence[str], classes: Sequence[str] | None = None
) -> tuple[numpy.ndarray, list[str]]:
    """Map label strings to int64 class ids.

    Args:
        labels: one label per sample, e.g. ``"positive"``/``"negative"`` or ``"1"``/``"0"``.
        classes: the class names in id order; by default the sorted distinct labels
            (so ``negative`` is 0 and ``positive`` 1, ``"0"`` is 0 and ``"1"`` is 1),
            in numeric order when every label is an integer (``"2"`` before ``"10"``, as
            the same labels get from an ``.npz`` of integers).

    Raises:
        ValueError: a label is not one of ``classes``; names the label and its position.
    """
    if classes is None:
        classes = default_classes(set(labels))
    else:
        classes = list(classes)
    index = {c: i for i, c in enumerate(classes)}
    out = numpy.empty(len(labels), dtype=numpy.int64)
    for i, label in enumerate(labels):
        if label not in index:
            raise ValueError(f"label {label!r} of sample {i} is not one of the classes {classes}")
        out[i] = index[label]
    return out, classes
