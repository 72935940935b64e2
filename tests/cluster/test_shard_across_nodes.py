"""`mpiexec mpidl shard` across virtual nodes writes one process's dataset, and
`mpidl shard --verify` there gives one verdict.

A CSV of 300 review texts (quoted records with newlines inside) and an `.npz` of 157
float32 rows, converted by one rank on each of 2 and 3 nodes into a folder all nodes
share (this machine's filesystem): the same samples per split, vocabulary, classes,
labels and statistics as one process's conversion (tests/mpi/test_shard_mpi.py's
comparison, :func:`mpidl.testing.datasets.dataset_differences`). The ranks cut the CSV
at record boundaries, gather the word counts over TCP and publish one numbered set of
shards. `--verify` on 2 and 3 nodes: every node's rank exits with the same status,
and rank 0 alone says it (OK per split, or the bad shard's name).

Cost: 8 launches of 1.2-1.6 s and two small conversions in the test process: 12 s for
the 6 tests, the cluster's bring-up and teardown included (2 cores, load 1.2-2); 18 s
through `tests/run.py --cluster -- -k test_shard_across_nodes` beside another job's tests.
"""
from __future__ import annotations

import os
import shutil

import pytest

from mpidl.comm import SingleCommunicator
from mpidl.data import read_manifest
from mpidl.data.command import main as shard_main
from mpidl.testing.datasets import dataset_differences, sharding_inputs

pytestmark = [pytest.mark.timeout(300)]

KINDS = ("csv", "npz")
SHARDING = ["--rows-per-shard", "17", "--seed", "2"]  # several shards for every rank
LAYOUTS = [(2, 1), (3, 1)]
IDS = ["2x1", "3x1"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, sentiment_sentences):
    """Each kind's `mpidl shard` options (without OUT_DIR) and one process's dataset."""
    root = tmp_path_factory.mktemp("shard-inputs")
    options = sharding_inputs(root, sentiment_sentences / "imdb.tsv")
    done = {}
    for kind in KINDS:
        one = root / f"{kind}-one"
        assert shard_main(options[kind] + SHARDING + [str(one)], comm=SingleCommunicator()) == 0
        done[kind] = (options[kind] + SHARDING, one)
    return done


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_one_rank_per_node_writes_one_process_dataset(cluster, tmp_path, inputs, layout, kind):
    argv, one = inputs[kind]
    out = tmp_path / "many"
    result = cluster.mpiexec(layout, ["mpidl", "shard", *argv, str(out)], timeout=120)
    assert result.returncode == 0, result.output
    assert result.stdout.count(f"wrote {out}/train") == 1, result.stdout  # rank 0 alone
    assert dataset_differences(out, one) == []
    # every rank's shards, published as one set numbered in order
    shards = read_manifest(str(out / "train")).shards
    assert [s.file for s in shards] == [f"shard-{i:05d}.h5" for i in range(len(shards))]


# Every rank's exit status, with its node's name: what `mpiexec` alone does not show.
VERIFY = 'mpidl shard --verify "$1"; echo "exit $? on $(hostname)"'


def verify(cluster, layout, folder):
    """`mpidl shard --verify FOLDER` at ``layout``: the sorted status lines, the output."""
    result = cluster.mpiexec(layout, ["sh", "-c", VERIFY, "sh", str(folder)], timeout=120)
    assert result.returncode == 0, result.output
    return sorted(line for line in result.stdout.splitlines() if line.startswith("exit ")), \
        result


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_verify_across_nodes_gives_one_verdict(cluster, tmp_path, inputs, layout):
    nodes = layout[0]
    data = tmp_path / "d"
    shutil.copytree(inputs["csv"][1], data)
    statuses, result = verify(cluster, layout, data)
    assert statuses == [f"exit 0 on n{i}" for i in range(1, nodes + 1)], result.output
    oks = [line for line in result.stdout.splitlines() if line.startswith("OK ")]
    assert len(oks) == 2 and all(f"checked by {nodes} ranks" in line for line in oks), \
        result.stdout  # train and test, said once

    bad = sorted((data / "train").glob("shard-*.h5"))[-1]
    with open(bad, "r+b") as f:  # flip a byte inside the token ids
        f.seek(os.path.getsize(bad) - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    statuses, result = verify(cluster, layout, data)
    assert statuses == [f"exit 2 on n{i}" for i in range(1, nodes + 1)], result.output
    assert result.stderr.count("mpidl shard: error:") == 1 and bad.name in result.stderr, \
        result.stderr
