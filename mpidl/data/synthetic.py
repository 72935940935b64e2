"""A deterministic corpus of English-like customer reviews: the built-in task's data.

The seed of the project is a startup that sorts 50,000 customer reviews into positive and
negative; ``generate_reviews()`` writes such a corpus in about a second, the same for the
same seed (and NumPy version), so ``mpidl train`` works with no download::

    from mpidl.data.synthetic import generate_reviews, write_reviews_csv
    train_x, train_y, test_x, test_y = generate_reviews(25000, 25000, seed=0)
    write_reviews_csv("reviews.csv", train_x, train_y)   # then: mpidl shard --from-csv ...

How a review is made. Each review is about one item of one domain (phones, blenders,
jackets, hotels, restaurants, flights) and is a run of 1 to ~24 short clauses:

* sentiment clauses: ``the battery was very good``, ``I would never recommend this
  blender``, ``it stopped working after a week``, ``really terrible service!``;
* negations flip them (``the staff was not friendly``, ``the room was never
  disappointing``, ``I don't like it``), intensifiers double them (``extremely``, ``so``);
* a clause that starts with ``but``/``however,`` counts twice: the writer's verdict;
* neutral clauses (``I bought this kettle as a gift``, ``the size was average``) add
  length and words that carry no sentiment.

A review's mood picks the polarity of each sentiment clause (90% agree with it), and the
label is then *computed from the text*: the sign of the summed clause scores (ties are
redrawn). So the label is a function of the words and their order, except for the label
noise (2% of each split, flipped equally in both classes so the classes stay balanced),
so 98% is the ceiling. A unigram bag of words cannot read negation or ``but``; measured
on the default 25,000/25,000 split (PyTorch references, AdamW, batch 64): logistic
regression on word counts 93%, the ``bow`` reference model 93% after one epoch, a bag
of words and hashed bigrams 94%, the ``transformer`` reference 91-92% after 1-3 epochs.
"""
from __future__ import annotations

import csv
import os
from typing import Sequence

import numpy

# -- the lexicon -----------------------------------------------------------------------

DOMAINS: dict[str, tuple[list[str], list[str]]] = {
    # domain: (items, aspects); every domain has the same number of each (see _Lexicon).
    "electronics": (
        ["phone", "laptop", "tablet", "headset", "speaker", "camera", "charger", "monitor"],
        ["battery", "screen", "sound", "software", "camera", "keyboard", "price", "design",
         "build quality", "charging cable"],
    ),
    "kitchen": (
        ["blender", "coffee maker", "toaster", "kettle", "frying pan", "knife set", "mixer",
         "microwave"],
        ["motor", "handle", "lid", "price", "design", "power cord", "coating", "blade",
         "control panel", "instruction manual"],
    ),
    "clothing": (
        ["jacket", "pair of shoes", "dress", "pair of jeans", "backpack", "sweater", "raincoat",
         "pair of boots"],
        ["fabric", "fit", "stitching", "color", "zipper", "sizing", "price", "material",
         "sole", "packaging"],
    ),
    "hotel": (
        ["hotel", "resort", "guest house", "hostel", "inn", "apartment", "lodge", "motel"],
        ["staff", "room", "breakfast", "bed", "location", "pool", "view", "wifi",
         "front desk", "bathroom"],
    ),
    "restaurant": (
        ["restaurant", "cafe", "bistro", "pizzeria", "diner", "steakhouse", "noodle bar",
         "bakery"],
        ["food", "service", "waiter", "pasta", "dessert", "coffee", "menu", "atmosphere",
         "portion size", "wine list"],
    ),
    "travel": (
        ["flight", "airline", "train ride", "bus tour", "ferry", "rental car", "cruise",
         "shuttle"],
        ["crew", "seat", "legroom", "luggage service", "check in", "schedule", "price",
         "boarding", "onboard meal", "customer support"],
    ),
}

