"""The scores of an evaluation from its counts, against values worked out by hand."""
from __future__ import annotations

import math

import numpy
import pytest

from mpidl.autograd import Tensor
from mpidl.data import evaluate
from mpidl.data.evaluate import ClassCounts, ExactAccuracy, predicted_classes


def scores_of(true, predicted, num_classes):
    counts = ClassCounts(num_classes)
    counts.update(numpy.array(predicted), numpy.array(true))
    return counts.scores(loss_sum=float(len(true)))


# true 0: predicted 0, 0, 1; true 1: 1, 0; true 2: 2, 2, 2, 0, 0.
TRUE = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
PRED = [0, 0, 1, 1, 0, 2, 2, 2, 0, 0]


def test_confusion_matrix_has_true_classes_as_rows_and_predictions_as_columns():
    s = scores_of(TRUE, PRED, 3)
    numpy.testing.assert_array_equal(s.confusion, [[2, 1, 0], [1, 1, 0], [2, 0, 3]])
    assert s.confusion.dtype == numpy.int64
    numpy.testing.assert_array_equal(s.true_counts, s.confusion.sum(axis=1))
    numpy.testing.assert_array_equal(s.predicted_counts, s.confusion.sum(axis=0))
    numpy.testing.assert_array_equal(s.correct_counts, numpy.diag(s.confusion))


def test_accuracy_recall_and_macro_f1_by_hand():
    s = scores_of(TRUE, PRED, 3)
    assert (s.samples, s.correct) == (10, 6)
    assert s.accuracy == pytest.approx(0.6)
    numpy.testing.assert_allclose(s.recall, [2 / 3, 1 / 2, 3 / 5])
    # F1 = 2 TP / (samples of c + predictions of c): 4/8, 2/4, 6/8.
    numpy.testing.assert_allclose(s.f1, [0.5, 0.5, 0.75])
    assert s.macro_f1 == pytest.approx((0.5 + 0.5 + 0.75) / 3)
    assert s.loss == pytest.approx(1.0)


def test_majority_accuracy_is_the_share_of_the_most_frequent_true_class():
    s = scores_of(TRUE, PRED, 3)
    assert s.majority_class == 2 and s.majority_accuracy == pytest.approx(0.5)
    imbalanced = scores_of([1] * 9 + [0], [1] * 10, 2)
    assert imbalanced.majority_accuracy == pytest.approx(0.9)
    assert imbalanced.accuracy == pytest.approx(0.9)  # "always 1" is exactly the floor


def test_a_class_with_samples_that_is_never_predicted_has_f1_zero():
    # true 0: 0, 0; true 1: 1, 1, 0; true 2: 0 (never predicted).
    s = scores_of([0, 0, 1, 1, 1, 2], [0, 0, 1, 1, 0, 0], 3)
    numpy.testing.assert_allclose(s.f1, [4 / 6, 4 / 5, 0.0])
    assert s.recall[2] == 0.0
    assert s.macro_f1 == pytest.approx((4 / 6 + 4 / 5 + 0.0) / 3)  # scikit-learn: 0.48889
    assert s.majority_class == 1 and s.majority_accuracy == pytest.approx(0.5)


def test_a_predicted_class_absent_from_the_labels_counts_with_f1_zero_and_no_recall():
    s = scores_of([0, 0], [0, 1], 2)
    numpy.testing.assert_allclose(s.f1, [2 / 3, 0.0])
    assert s.macro_f1 == pytest.approx(1 / 3)
    assert math.isnan(s.recall[1])


def test_a_class_neither_present_nor_predicted_is_left_out_of_macro_f1():
    s = scores_of(TRUE, PRED, 4)
    assert math.isnan(s.f1[3]) and math.isnan(s.recall[3])
    assert s.macro_f1 == pytest.approx((0.5 + 0.5 + 0.75) / 3)
    record = s.as_record()
    assert record["recall"][3] is None and record["recall"][0] == pytest.approx(2 / 3)
    assert set(record) == {"test_loss", "test_accuracy", "majority_accuracy", "macro_f1",
                           "recall"}
    # The record's values, not only its keys: what metrics.jsonl and mpidl eval --json show.
    assert record["macro_f1"] == pytest.approx((0.5 + 0.5 + 0.75) / 3)
    assert (record["test_accuracy"], record["majority_accuracy"], record["test_loss"]) == \
        pytest.approx((0.6, 0.5, 1.0))
    assert record["recall"][:3] == pytest.approx([2 / 3, 1 / 2, 3 / 5])


