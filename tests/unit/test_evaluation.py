"""The one evaluation loop: every batch is scored, an empty share too, and zero rows add
nothing; every reference model and objective takes a batch of no rows."""
from __future__ import annotations

import math
import os

import numpy
import pytest

import mpidl.models as models
from mpidl.autograd import no_grad
from mpidl.comm.single import SingleCommunicator
from mpidl.data import ShardedDataset, write_shards
from mpidl.train.evaluation import evaluate, evaluation_loader
from mpidl.testing import run_ranks
from mpidl.train.objective import Classification, LanguageModel, Regression

# name -> (the model, one sample's input shape and dtype)
SMALL = {
    "mlp": (lambda: models.mlp(sizes=(3, 8, 4), seed=1), (3,), "float32"),
    "bow": (lambda: models.bow(vocab=50, dim=8, hidden=8, classes=4, pad_id=0, seed=1),
            (12,), "int32"),
    "transformer": (lambda: models.transformer(vocab=50, seq_len=12, dim=8, layers=1, heads=2,
                                               ffn=16, classes=4, pad_id=0, seed=1),
                    (12,), "int32"),
    "cnn": (lambda: models.cnn(in_shape=(1, 8, 8), outputs=4, seed=1), (1, 8, 8), "float32"),
    "cosmoflow": (lambda: models.cosmoflow(in_shape=(1, 8, 8, 8), outputs=4, seed=1),
                  (1, 8, 8, 8), "float32"),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_model_and_objective_scores_a_batch_of_no_rows_as_nothing(name, xp):
    build, shape, dtype = SMALL[name]
    model = build().to(xp).eval()
    x = xp.zeros((0, *shape), dtype=dtype)
    with no_grad():
        assert model(x).shape == (0, 4)
        labels = Classification().score(model, x, xp.zeros(0, dtype=xp.int64), xp)
        targets = Regression(outputs=4).score(model, x, xp.zeros((0, 4), xp.float32), xp)
    assert float(labels.loss) == 0 and labels.outputs.shape == (0, 4)
    assert float(targets.loss) == 0 and targets.outputs.shape == (0, 4)
    sums = Regression(outputs=4).eval_sums(model, None, xp)
    sums.add(targets)
    assert not sums.sums.any()


def test_a_language_model_scores_a_batch_of_no_rows_as_nothing(xp):
    model = models.gpt(vocab=23, seq_len=8, dim=6, layers=1, heads=2, seed=3).to(xp).eval()
    for pad_id in (None, 0):
        with no_grad():
            scores = LanguageModel(pad_id).score(model, xp.zeros((0, 9), xp.int64), None, xp)
        assert (float(scores.loss), scores.count, float(scores.correct)) == (0, 0, 0)


class RankOf3(SingleCommunicator):
    """Rank 1 of 3 as its sampler sees it; its reductions sum over itself alone."""

    rank, size = 1, 3


class Counted:
    """A classifier that notes the rows of every batch it is run on."""

    def __init__(self, model):
        self.model, self.rows = model, []
        self.training = True

    def __call__(self, x):
        self.rows.append(len(x))
        return self.model(x)

    def eval(self):
        self.training = False
        self.model.eval()

    def train(self, mode=True):
        self.training = mode
        self.model.train(mode)


def write(tmp_path, n):
    rng = numpy.random.default_rng(0)
    write_shards(str(tmp_path / "d"), {"x": rng.normal(size=(n, 3)).astype(numpy.float32),
                                       "y": rng.integers(0, 4, size=n)}, num_classes=4)
    return ShardedDataset(os.path.join(tmp_path, "d", "train"))


def test_a_rank_with_an_empty_share_still_runs_the_model_and_scores_nothing(tmp_path):
    # 5 samples in global batches of 4 at 3 ranks: rank 1 holds 1 sample of the first
    # batch and none of the second, where ZeRO-3's forward would gather from every rank.
    comm = RankOf3()
    model = Counted(models.mlp(sizes=(3, 8, 4), seed=1))
    loader = evaluation_loader(write(tmp_path, 5), comm, numpy, prefetch=0, global_batch=4)
    result = evaluate(Classification(), model, loader, comm)
    assert model.rows == [0, 1, 0]  # the width probe, then both batches
    assert result.scores.samples == 1 and result.record["test_accuracy"] in (0.0, 1.0)
    assert model.training  # given back in the mode it came in


def test_one_process_scores_every_sample_once(tmp_path):
    comm = SingleCommunicator()
    model = models.mlp(sizes=(3, 8, 4), seed=1)
    split = write(tmp_path, 9)
    result = evaluate(Classification(), model, evaluation_loader(
        split, comm, numpy, prefetch=0, global_batch=4), comm)
    model.eval()
    logits = model(split.read("x", numpy.arange(9))).data
    correct = int((logits.argmax(1) == split.read("y", numpy.arange(9))).sum())
    assert result.scores.samples == 9 and result.scores.correct == correct
    assert result.line.startswith("test loss ")


@pytest.mark.parametrize("objective", [Classification(), Regression()], ids=lambda o: type(o).__name__)
def test_a_diverged_model_is_scored_without_runtime_warnings_and_as_strict_json(
        tmp_path, objective):
    import json
    import warnings

    from mpidl.train.inference import _json

    comm = SingleCommunicator()
    rng = numpy.random.default_rng(0)
    y = rng.integers(0, 4, size=9) if isinstance(objective, Classification) else \
        rng.normal(size=9).astype(numpy.float32)
    write_shards(str(tmp_path / "d"), {"x": rng.normal(size=(9, 3)).astype(numpy.float32),
                                       "y": y}, **({"num_classes": 4} if y.dtype.kind == "i"
                                                   else {}))
    split = ShardedDataset(os.path.join(tmp_path, "d", "train"))
    model = models.mlp(sizes=(3, 8, 4 if y.dtype.kind == "i" else 1), seed=1)
    for p in model.parameters():
        p.data[...] = 3e37  # as after an update that overflowed: the logits are inf - inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's RuntimeWarnings would raise here
        result = evaluate(objective, model, evaluation_loader(split, comm, numpy, prefetch=0),
                          comm)
    record = json.loads(_json(result.record), parse_constant=pytest.fail)
    assert record["test_loss"] is None  # not finite


def regression_batch(predictions, targets):
    from mpidl.train.objective_base import BatchScores

    p, t = numpy.asarray(predictions, numpy.float64), numpy.asarray(targets, numpy.float64)
    return BatchScores(numpy.float64(((p - t) ** 2).sum()), p, t)


# Two outputs over four rows, worked by hand. Output 0: targets 0, 2, 0, 2 (mean 1,
# variance 1), errors +1, -1, +1, -1: MSE 1, MAE 1 (the signed errors sum to 0), R² 0.
# Output 1: targets 1, 3, 5, 7 (mean 4, variance 5), errors +2, -2, 0, 0: MSE 2, MAE 1,
# R² 1 - 2/5 = 0.6. The loss (squared errors in standard units, scale 1): 4 + 8 over 8.
TARGETS = [[0, 1], [2, 3], [0, 5], [2, 7]]
PREDICTIONS = [[1, 3], [1, 1], [1, 5], [1, 7]]


def test_regression_scores_are_the_hand_worked_mse_mae_and_r2_of_each_output():
    sums = Regression(outputs=2).eval_sums(None, None, numpy)
    sums.add(regression_batch(PREDICTIONS[:3], TARGETS[:3]))  # two batches add up
    sums.add(regression_batch(PREDICTIONS[3:], TARGETS[3:]))
    result = sums.reduce(SingleCommunicator())
    record = result.record
    assert record["test_mse_per_output"] == pytest.approx([1.0, 2.0])
    assert record["test_mae_per_output"] == pytest.approx([1.0, 1.0])
    assert record["test_r2_per_output"] == pytest.approx([0.0, 0.6])
    assert (record["test_mse"], record["test_mae"], record["test_r2"]) == \
        pytest.approx((1.5, 1.0, 0.3))
    assert record["test_loss"] == pytest.approx(12 / 8)
    assert result.line == "test loss 1.5000 (standard units), MSE 1.5, MAE 1, R² 0.3000"


def test_regression_scores_over_uneven_thread_ranks_equal_one_process():
    # 4 rows over 3 ranks: 2, 2 and none (a rank with an empty share adds nothing).
    def body(comm):
        sums = Regression(outputs=2).eval_sums(None, None, numpy)
        rows = [slice(0, 2), slice(2, 4), slice(4, 4)][comm.rank]
        sums.add(regression_batch(numpy.reshape(PREDICTIONS[rows], (-1, 2)),
                                  numpy.reshape(TARGETS[rows], (-1, 2))))
        return sums.reduce(comm).record

    for record in run_ranks(3, body):
        assert record["test_mae_per_output"] == pytest.approx([1.0, 1.0])
        assert record["test_mse_per_output"] == pytest.approx([1.0, 2.0])
        assert record["test_r2_per_output"] == pytest.approx([0.0, 0.6])


def test_language_model_scores_are_per_real_target_over_every_batch_and_rank():
    # Two batches (loss sums 3.0 and 1.5 over 4 and 2 real targets, 3 and 1 hits) on one
    # rank, none on the others: loss 4.5 / 6 = 0.75 a target, perplexity e^0.75,
    # next-token accuracy 4 / 6, 6 targets.
    from mpidl.train.objective_base import BatchScores

    def body(comm):
        sums = LanguageModel(pad_id=0).eval_sums(None, None, numpy)
        if comm.rank == comm.size - 1:
            sums.add(BatchScores(numpy.float64(3.0), count=4, correct=numpy.int64(3)))
            sums.add(BatchScores(numpy.float64(1.5), count=2, correct=numpy.int64(1)))
        return sums.reduce(comm)

    for size in (1, 3):
        for result in run_ranks(size, body):
            assert result.record == pytest.approx({
                "test_loss": 0.75, "test_perplexity": math.exp(0.75), "test_targets": 6,
                "test_accuracy": 4 / 6})
            assert result.line == (f"test loss 0.7500, perplexity {math.exp(0.75):.3f}, "
                                   "next-token accuracy 0.6667")


def test_an_output_whose_targets_are_constant_has_no_r2_and_the_mean_skips_it():
    # Output 1's targets are all 5: no variance, R² undefined (null), not -inf or 1;
    # test_r2 is output 0's alone (0, as in TARGETS); MSE and MAE are still defined.
    sums = Regression(outputs=2).eval_sums(None, None, numpy)
    sums.add(regression_batch([[1, 5], [1, 6], [1, 5], [1, 3]], [[0, 5], [2, 5], [0, 5], [2, 5]]))
    record = sums.reduce(SingleCommunicator()).record
    assert record["test_r2_per_output"][0] == pytest.approx(0.0)
    assert record["test_r2_per_output"][1] is None and record["test_r2"] == pytest.approx(0.0)
    assert record["test_mae_per_output"] == pytest.approx([1.0, 0.75])
    assert record["test_mse_per_output"] == pytest.approx([1.0, 1.25])
    # No output with variance: no R² at all.
    flat = Regression(outputs=1).eval_sums(None, None, numpy)
    flat.add(regression_batch([[1], [2]], [[3], [3]]))
    assert flat.reduce(SingleCommunicator()).record["test_r2"] is None