POSITIVE_ADJ = [
    "good", "great", "excellent", "amazing", "wonderful", "fantastic", "perfect", "superb",
    "outstanding", "lovely", "pleasant", "solid", "reliable", "impressive", "brilliant",
    "comfortable", "friendly", "helpful", "clean", "fresh", "delicious", "sturdy", "beautiful",
    "smooth", "responsive", "generous", "cozy", "stylish", "durable", "spotless", "tasty",
    "accurate", "quiet", "elegant", "flawless", "satisfying", "convenient", "charming",
]
NEGATIVE_ADJ = [
    "bad", "terrible", "awful", "poor", "horrible", "disappointing", "mediocre", "useless",
    "flimsy", "broken", "slow", "rude", "dirty", "cheap", "noisy", "uncomfortable", "stale",
    "bland", "faulty", "defective", "overpriced", "unreliable", "sloppy", "greasy", "cramped",
    "shabby", "laggy", "dull", "weak", "fragile", "unhelpful", "annoying", "frustrating",
    "filthy", "clumsy", "inconsistent", "disgusting", "pathetic",
]
NEUTRAL_ADJ = [
    "okay", "average", "standard", "typical", "normal", "ordinary", "basic", "adequate",
    "new", "large", "small", "black", "white", "blue", "plain", "simple", "different",
]
POSITIVE_VERB = ["love", "like", "recommend", "enjoy", "adore", "appreciate", "trust", "prefer"]
NEGATIVE_VERB = ["hate", "regret", "dislike", "resent", "distrust", "despise", "loathe",
                 "detest"]
POSITIVE_PHRASE = [
    "works perfectly", "exceeded my expectations", "was worth every penny", "does the job well",
    "arrived on time", "made my day", "is a real bargain", "keeps getting better",
    "never lets me down", "feels like a luxury", "saved me so much time",
    "is exactly as described",
]
NEGATIVE_PHRASE = [
    "stopped working after a week", "broke after two days", "was a waste of money",
    "arrived damaged", "fell apart quickly", "never worked properly", "keeps crashing",
    "smells strange", "is a complete ripoff", "made me sick", "ruined our weekend",
    "was nothing like the photos",
]
INTENSIFIERS = ["very", "really", "extremely", "incredibly", "truly", "absolutely", "so",
                "super", "remarkably", "exceptionally"]
NEGATORS = ["not", "never", "hardly"]            # before an adjective: "was not good"
VERB_NEGATORS = ["do not", "don't", "did not", "didn't", "would not", "would never",
                 "cannot", "can't", "never"]     # before a verb: "I would never recommend"
COPULAS = ["is", "was", "seemed", "felt", "looked", "has been", "turned out to be"]
NEUTRAL_HEADS = [
    "I bought this", "we ordered the", "my wife picked the", "I got the", "we tried the",
    "I have used this", "my brother found the", "we booked the", "a friend suggested the",
    "I paid for the", "my parents chose the", "I compared this",
]
NEUTRAL_TAILS = [
    "last week", "as a gift", "two months ago", "online", "on a tuesday", "for work",
    "after reading the reviews", "for the holidays", "during a sale", "with a coupon",
    "for my birthday", "on short notice", "in the spring", "for a business trip",
    "at the mall", "on a whim", "for our anniversary", "before the move",
]
NEUTRAL_CLAUSES = [
    "it came in a cardboard box", "we stayed for three nights", "I use it every day",
    "the order number was on the receipt", "we went there on a sunday", "it is my second one",
    "my sister has the same model", "I read the manual first", "we paid by card",
    "the delivery took four days", "I live in a small town", "we were a group of six",
    "it comes in several colors", "I have owned it for a month", "this is my first review",
    "the store was on the corner", "we had a reservation at eight", "I compared a few options",
]
CONTRAST = ["but", "however,"]

# Clause kinds, their probabilities (per clause), and how many token slots they fill.
# A token is one vocabulary entry (possibly several words: "build quality").
_KINDS = ("copula", "verb", "phrase", "fragment", "neutral_head", "neutral_clause",
          "neutral_adj")
_KIND_P = numpy.array([0.30, 0.13, 0.08, 0.09, 0.16, 0.14, 0.10])
# The knobs of difficulty, tuned so that a unigram bag of words gets ~93% (>= 90% is the
# target of `mpidl train`) while negation and contrast still reward reading word order.
P_NEGATED = 0.10            # sentiment clauses said through a negation ("not bad")
P_INTENSE = 0.3             # of the others, intensified ("very good", counts double)
P_AGREE = 0.9               # sentiment clauses that agree with the review's mood
P_CONTRAST = 0.15           # later sentiment clauses opened by "but"/"however," (double)
_MIN_WORDS, _MAX_WORDS = 8, 120


