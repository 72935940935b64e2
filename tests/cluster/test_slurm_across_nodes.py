"""A multi-node Slurm on the virtual nodes (`cluster.sh up --slurm`): one slurmd per node,
slurmctld and munged in the machine's namespace.

- `srun -N 2 hostname` answers from both nodes;
- slurm/train_cpu.sbatch at `-N 2 --ntasks-per-node=1` trains across them, and its
  `mpidl info` shows one rank on each;
- slurm/preemptible.sbatch across the 2 nodes: signalled mid-training (what
  `--signal=USR1@T` sends), it checkpoints, requeues itself, resumes, and ends with the
  parameters of an uninterrupted run submitted at the same time;
- Open MPI's `mpirun` inside `salloc -N 2` puts its ranks on both nodes;
- a node lost under a running job ends that job (NODE_FAIL or FAILED) within ~30 s;
  then it is reported to the next jobs (DOWN, a job's pending reason, `salloc
  --immediate` refused), and a job with a deadline ends at once instead of waiting;
- an `up --slurm` that fails undoes itself.

The cluster here has names, a subnet and a state folder of its own (``mpidls``,
``10.213.2``), brought up for this module, and its teardown checks that nothing of it is
left: namespaces, links, daemons, the state folder, /etc/hosts, addresses, routes.

    timeout 900 .venv/bin/python -m pytest -q -p no:cacheprovider tests/cluster/test_slurm_across_nodes.py
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clusterci import HERE, brought_up, leftovers, machine_state, script, script_env

sys.path.insert(0, str(HERE.parent / "slurm"))
from slurmci import SLURM_DIR, Cluster as Slurm  # noqa: E402

MISSING = [t for t in ("munged", "slurmctld", "slurmd", "sbatch", "salloc") if shutil.which(t) is None]
pytestmark = [pytest.mark.timeout(420),
              pytest.mark.skipif(bool(MISSING), reason=f"Slurm is not installed ({', '.join(MISSING)}):"
                                 " tests/slurm/install.sh")]

NAME, SUBNET = "mpidls", "10.213.2"
EX_TEMPFAIL = 75
# A small reviews corpus and a tiny transformer: a few seconds an epoch on 2 nodes.
TRAIN = ["--data.num-train=6000", "--data.num-test=1000", "--data.vocab-size=2000",
         "--data.seq-len=64", "--lr=1e-2", "--log-every=1", "--progress=never",
         "--model=transformer", "--model.dim=16", "--model.layers=1", "--model.heads=2",
         "--model.ffn=32"]
ONE_PER_NODE = ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=10")


def env_of(cluster) -> dict[str, str]:
    """What a shell has after `eval "$(cluster.sh env)"`, the documented route, that this
    process has not (the tests' environment is cluster.env())."""
    proc = subprocess.run(
        ["bash", "-c", f'eval "$(bash {HERE / "cluster.sh"} env)" && env -0'],
        capture_output=True, text=True, env=cluster.env(), timeout=30)
    assert proc.returncode == 0, proc.stderr
    after = dict(line.split("=", 1) for line in proc.stdout.split("\0") if "=" in line)
    return {k: v for k, v in after.items() if os.environ.get(k) != v and k != "_"}


@pytest.fixture(scope="module")
def slurm():
    with brought_up("mpidl-slurm-nodes-tests", 2, "--slurm", name=NAME, subnet=SUBNET) as made:
        yield made, Slurm(Path(env_of(made)["SLURM_CONF"]), env_of(made))


def states(slurm) -> dict[str, str]:
    out = slurm.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
    return dict(line.split() for line in out.splitlines())


def wait_for_node(slurm, node, pattern, limit):
    t0 = time.monotonic()
    while not re.fullmatch(pattern, states(slurm).get(node, "")):
        assert time.monotonic() - t0 < limit, f"{node} not {pattern} after {limit} s: " \
                                               f"{states(slurm)}"
        time.sleep(0.5)
    return time.monotonic() - t0


def test_srun_answers_from_both_nodes(slurm):
    _, sl = slurm
    proc = sl.run("srun", "-N", "2", "hostname", timeout=60)
    assert sorted(proc.stdout.split()) == ["n1", "n2"], proc.stdout


def test_mpirun_inside_an_allocation_puts_ranks_on_both_nodes(slurm):
    _, sl = slurm
    proc = sl.run("salloc", "-N", "2", "--ntasks-per-node=2", "-t", "2", "mpirun",
                  sys.executable, "-m", "mpidl", "info", "--json", "--no-probe", timeout=120)
    report = json.loads(proc.stdout)
    assert report["ranks_per_node"] == {"n1": 2, "n2": 2}, proc.stdout
    assert report["nodes_found_by"] == "shared memory", report["nodes_found_by"]


def _progress(run_dir: Path) -> bool:
    """The training has written a metrics line (so its signal handlers are set)."""
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > 0


@pytest.fixture(scope="module")
def templates(slurm, tmp_path_factory):
    """train_cpu and preemptible, submitted together across the two nodes (4 CPUs each);
    preemptible signalled once it trains."""
    _, sl = slurm
    tmp = tmp_path_factory.mktemp("templates")
    cache = tmp / "corpus"
    args = [*TRAIN, f"--data.cache-dir={cache}", "--epochs=3"]
    # one corpus for both jobs, written before them (a job writing it meets the other)
    subprocess.run([sys.executable, "-m", "mpidl", "train", *args, "--steps=1",
                    f"--run-dir={tmp / 'warm'}"], check=True, capture_output=True, timeout=120)
    reference = sl.submit(SLURM_DIR / "train_cpu.sbatch", *ONE_PER_NODE,
                          args=[*args, f"--run-dir={tmp / 'reference'}"],
                          log=tmp / "reference-%j.out", cwd=tmp)
    run_dir = tmp / "preempted"
    preempted = sl.submit(SLURM_DIR / "preemptible.sbatch", *ONE_PER_NODE,
                          args=[*args, f"--run-dir={run_dir}"],
                          log=tmp / "preempted-%j.out", cwd=tmp)
    signalled: list[float] = []

    def signal_once_training_runs(state):
        if not signalled and state[0] == "RUNNING" and _progress(run_dir):
            sl.run("scancel", "--signal=USR1", preempted)
            signalled.append(time.monotonic())

    job = sl.wait(preempted, limit=300, on_poll=signal_once_training_runs)
    ref = sl.wait(reference, limit=120)
    return ref, job, signalled, tmp


def test_train_cpu_template_trains_across_two_nodes(slurm, templates):
    _, sl = slurm
    ref, *_ = templates
    sl.assert_completed(ref)
    output = ref.output()
    assert re.findall(r"^ranks per node: (.*)$", output, re.M) == ["n1=1, n2=1"], ref.describe()
    assert re.search(r"^final test accuracy:\s+0\.\d+", output, re.M), ref.describe()


def _final_parameters(run_dir: Path) -> dict[str, np.ndarray]:
    from trainjob import final_parameters

    return dict(final_parameters(str(run_dir))[1])


def test_preemptible_template_across_two_nodes_resumes_to_the_uninterrupted_result(
        slurm, templates):
    _, sl = slurm
    _, job, signalled, tmp = templates
    assert signalled, f"the training ended before it wrote progress\n{job.describe()}"
    sl.assert_completed(job)
    output = job.output()
    assert job.restarts >= 1, f"the job was not requeued\n{job.describe()}"
    assert re.findall(r"^=== job \d+ \(\S+\) attempt (\d+)", output, re.M)[:2] == ["1", "2"], \
        job.describe()
    assert re.findall(r"^ranks per node: (.*)$", output, re.M)[:2] == ["n1=1, n2=1"] * 2, \
        job.describe()
    assert f"exited {EX_TEMPFAIL}; requeueing job {job.job_id}" in output, job.describe()
    expected, actual = _final_parameters(tmp / "reference"), _final_parameters(tmp / "preempted")
    assert sorted(actual) == sorted(expected)
    differ = [name for name in expected if not np.array_equal(actual[name], expected[name])]
    assert not differ, f"parameters differ after preemption and resume: {differ}"


def test_a_lost_node_ends_its_job_and_is_reported_to_the_next_ones(slurm, tmp_path):
    """n2 goes (its slurmd, the job's step daemon and rank, all killed) under a running
    2-node job: the job ends, n1's rank with it; then n2 is DOWN, and jobs that need it
    are told so and wait for it no longer than they asked."""
    cluster, sl = slurm
    run_dir = tmp_path / "run"
    job_id = sl.submit(SLURM_DIR / "train_cpu.sbatch", *ONE_PER_NODE, "--no-requeue",
                       args=[*TRAIN, f"--data.cache-dir={tmp_path / 'corpus'}",
                             "--epochs=100000", "--eval-every=100000", f"--run-dir={run_dir}"],
                       log=tmp_path / "lost-%j.out", cwd=tmp_path)
    t0 = time.monotonic()
    while not _progress(run_dir):
        assert time.monotonic() - t0 < 120, sl.show(job_id)
        time.sleep(0.5)
    try:
        victims = cluster.processes("n2", "")
        assert cluster.processes("n2", "-m\0mpidl"), "no rank on n2"
        subprocess.run(["kill", "-KILL", *map(str, victims)], check=False)
        t_kill = time.monotonic()
        job = sl.wait(job_id, limit=90)
        ended = time.monotonic() - t_kill
        # NODE_FAIL when slurmctld finds n2 gone first (SlurmdTimeout=10), FAILED when
        # the rank on n1 does (its MPI connection to n2 broke)
        assert job.state in ("NODE_FAIL", "FAILED"), job.describe()
        # and n1's rank goes with it (slurmstepd kills it, KillWait=10 s)
        while cluster.processes("n1", "-m\0mpidl"):
            assert time.monotonic() - t_kill < ended + 30, \
                f"a rank on n1 outlived its job by 30 s\n{job.describe()}"
            time.sleep(0.5)
        gone = time.monotonic() - t_kill
        # slurmctld pings every SlurmdTimeout/3 and gives up after SlurmdTimeout
        down = wait_for_node(sl, "n2", r"down\*?", 60) + time.monotonic() - t_kill
        # A job with a deadline it cannot meet without n2 ends at once.
        late = sl.run("sbatch", "--parsable", "-N", "2", "-t", "1", "--deadline=now+30",
                      "--wrap", "hostname").stdout.strip()
        assert sl.wait(late, limit=30).state == "DEADLINE", sl.show(late)
        # A job without one is held, and says why.
        held = sl.run("sbatch", "--parsable", "-N", "2", "-t", "1", "--wrap",
                      "hostname").stdout.strip()
        try:
            time.sleep(2)
            state, reason = sl.run("squeue", "-h", "-j", held, "-o", "%T|%r").stdout.strip() \
                .split("|")
            assert state == "PENDING", (state, reason)
            assert "DOWN" in reason or "ReqNodeNotAvail" in reason, reason
        finally:
            sl.run("scancel", held, check=False)
        # An allocation asked for at once is refused, within its wait.
        t0 = time.monotonic()
        proc = sl.run("salloc", "--immediate=5", "-N", "2", "-t", "1", "true", check=False,
                      timeout=60)
        assert proc.returncode != 0 and time.monotonic() - t0 < 30, proc.stderr
        assert "Required node not available (down, drained or reserved)" in proc.stderr, \
            proc.stderr
    finally:
        cluster.script("slurmd", "n2", "start")
        wait_for_node(sl, "n2", "idle", 60)
    print(f"n2 killed: the job ended after {ended:.1f} s ({job.state}), n1's rank after "
          f"{gone:.1f} s, n2 DOWN after {down:.1f} s")


def test_an_up_that_fails_undoes_itself(tmp_path):
    """slurmctld refuses the configuration (a node's CPUs are not a number): `up` says
    so, and removes what it made."""
    state, name = tmp_path / "failed", "mpidlf"
    before = machine_state()
    env = {"MPIDL_CLUSTER_SLURM_CPUS": "many"}
    proc = subprocess.run(["bash", str(HERE / "cluster.sh"), "up", "--nodes", "2", "--slurm"],
                          capture_output=True, text=True, timeout=120,
                          env={**script_env(state, name, "10.213.3"), **env})
    try:
        assert proc.returncode != 0
        assert "slurmctld ended" in proc.stderr and "CPUs value many" in proc.stderr, \
            proc.stderr
        assert not leftovers(state, name)
        assert machine_state() == before
    finally:
        script(state, "down", name=name, subnet="10.213.3")