def test_no_samples_give_undefined_scores_recorded_as_null():
    s = ClassCounts(2).scores(loss_sum=0.0)
    assert math.isnan(s.accuracy) and math.isnan(s.macro_f1) and s.majority_class is None
    assert s.as_record() == {"test_loss": None, "test_accuracy": None,
                             "majority_accuracy": None, "macro_f1": None,
                             "recall": [None, None]}


def test_scores_take_the_argmax_and_tensors_and_agree_with_exact_accuracy():
    logits = numpy.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.5, 0.5]])
    target = numpy.array([1, 1, 1, 0])
    counts = ClassCounts(2)
    counts.update(Tensor(logits), target)
    acc = ExactAccuracy()
    acc.update(logits, target)
    assert counts.scores().accuracy == acc.compute() == pytest.approx(0.75)
    assert predicted_classes(logits).tolist() == [1, 0, 1, 0]  # a tie goes to the first


def test_batches_add_up():
    counts = ClassCounts(3)
    for a, b in ((0, 4), (4, 4), (4, 10)):  # an empty batch in the middle
        counts.update(numpy.array(PRED[a:b]), numpy.array(TRUE[a:b]))
    numpy.testing.assert_array_equal(counts.scores().confusion, scores_of(TRUE, PRED, 3).confusion)


def test_labels_or_scores_beyond_the_classes_are_refused():
    counts = ClassCounts(2)
    with pytest.raises(ValueError, match="a label of 2 is outside the 2 classes"):
        counts.update(numpy.array([0, 1]), numpy.array([0, 2]))
    with pytest.raises(ValueError, match="scores of 3 classes, but the counts are of 2"):
        counts.update(numpy.zeros((1, 3)), numpy.array([0]))


def test_many_classes_keep_the_counts_but_not_the_matrix(monkeypatch):
    monkeypatch.setattr(evaluate, "MAX_CONFUSION_CLASSES", 2)
    s = scores_of(TRUE, PRED, 3)
    assert s.confusion is None
    assert s.macro_f1 == pytest.approx((0.5 + 0.5 + 0.75) / 3)
    numpy.testing.assert_array_equal(s.true_counts, [3, 2, 5])


def test_mpidl_eval_reports_the_hand_worked_scores_and_the_confusion_matrix_by_class():
    import json
    import types

    from mpidl.train.inference import report

    s, names = scores_of(TRUE, PRED, 3), ["neg", "neu", "pos"]
    state = types.SimpleNamespace(path="ck.h5", step=7)
    assert report(s, names, state, as_json=False) == "\n".join([
        "checkpoint: ck.h5 (step 7)",
        "test samples: 10",
        "test loss: 1.0000",
        "test accuracy: 0.6000",
        "macro-F1: 0.5833",                                  # (0.5 + 0.5 + 0.75) / 3
        "majority-class accuracy: 0.5000 (always 'pos')",
        "",
        "confusion matrix (rows: true class, columns: predicted class):",
        "true \\ predicted  neg  neu  pos  recall",
        "----------------  ---  ---  ---  ------",
        "neg                 2    1    0  0.6667",
        "neu                 1    1    0  0.5000",
        "pos                 2    0    3  0.6000"])
    doc = json.loads(report(s, names, state, as_json=True))
    assert doc == {"checkpoint": "ck.h5", "step": 7, "test_samples": 10, "classes": names,
                   "test_loss": 1.0, "test_accuracy": pytest.approx(0.6),
                   "majority_accuracy": 0.5, "macro_f1": pytest.approx(1.75 / 3),
                   "recall": pytest.approx([2 / 3, 0.5, 0.6]),
                   "confusion": [[2, 1, 0], [1, 1, 0], [2, 0, 3]]}