class _Lexicon:
    """Every token as an id into one string array, and the id ranges of each word list."""

    def __init__(self) -> None:
        self.words: list[str] = [""]          # id 0 is the blank slot
        self.ranges: dict[str, numpy.ndarray] = {}
        for name, words in [
            ("pos_adj", POSITIVE_ADJ), ("neg_adj", NEGATIVE_ADJ), ("neu_adj", NEUTRAL_ADJ),
            ("pos_verb", POSITIVE_VERB), ("neg_verb", NEGATIVE_VERB),
            ("pos_phrase", POSITIVE_PHRASE), ("neg_phrase", NEGATIVE_PHRASE),
            ("int", INTENSIFIERS), ("neg", NEGATORS), ("vneg", VERB_NEGATORS),
            ("cop", COPULAS), ("head", NEUTRAL_HEADS), ("tail", NEUTRAL_TAILS),
            ("nclause", NEUTRAL_CLAUSES), ("conj", CONTRAST),
            ("subj", ["the", "this", "my", "our"]), ("obj", ["it", "this", "the"]),
            ("punct", [".", "!", ","]), ("fixed", ["I", "it", "overall,"]),
        ]:
            self.ranges[name] = self._add(words)
        items = [d[0] for d in DOMAINS.values()]
        aspects = [d[1] for d in DOMAINS.values()]
        # (n_domains, n_items) id tables, so that per-review domains index them directly.
        self.items = numpy.stack([self._add(row) for row in items])
        self.aspects = numpy.stack([self._add(row) for row in aspects])
        self.id = {w: i for i, w in enumerate(self.words)}
        self.array = numpy.array(self.words, dtype=object)
        # Sentence-initial forms ("The", "However,"): capitalised first letter.
        self.capital = numpy.array([w[:1].upper() + w[1:] for w in self.words], dtype=object)
        self.n_words = numpy.array(
            [0 if w in ("", ".", "!", ",") else len(w.split()) for w in self.words])

    def _add(self, words: Sequence[str]) -> numpy.ndarray:
        # A word in several lists ("the", "it", "price") gets one id, so that comparing
        # ids compares words.
        ids = []
        for w in words:
            if w not in self.words:
                self.words.append(w)
            ids.append(self.words.index(w))
        return numpy.array(ids)


_LEX: _Lexicon | None = None


def _lexicon() -> _Lexicon:
    global _LEX
    if _LEX is None:
        _LEX = _Lexicon()
    return _LEX


def _pick(rng: numpy.random.Generator, ids: numpy.ndarray, n: int) -> numpy.ndarray:
    return ids[rng.integers(len(ids), size=n)]


def _polar(rng, lex, sign: numpy.ndarray, pos: str, neg: str) -> numpy.ndarray:
    """Word ids of the positive list where ``sign > 0``, else of the negative list."""
    return numpy.where(sign > 0, _pick(rng, lex.ranges[pos], len(sign)),
                       _pick(rng, lex.ranges[neg], len(sign)))


def _clauses(rng, lex, kind, polarity, domain):
    """Token slots ``(n, 6)`` and scores ``(n,)`` of clauses of the given kinds.

    ``polarity`` (+1/-1) is the sentiment each clause must express; negated clauses use a
    word of the opposite polarity (``not good`` for -1), intensified ones score double.
    All slots are drawn for every clause (vectorised) and the kind selects the layout.
    """
    n = len(kind)
    r = lex.ranges
    tok = numpy.zeros((n, 6), dtype=numpy.int64)
    negated = rng.random(n) < P_NEGATED
    intense = (rng.random(n) < P_INTENSE) & ~negated
    item = lex.items[domain, rng.integers(lex.items.shape[1], size=n)]
    aspect = lex.aspects[domain, rng.integers(lex.aspects.shape[1], size=n)]
    word_sign = numpy.where(negated, -polarity, polarity)
    blank = numpy.zeros(n, dtype=numpy.int64)
    intens = numpy.where(intense, _pick(rng, r["int"], n), blank)
    score = numpy.where(intense, 2, 1) * polarity

    def put(mask, *cols):
        tok[mask] = numpy.stack([numpy.broadcast_to(c, (n,)) for c in cols], axis=1)[mask]

    # subject: "the battery", "this phone", "my kettle", or "it"
    use_item = rng.random(n) < 0.35
    # "my"/"our" go with items only ("my kettle", not "my staff")
    det = numpy.where(use_item, _pick(rng, r["subj"], n), _pick(rng, r["subj"][:2], n))
    subj_det = numpy.where(rng.random(n) < 0.15, lex.id["it"], det)
    subj_noun = numpy.where(subj_det == lex.id["it"], 0, numpy.where(use_item, item, aspect))
    m = kind == 0        # copula: the battery was (not|very) good
    put(m, subj_det, subj_noun, _pick(rng, r["cop"], n),
        numpy.where(negated, _pick(rng, r["neg"], n), blank), intens,
        _polar(rng, lex, word_sign, "pos_adj", "neg_adj"))
    m = kind == 1        # verb: I (really|would never) recommend this blender
    obj = _pick(rng, r["obj"], n)
    put(m, lex.id["I"],
        numpy.where(negated, _pick(rng, r["vneg"], n), intens),
        _polar(rng, lex, word_sign, "pos_verb", "neg_verb"),
        obj, numpy.where(obj == lex.id["it"], 0, item), blank)
    m = kind == 2        # phrase: it stopped working after a week (never negated)
    pronoun = rng.random(n) < 0.5
    put(m, numpy.where(pronoun, lex.id["it"], _pick(rng, r["subj"], n)),
        numpy.where(pronoun, 0, item),
        _polar(rng, lex, polarity, "pos_phrase", "neg_phrase"), blank, blank, blank)
    score[m] = 2 * polarity[m]
    m = kind == 3        # fragment: (overall,) really terrible service
    put(m, numpy.where(rng.random(n) < 0.3, lex.id["overall,"], blank), intens,
        _polar(rng, lex, polarity, "pos_adj", "neg_adj"), aspect, blank, blank)
    # neutral kinds: no sentiment, score 0
    m = kind == 4        # I bought this kettle as a gift
    put(m, _pick(rng, r["head"], n), item, _pick(rng, r["tail"], n), blank, blank, blank)
    m = kind == 5
    put(m, _pick(rng, r["nclause"], n), blank, blank, blank, blank, blank)
    m = kind == 6        # the size was average
    put(m, lex.id["the"], aspect, _pick(rng, r["cop"], n), _pick(rng, r["neu_adj"], n),
        blank, blank)
    return tok, numpy.where(kind >= 4, 0, score)


