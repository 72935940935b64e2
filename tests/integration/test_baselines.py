"""mpidl's defaults against scikit-learn's first try on the same splits, at 2 ranks (#47).

benchmarks/baselines.py on the 3,000 real review sentences and the breast-cancer table:
`mpidl shard` with its defaults, `mpiexec -n 2 mpidl train --data DIR` with no model
options (bow and mlp, chosen from the data), against `LogisticRegression(C=10)` on the
word counts of the same tokens and `StandardScaler` + `LogisticRegression()` on the same
rows. Measured (seed 0, 2 ranks): sentences 0.833 against 0.827, breast cancer 0.982
against 0.982. The margin is issue #47's: 1 point, or one test row where that is more.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(600)]

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "baselines.py")


def test_the_defaults_reach_scikit_learn_on_the_sentences_and_a_table(tmp_path):
    pytest.importorskip("sklearn")
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, BENCH, "--datasets", "sentences,breast_cancer",
                           "--seeds", "0", "--ranks", "2", "--json", str(out),
                           "--keep", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["dataset"]: r for r in json.loads(out.read_text())}
    assert (rows["sentences"]["model"], rows["breast_cancer"]["model"]) == ("bow", "mlp")
    for name, row in rows.items():
        assert row["within"], (name, row)
    # the same rows as mpidl's test split: 10% of 3,000 and of 569
    assert (rows["sentences"]["test_rows"], rows["breast_cancer"]["test_rows"]) == (300, 57)
