"""mpidl predict's input checks: no empty or blank input, no NaN in, no NaN out."""
from __future__ import annotations

import numpy
import pytest

from mpidl.comm import SingleCommunicator
from mpidl.data import DataError
from mpidl.train import predict as P
from mpidl.train import predict_inputs as reading


def test_an_empty_file_is_refused_as_no_input(tmp_path):
    (tmp_path / "in.txt").write_text("")
    with pytest.raises(DataError, match="in.txt is empty: no input to classify"):
        reading._read_lines(str(tmp_path / "in.txt"))


def test_a_blank_line_is_refused_naming_the_first_and_the_count(tmp_path):
    (tmp_path / "in.txt").write_text("good\n \nbad\n\n")
    with pytest.raises(DataError, match=r"line 2 is blank \(2 blank line\(s\) of 4\)"):
        reading._read_lines(str(tmp_path / "in.txt"))


def test_lines_without_blanks_are_read_without_their_line_ends(tmp_path):
    (tmp_path / "in.txt").write_bytes(b"good\r\nbad\n")
    assert reading._read_lines(str(tmp_path / "in.txt")) == ["good", "bad"]


@pytest.mark.parametrize("value, words", [
    (numpy.nan, "row 1 of 'x' holds nan at column 2 (1 of 3 rows"),
    (-numpy.inf, "row 1 of 'x' holds -inf at column 2"),
    (1e39, "row 1 of 'x' holds 1e+39, beyond float32's range, at column 2"),
])
def test_a_row_that_is_not_finite_as_the_model_reads_it_is_named(value, words):
    rows = numpy.zeros((3, 4))
    rows[1, 2] = value
    with numpy.errstate(over="ignore"):
        cast = rows.astype(numpy.float32)
    with pytest.raises(DataError, match="replace them") as info:
        reading._check_finite("rows.npz", "x", rows, cast, numpy.dtype(numpy.float32))
    assert words in str(info.value)


class _Scores:
    """A model whose score for input i is row i of a fixed table."""

    def __init__(self, table):
        self.table, self.seen = table, 0

    def __call__(self, x):
        out = self.table[self.seen:self.seen + len(x)]
        self.seen += len(x)
        return type("T", (), {"data": out})()


def test_scores_that_are_not_finite_stop_predict_before_their_round_is_written():
    table = numpy.array([[0.0, 1.0], [numpy.inf, 0.0], [1.0, 0.0]], numpy.float32)
    written = []
    inputs = reading.ArrayInputs(numpy.full((3, 4), 3e38, numpy.float32))
    with pytest.raises(DataError, match=r"input 1, row 1 \(largest \|value\| 3e\+38\): the "
                                        "model's scores for it are not finite"):
        P.predict(_Scores(table), inputs, SingleCommunicator(), numpy, 2,
                  lambda start, logits: written.append(start) or True)
    assert written == []  # the round holding input 1 wrote nothing


def test_json_output_never_holds_a_bare_nan():
    with pytest.raises(ValueError):
        P.format_values(0, numpy.array([numpy.nan]), None, as_json=True)
    assert P.format_values(0, numpy.array([0.5]), ["t"], as_json=True) == \
        '{"index": 0, "prediction": [0.5], "targets": ["t"]}'


class _Echo:
    """A model whose scores of a row are the row itself: which inputs it was given."""

    def __call__(self, x):
        return type("T", (), {"data": numpy.asarray(x, numpy.float32)})()


@pytest.mark.parametrize("n, ranks", [(10, 3), (7, 2), (2, 3), (5, 1)])
def test_every_input_is_scored_once_and_written_in_order_when_rounds_split_unevenly(n, ranks):
    # Rounds of 2 a rank: 10 inputs at 3 ranks are rounds of 6 (2, 2, 2) and 4 (2, 1, 1),
    # 2 at 3 ranks one round (1, 1, 0); every rank takes the rows after the ranks before it.
    from mpidl.testing import run_ranks

    inputs = reading.ArrayInputs(numpy.arange(n * 2, dtype=numpy.float32).reshape(n, 2))

    def body(comm):
        written = []
        P.predict(_Echo(), inputs, comm, numpy, 2,
                  lambda start, logits: written.append((start, logits.copy())) or True)
        return written

    results = run_ranks(ranks, body)
    assert all(w == [] for w in results[1:])  # rank 0 alone writes
    starts = [start for start, _ in results[0]]
    assert starts == list(range(0, n, 2 * ranks))
    numpy.testing.assert_array_equal(numpy.concatenate([s for _, s in results[0]]),
                                     inputs.array)