def _sample(rng: numpy.random.Generator, m: int):
    """``m`` candidate reviews: flat clause tokens, clause->review map, scores, word counts."""
    lex = _lexicon()
    mood = numpy.where(rng.random(m) < 0.5, 1, -1)
    domain = rng.integers(len(DOMAINS), size=m)
    # Log-normal clause counts give lengths from ~8 to ~120 words, most around 30-50.
    n_clauses = numpy.clip(numpy.rint(numpy.exp(rng.normal(numpy.log(6.0), 0.6, m))), 1, 24)
    n_clauses = n_clauses.astype(numpy.int64)
    review = numpy.repeat(numpy.arange(m), n_clauses)
    first = numpy.r_[0, numpy.cumsum(n_clauses)[:-1]]
    position = numpy.arange(len(review)) - first[review]
    c = len(review)
    kind = rng.choice(len(_KINDS), size=c, p=_KIND_P)
    polarity = numpy.where(rng.random(c) < P_AGREE, mood[review], -mood[review])
    body, score = _clauses(rng, lex, kind, polarity, domain[review])
    # A contrast ("but ...", "however, ...") opens some later sentiment clauses and
    # doubles their weight: the clause after "but" is the verdict.
    contrast = (position > 0) & (kind < 4) & (rng.random(c) < P_CONTRAST)
    conj = numpy.where(contrast, _pick(rng, lex.ranges["conj"], c), 0)
    score = score * numpy.where(contrast, 2, 1)
    # End punctuation: "," before a "but", "!" on some sentiment clauses, else ".".
    end = numpy.where((kind < 4) & (rng.random(c) < 0.15), lex.id["!"], lex.id["."])
    but_next = numpy.zeros(c, dtype=bool)
    but_next[:-1] = (conj[1:] == lex.id["but"]) & (position[1:] > 0)
    end = numpy.where(but_next, lex.id[","], end)
    tokens = numpy.concatenate([conj[:, None], body, end[:, None]], axis=1)   # (c, 8)
    total = numpy.bincount(review, weights=score, minlength=m)
    n_words = numpy.bincount(review, weights=lex.n_words[tokens].sum(axis=1), minlength=m)
    return tokens, review, total, n_words.astype(numpy.int64)


