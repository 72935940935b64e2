"""The word tokenizer, the deterministic vocabulary and the id encoding."""

from __future__ import annotations

import random

import numpy
import pytest

from mpidl.data.text import PAD_ID, UNK_ID, build_vocab, encode, encode_labels, tokenize


def test_tokenizer_lowercases_keeps_contractions_and_sentiment_punctuation():
    assert tokenize("This movie isn't GOOD!!<br /><br />Really?") == [
        "this",
        "movie",
        "isn't",
        "good",
        "!",
        "!",
        "really",
        "?",
    ]


def test_tokenizer_drops_other_punctuation_and_handles_unicode():
    assert tokenize('A "caf\u00e9", well... it\u2019s 10/10; (really)') == [
        "a",
        "caf\u00e9",
        "well",
        "it's",
        "10",
        "10",
        "really",
    ]
    assert tokenize("snake_case") == ["snake", "case"]
    assert tokenize("") == []


def test_vocab_orders_by_count_then_alphabetically():
    vocab = build_vocab(["b a c", "b a", "b d"], max_size=10)
    assert vocab == ["<pad>", "<unk>", "b", "a", "c", "d"]


def test_vocab_is_independent_of_text_order_and_respects_limits():
    texts = ["the cat sat", "the dog ran", "a cat ran", "the end"]
    shuffled = texts[:]
    random.Random(1).shuffle(shuffled)
    assert build_vocab(texts, 20) == build_vocab(shuffled, 20)
    assert build_vocab(texts, max_size=4) == ["<pad>", "<unk>", "the", "cat"]
    assert build_vocab(texts, max_size=20, min_freq=2) == ["<pad>", "<unk>", "the", "cat", "ran"]


def test_encode_pads_truncates_and_marks_unknown_words():
    vocab = ["<pad>", "<unk>", "good", "bad"]
    ids = encode(["good bad good", "bad zzz", "good good good good good"], vocab, length=4)
    assert ids.dtype == numpy.int32 and ids.shape == (3, 4)
    numpy.testing.assert_array_equal(ids, [[2, 3, 2, PAD_ID], [3, UNK_ID, 0, 0], [2, 2, 2, 2]])


def test_encode_labels_sorts_classes_and_rejects_unknown_labels():
    y, classes = encode_labels(["positive", "negative", "positive"])
    assert classes == ["negative", "positive"]
    numpy.testing.assert_array_equal(y, [1, 0, 1])
    assert y.dtype == numpy.int64
    with pytest.raises(ValueError, match="'neutral' of sample 1"):
        encode_labels(["positive", "neutral"], classes=["negative", "positive"])


def test_integer_labels_are_ordered_as_numbers():
    # As strings "10" would sort before "2" and get id 1; an .npz of the same integers
    # gives them their own values' order.
    y, classes = encode_labels(["1", "2", "10", "9", "-1"])
    assert classes == ["-1", "1", "2", "9", "10"]
    assert y.tolist() == [1, 2, 4, 3, 0]
    assert encode_labels(["b", "10", "2"])[1] == ["10", "2", "b"]  # not all integers


@pytest.mark.parametrize("kwargs", [dict(max_size=1), dict(min_freq=0)])
def test_bad_vocab_limits_are_errors(kwargs):
    with pytest.raises(ValueError):
        build_vocab(["a"], **kwargs)
