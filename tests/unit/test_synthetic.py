"""The generated reviews corpus: deterministic, balanced, English-like, learnable."""
from __future__ import annotations

import csv
import re

import numpy
import pytest

from mpidl.data.synthetic import generate_reviews, write_reviews_csv

_WORD = re.compile(r"[a-z']+|[!?]")


@pytest.fixture(scope="module")
def corpus():
    return generate_reviews(4000, 2000, seed=3)


def test_same_seed_same_corpus_other_seed_other_corpus(corpus):
    again = generate_reviews(4000, 2000, seed=3)
    assert again[0] == corpus[0] and again[2] == corpus[2]
    numpy.testing.assert_array_equal(again[1], corpus[1])
    numpy.testing.assert_array_equal(again[3], corpus[3])
    other = generate_reviews(4000, 2000, seed=4)
    assert other[0] != corpus[0]


def test_test_split_does_not_depend_on_the_train_size(corpus):
    smaller = generate_reviews(10, 2000, seed=3)
    assert smaller[2] == corpus[2]


def test_sizes_and_exact_balance(corpus):
    train_x, train_y, test_x, test_y = corpus
    assert len(train_x) == len(train_y) == 4000 and len(test_x) == len(test_y) == 2000
    assert train_y.dtype == numpy.int64 and set(numpy.unique(train_y)) == {0, 1}
    assert train_y.sum() == 2000 and test_y.sum() == 1000
    x, y, _, _ = generate_reviews(7, 0, seed=0)
    assert len(x) == 7 and y.sum() == 4 and generate_reviews(0, 0)[0] == []


def test_reviews_are_english_like_with_varied_lengths(corpus):
    texts = corpus[0]
    lengths = numpy.array([len(t.split()) for t in texts])
    assert lengths.min() >= 8 and lengths.max() <= 120
    assert lengths.max() - lengths.min() > 60
    joined = " ".join(texts).lower()
    for word in (" not ", " very ", " but ", "i ", " never ", "."):
        assert word in joined
    assert all(t[0].isupper() and t[-1] in ".!" for t in texts[:200])
    assert len(set(texts)) > 0.95 * len(texts)


def test_label_noise_flips_the_same_count_in_each_class():
    _, clean, _, _ = generate_reviews(2000, 0, seed=1, label_noise=0.0)
    _, noisy, _, _ = generate_reviews(2000, 0, seed=1, label_noise=0.1)
    assert noisy.sum() == clean.sum() == 1000
    with pytest.raises(ValueError, match="label_noise"):
        generate_reviews(10, 10, label_noise=0.7)


def _bag(texts, vocab):
    """Token ids of all texts, flat, and the text each token belongs to (a sparse bag)."""
    ids, doc = [], []
    for i, text in enumerate(texts):
        words = [vocab[w] for w in _WORD.findall(text.lower()) if w in vocab]
        ids += words
        doc += [i] * len(words)
    return numpy.array(ids), numpy.array(doc)


def test_a_bag_of_words_logistic_regression_learns_it(corpus):
    # A unigram model cannot read negation or "but"; it still gets ~92% (the corpus is
    # tuned so); a model that reads word order can approach the 98% noise ceiling.
    # Sparse logistic regression on word counts by full-batch gradient descent with
    # momentum: bincount instead of BLAS keeps it fast on a busy machine.
    train_x, train_y, test_x, test_y = corpus
    words = sorted({w for t in train_x for w in _WORD.findall(t.lower())})
    vocab = {w: i for i, w in enumerate(words)}
    (ids, doc), (test_ids, test_doc) = _bag(train_x, vocab), _bag(test_x, vocab)
    n, v = len(train_x), len(vocab)
    w, b, m = numpy.zeros(v), 0.0, numpy.zeros(v)
    for _ in range(100):
        z = numpy.bincount(doc, weights=w[ids], minlength=n) + b
        g = 1.0 / (1.0 + numpy.exp(-z)) - train_y                # dloss/dz, (n,)
        m = 0.9 * m + numpy.bincount(ids, weights=g[doc], minlength=v) / n
        w -= 0.1 * m
        b -= 0.1 * g.mean()
    z = numpy.bincount(test_doc, weights=w[test_ids], minlength=len(test_x)) + b
    accuracy = ((z > 0) == test_y).mean()
    assert accuracy > 0.85, accuracy


def test_csv_has_the_review_sentiment_layout(tmp_path, corpus):
    texts, labels = corpus[0][:50], corpus[1][:50]
    path = write_reviews_csv(tmp_path / "reviews.csv", texts, labels)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["review", "sentiment"]
    assert [r[0] for r in rows[1:]] == texts
    assert [r[1] for r in rows[1:]] == ["positive" if y else "negative" for y in labels]
    with pytest.raises(ValueError, match="labels"):
        write_reviews_csv(tmp_path / "x.csv", texts, labels[:3])