def _render(tokens: numpy.ndarray, review: numpy.ndarray, keep: numpy.ndarray) -> list[str]:
    """The text of the reviews ``keep`` (ids into the batch), in that order."""
    lex = _lexicon()
    order = numpy.argsort(keep)
    rank_of = numpy.full(review.max() + 1, -1)
    rank_of[keep] = numpy.arange(len(keep))
    rows = rank_of[review] >= 0
    tok, rev = tokens[rows], review[rows]
    flat = tok.ravel()
    flat_rev = numpy.repeat(rev, tok.shape[1])
    present = flat != 0
    flat, flat_rev = flat[present], flat_rev[present]
    # Capitalise the first token of a review and every token after "." or "!".
    start = numpy.ones(len(flat), dtype=bool)
    start[1:] = (flat_rev[1:] != flat_rev[:-1]) | numpy.isin(flat[:-1], [lex.id["."], lex.id["!"]])
    strings = numpy.where(start, lex.capital[flat], lex.array[flat]).tolist()
    bounds = numpy.r_[0, numpy.flatnonzero(flat_rev[1:] != flat_rev[:-1]) + 1, len(flat)]
    texts = [" ".join(strings[a:b]).replace(" .", ".").replace(" ,", ",").replace(" !", "!")
             for a, b in zip(bounds[:-1], bounds[1:])]
    # Reviews were rendered in batch order (sorted ids); put them in the order of `keep`.
    out = [""] * len(keep)
    for i, text in zip(order, texts):
        out[i] = text
    return out


def _split(rng: numpy.random.Generator, n: int,
           label_noise: float) -> tuple[list[str], numpy.ndarray]:
    """``n`` reviews, ``n // 2`` negative and ``n - n // 2`` positive, shuffled."""
    want = {0: n // 2, 1: n - n // 2}
    texts: list[str] = []
    labels: list[numpy.ndarray] = []
    while want[0] + want[1] > 0:
        m = int(1.25 * (want[0] + want[1])) + 64
        tokens, review, total, n_words = _sample(rng, m)
        ok = (total != 0) & (n_words >= _MIN_WORDS) & (n_words <= _MAX_WORDS)
        chosen = []
        for label, sign_ok in ((0, total < 0), (1, total > 0)):
            ids = numpy.flatnonzero(ok & sign_ok)[: want[label]]
            want[label] -= len(ids)
            chosen.append((ids, label))
        ids = numpy.concatenate([c[0] for c in chosen])
        texts += _render(tokens, review, ids)
        labels.append(numpy.concatenate([numpy.full(len(c[0]), c[1]) for c in chosen]))
    y = numpy.concatenate(labels or [numpy.zeros(0)]).astype(numpy.int64)
    # Label noise, the same count flipped in each class so the balance stays exact.
    flips = int(round(label_noise * n / 2))
    for label in (0, 1):
        idx = numpy.flatnonzero(y == label)
        y[rng.choice(idx, size=min(flips, len(idx)), replace=False)] = 1 - label
    perm = rng.permutation(n)
    return [texts[i] for i in perm], y[perm]


def generate_reviews(n_train: int = 25000, n_test: int = 25000, seed: int = 0,
                     label_noise: float = 0.02):
    """Generate the reviews corpus (see the module docstring for how).

    Args:
        n_train: number of training reviews (half negative, half positive; odd: one more
            positive).
        n_test: number of test reviews, drawn independently of the training ones.
        seed: the corpus seed; the same seed gives the same corpus.
        label_noise: fraction of each split whose label is flipped (0 to 0.5).

    Returns:
        ``(train_texts, train_labels, test_texts, test_labels)``: lists of str and int64
        arrays of 0 (negative) / 1 (positive).
    """
    for name, value in (("n_train", n_train), ("n_test", n_test)):
        if int(value) != value or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if not 0.0 <= label_noise <= 0.5:
        raise ValueError(f"label_noise must be in [0, 0.5], got {label_noise}")
    # Independent streams per split: the test set does not change when n_train does.
    train_seq, test_seq = numpy.random.SeedSequence(int(seed)).spawn(2)
    train_x, train_y = _split(numpy.random.default_rng(train_seq), int(n_train), label_noise)
    test_x, test_y = _split(numpy.random.default_rng(test_seq), int(n_test), label_noise)
    return train_x, train_y, test_x, test_y


def write_reviews_csv(path: str | os.PathLike, texts: Sequence[str], labels: Sequence[int]) -> str:
    """Write reviews in the common ``review,sentiment`` CSV layout (IMDB's Kaggle file).

    Labels 1/0 are written as ``positive``/``negative``, so the file goes through
    ``mpidl shard --from-csv PATH --text-col review --label-col sentiment``.

    Returns:
        The path written.
    """
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
    path = os.fspath(path)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["review", "sentiment"])
        for text, label in zip(texts, labels):
            if int(label) not in (0, 1):
                raise ValueError(f"label {label!r} of review {text[:40]!r} is not 0 or 1")
            writer.writerow([text, "positive" if int(label) == 1 else "negative"])
    return path
