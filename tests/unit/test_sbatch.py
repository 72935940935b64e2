"""The slurm/ templates and their rendering by `mpidl sbatch`, without a Slurm.

tests/slurm submits the same scripts to a real (local) Slurm; here they are read,
rendered, linted with shellcheck (where installed: tests/slurm/install.sh) and
``bash -n``-parsed, and env.sh is sourced in a plain bash.

    PYTHONPATH=. .venv/bin/python -m pytest -p no:cacheprovider -q tests/unit/test_sbatch.py
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc import pbs, sbatch
from hpc.sbatch import RenderError, Request, load_profile, render

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "slurm"
TEMPLATES = ["bench", "preemptible", "test", "train_cpu", "train_gpu"]
PBS_TEMPLATES = ["train_pals"]
ENV_SH = (SLURM / "env.sh").read_text()
needs_shellcheck = pytest.mark.skipif(shutil.which("shellcheck") is None,
                                      reason="shellcheck not installed (tests/slurm/install.sh)")


def directives(script: str) -> dict[str, str | None]:
    """``{option: value}`` of a script's ``#SBATCH --option[=value]`` lines."""
    out: dict[str, str | None] = {}
    for line in script.splitlines():
        m = re.match(r"#SBATCH --([a-z-]+)(?:=(\S+))?$", line)
        if m:
            assert m.group(1) not in out, f"--{m.group(1)} given twice"
            out[m.group(1)] = m.group(2)
    return out


def rendered(template: str, profile: str = "generic-cpu", **request) -> str:
    text = (SLURM / f"{template}.sbatch").read_text()
    return render(text, load_profile(profile), Request(**request), ENV_SH, template)


def rendered_pbs(template: str, profile: str = "pbs-pals", **request) -> str:
    text = (SLURM / f"{template}.pbs").read_text()
    return pbs.render(text, load_profile(profile), Request(**request), ENV_SH, template)


def write_profile(tmp_path: Path, body: str) -> str:
    path = tmp_path / "site.toml"
    path.write_text(body)
    return str(path)


def test_the_shipped_templates_and_profiles_are_found():
    assert set(TEMPLATES + PBS_TEMPLATES) <= set(sbatch.list_templates())
    assert {"generic-cpu", "generic-gpu", "cray-mpich", "intel-mpi", "pbs-pals"} <= \
        set(sbatch.list_profiles())


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_template_is_strict_portable_and_says_how_to_submit(name):
    text = (SLURM / f"{name}.sbatch").read_text()
    header = text.split("set -euo pipefail")[0]
    assert text.startswith("#!/bin/bash\n")
    assert "\nset -euo pipefail\n" in text
    assert re.search(r"^#\s+sbatch .*slurm/" + name + r"\.sbatch", header, re.M), \
        "the header shows the sbatch command line"
    opts = directives(text)
    # Nothing site- or user-specific: partition and account come from a profile or -p/-A.
    assert not {"partition", "account", "qos", "chdir"} & set(opts)
    assert opts["output"] == "%x-%j.out"
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\bsrun\b", code.replace("mpidl_srun", "")), \
        "launch through env.sh's mpidl_srun (srun --mpi=pmix)"
    assert "mpidl_job_start" in text, "every job prints `mpidl info` once at its start"
    assert "/home/" not in text and "/work/" not in text


def test_env_sh_launches_with_the_profiles_plugin_pmix_by_default():
    assert re.search(r'^\s+srun --mpi="\$MPIDL_SRUN_MPI" ', ENV_SH, re.M)
    assert "MPIDL_SRUN_MPI=${MPIDL_SRUN_MPI:-pmix}" in ENV_SH


def test_preemptible_signals_requeues_and_appends():
    opts = directives((SLURM / "preemptible.sbatch").read_text())
    assert re.fullmatch(r"USR1@\d+", opts["signal"] or "")
    assert "requeue" in opts and opts["open-mode"] == "append"
    assert "scontrol requeue" in (SLURM / "preemptible.sbatch").read_text()


def test_rendering_sets_the_request_and_the_training_arguments():
    script = rendered("train_cpu", nodes=2, tasks_per_node=4, time="01:00:00",
                      args=["--epochs", "3", "--run-dir", "runs/a b"])
    opts = directives(script)
    assert (opts["nodes"], opts["ntasks-per-node"], opts["time"]) == ("2", "4", "01:00:00")
    assert opts["cpus-per-task"] == "1" and "partition" not in opts and "account" not in opts
    assert "set -- --epochs 3 --run-dir 'runs/a b' \"$@\"" in script
    # env.sh is inlined: the rendered script does not look for slurm/ at run time.
    assert "scontrol show job" not in script and "source \"$MPIDL_SLURM_DIR" not in script
    assert "mpidl_srun()" in script and script.count("# <<< env") == 1
    assert script.index("set -- --epochs") < script.index("mpidl_srun()")


def test_gpu_template_runs_one_task_per_gpu_of_the_profile():
    opts = directives(rendered("train_gpu", "generic-gpu", nodes=3))
    assert (opts["nodes"], opts["ntasks-per-node"], opts["gpus-per-task"]) == ("3", "4", "1")
    assert opts["cpus-per-task"] == "8"


def test_gpu_template_refuses_a_profile_without_gpus_or_too_many_tasks():
    with pytest.raises(RenderError, match="no GPUs.*generic-gpu"):
        rendered("train_gpu", "generic-cpu")
    with pytest.raises(RenderError, match="--tasks-per-node 8 exceeds.*gpus_per_node = 4"):
        rendered("train_gpu", "generic-gpu", tasks_per_node=8)


def test_a_task_count_replaces_the_template_count_given_the_other_way():
    opts = directives(rendered("train_cpu", ntasks=6))
    assert opts["ntasks"] == "6" and "ntasks-per-node" not in opts
    opts = directives(rendered("test", tasks_per_node=3))
    assert opts["ntasks-per-node"] == "3" and "ntasks" not in opts


def test_a_site_profile_sets_partition_account_modules_launcher_and_env(tmp_path):
    profile = write_profile(tmp_path, """
description = "a site"
partition = "gpu-a100"
account = "proj42"
modules = ["cuda/12.2", "openmpi/5.0"]
venv = "/opt/envs/mpidl"
gpus_per_node = 8
cpus_per_task = 6
launcher_flags = ["--cpu-bind=cores", "--gpu-bind=closest"]
[sbatch]
qos = "high"
exclusive = true
[env]
UCX_TLS = "rc,sm,self,cuda_copy"
NCCL_DEBUG = "WARN"
""")
    script = rendered("train_gpu", profile, nodes=2, account="other")
    opts = directives(script)
    assert opts["partition"] == "gpu-a100" and opts["account"] == "other"
    assert opts["ntasks-per-node"] == "8" and opts["cpus-per-task"] == "6"
    assert opts["qos"] == "high" and "exclusive" in opts and opts["exclusive"] is None
    for line in ("export MPIDL_MODULES='cuda/12.2 openmpi/5.0'",
                 "export MPIDL_VENV=/opt/envs/mpidl",
                 "export MPIDL_SRUN_FLAGS='--cpu-bind=cores --gpu-bind=closest'",
                 "export UCX_TLS=rc,sm,self,cuda_copy", "export NCCL_DEBUG=WARN"):
        assert line in script.splitlines()


@pytest.mark.parametrize("body, message", [
    ("partitoin = 'x'", "unknown key.*partitoin"),
    ("gpus_per_node = '4'", "gpus_per_node = '4' should be a int"),
    ("modules = 'cuda'", "modules = 'cuda' should be a list of strings"),
    ("cpus_per_task = 0", "cpus_per_task = 0 is too small"),
    ("modules = ['cuda 12']", "modules entries must be single words"),
    ("[env]\n'BAD-NAME' = 'x'", "BAD-NAME"),
    ("[sbatch]\nqos = 'a b'", "values must be non-empty and free of spaces"),
    ("partition = ", "not valid TOML"),
    ("srun_mpi = 'pmi'", "srun_mpi = 'pmi' is not an srun --mpi plugin.*cray_shasta"),
    ("srun_mpi = 'none'", "srun_mpi = 'none' is not"),
    ("pmi_library = 'libpmi2.so'", "pmi_library = 'libpmi2.so' must be an absolute path"),
    ("[pbs]\nfilesystems = 'a b'", None),  # refused when a PBS template is rendered
])
def test_bad_profiles_are_refused_with_the_key_and_the_fix(tmp_path, body, message):
    if message is None:
        with pytest.raises(RenderError, match="filesystems='a b'.*free of spaces"):
            rendered_pbs("train_pals", write_profile(tmp_path, body))
        return
    with pytest.raises(RenderError, match=message):
        rendered("train_cpu", write_profile(tmp_path, body))


@pytest.mark.parametrize("time", ["30", "30:00", "01:30:00", "2-00", "1-12:00:00"])
def test_slurm_time_formats_are_accepted(time):
    assert directives(rendered("train_cpu", time=time))["time"] == time


@pytest.mark.parametrize("time", ["1h", "01:30:00:00", "", "-1"])
def test_malformed_times_are_refused(time):
    with pytest.raises(RenderError, match="is not a Slurm time"):
        rendered("train_cpu", time=time)


def test_an_unknown_template_or_profile_names_the_known_ones():
    with pytest.raises(RenderError, match="no template 'train'.*train_cpu"):
        sbatch.find_template("train")
    with pytest.raises(RenderError, match="no profile 'nope'.*generic-cpu"):
        load_profile("nope")


def test_main_writes_to_stdout_or_a_file(tmp_path, capsys):
    assert sbatch.main(["test", "--ntasks", "2", "--", "tests/mpi"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and "set -- tests/mpi \"$@\"" in out
    target = tmp_path / "job.sbatch"
    assert sbatch.main(["train_gpu", "-N", "2", "-o", str(target), "--", "--epochs", "1"]) == 0
    assert directives(target.read_text())["ntasks-per-node"] == "4"  # generic-gpu by default
    assert "sbatch " + str(target) in capsys.readouterr().err


def test_output_writes_over_an_existing_file_only_with_force_and_never_over_a_template(
        tmp_path, capsys):
    target = tmp_path / "job.sbatch"
    target.write_text("precious")
    assert sbatch.main(["train_cpu", "-o", str(target)]) == 2
    assert f"{target} already exists" in capsys.readouterr().err
    assert target.read_text() == "precious"
    assert sbatch.main(["train_cpu", "-o", str(target), "--force"]) == 0
    assert target.read_text().startswith("#!/bin/bash\n")
    template = sbatch.find_template("train_cpu")
    before = template.read_text()
    assert sbatch.main(["train_cpu", "-o", str(template), "--force"]) == 2
    assert "which this command reads" in capsys.readouterr().err
    assert template.read_text() == before


def test_main_reports_errors_with_status_2(capsys):
    assert sbatch.main(["train_gpu", "--profile", "generic-cpu"]) == 2
    assert "no GPUs" in capsys.readouterr().err
    assert sbatch.main([]) == 2
    assert sbatch.main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert "train_cpu" in listing and "profile generic-gpu:" in listing


def test_mpidl_sbatch_is_the_cli_command():
    proc = subprocess.run([sys.executable, "-m", "mpidl", "sbatch", "train_cpu", "-n", "4"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert directives(proc.stdout)["ntasks"] == "4"


def _all_scripts(tmp_path: Path) -> list[Path]:
    scripts = [SLURM / f"{t}.sbatch" for t in TEMPLATES] + \
        [SLURM / f"{t}.pbs" for t in PBS_TEMPLATES]
    for t in TEMPLATES:
        path = tmp_path / f"{t}.rendered.sbatch"
        path.write_text(rendered(t, "generic-gpu" if t == "train_gpu" else "generic-cpu",
                                 nodes=1, args=["--epochs", "1", "it's quoted"]))
        scripts.append(path)
    for t in PBS_TEMPLATES:
        path = tmp_path / f"{t}.rendered.pbs"
        path.write_text(rendered_pbs(t, nodes=1, args=["--epochs", "1", "it's quoted"]))
        scripts.append(path)
    return scripts


def test_templates_and_rendered_scripts_parse_in_bash(tmp_path):
    for path in _all_scripts(tmp_path) + [SLURM / "env.sh"]:
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"


@needs_shellcheck
def test_templates_env_sh_rendered_and_cluster_scripts_are_shellcheck_clean(tmp_path):
    # The templates' own .shellcheckrc lets shellcheck follow `source env.sh`.
    scripts = [str(p) for p in _all_scripts(tmp_path)] + [str(SLURM / "env.sh")]
    scripts += [str(p) for p in sorted((ROOT / "tests" / "slurm").glob("*.sh"))]
    proc = subprocess.run(["shellcheck", "--severity=style", *scripts], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _source_env_sh(script: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    environ.update({"PYTHONPATH": str(ROOT), "MPIDL_PYTHON": sys.executable, **env})
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source slurm/env.sh; {script}"],
                          capture_output=True, text=True, cwd=ROOT, env=environ, timeout=60)


def test_env_sh_gives_threads_from_cpus_per_task_and_a_pmix_launcher():
    proc = _source_env_sh('echo "$OMP_NUM_THREADS $SRUN_CPUS_PER_TASK $MPIDL_PYTHON"; '
                          "declare -f mpidl_srun", SLURM_CPUS_PER_TASK="3",
                          MPIDL_SRUN_FLAGS="--cpu-bind=cores --label")
    assert proc.returncode == 0, proc.stderr
    first, *function = proc.stdout.splitlines()
    assert first == f"3 3 {sys.executable}"
    assert 'srun --mpi="$MPIDL_SRUN_MPI" "${mpidl_srun_flags[@]}" "$@"' in "\n".join(function)


def test_env_sh_stops_the_job_when_its_python_cannot_import_mpidl(tmp_path):
    proc = _source_env_sh("echo unreachable", MPIDL_PYTHON=str(tmp_path / "nope"))
    assert proc.returncode == 2 and "unreachable" not in proc.stdout
    assert "cannot import mpidl" in proc.stderr and "MPIDL_PYTHON" in proc.stderr


def _fake(tmp_path: Path, name: str) -> Path:
    """A ``name`` first on PATH that logs its arguments (and I_MPI_PMI_LIBRARY) and exits 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / f"{name}.log"
    tool = bin_dir / name
    tool.write_text(f'#!/bin/bash\necho "$* | ${{I_MPI_PMI_LIBRARY:-}}" >> {log}\n')
    tool.chmod(0o755)
    return log


def _run_script(tmp_path: Path, script: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "PBS_", "MPIDL_", "I_MPI_"))}
    environ.update({"PYTHONPATH": str(ROOT), "MPIDL_PYTHON": sys.executable,
                    "PATH": f"{tmp_path / 'bin'}{os.pathsep}{environ['PATH']}", **env})
    path = tmp_path / "job.sh"
    path.write_text(script)
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, cwd=tmp_path,
                          env=environ, timeout=60)


@pytest.mark.parametrize("profile, plugin, library", [
    ("generic-cpu", "pmix", ""),
    ("cray-mpich", "cray_shasta", ""),
    ("intel-mpi", "pmi2", "LIB"),
])
def test_a_rendered_job_runs_srun_with_its_profiles_plugin_and_pmi_library(
        tmp_path, profile, plugin, library):
    log = _fake(tmp_path, "srun")
    script = rendered("train_cpu", profile, nodes=1, args=["--epochs", "3"])
    lib = tmp_path / "libpmi2.so"
    lib.write_text("")
    if library:  # the profile names the cluster's path; here it is a file of ours
        assert "export MPIDL_PMI_LIBRARY=/usr/lib64/libpmi2.so" in script.splitlines()
        script = script.replace("/usr/lib64/libpmi2.so", str(lib))
    script = script.replace("export MPIDL_MODULES=cray-mpich-abi\n", "")  # no Lmod here
    proc = _run_script(tmp_path, script, SLURM_CPUS_PER_TASK="1")
    assert proc.returncode == 0, proc.stderr
    expected = str(lib) if library else ""
    assert log.read_text().splitlines() == [
        f"--mpi={plugin} --overlap {sys.executable} -m mpidl info | {expected}",
        f"--mpi={plugin} {sys.executable} -m mpidl train --epochs 3 | {expected}"]


@pytest.mark.parametrize("env, message", [
    ({"MPIDL_SRUN_MPI": "none"}, "MPIDL_SRUN_MPI=none is not an srun --mpi plugin"),
    ({"MPIDL_SRUN_MPI": "pmi2", "MPIDL_PMI_LIBRARY": "/nowhere/libpmi2.so"},
     "MPIDL_PMI_LIBRARY=/nowhere/libpmi2.so does not exist"),
])
def test_env_sh_stops_a_job_whose_plugin_or_pmi_library_cannot_start_mpi(tmp_path, env, message):
    log = _fake(tmp_path, "srun")
    proc = _source_env_sh("mpidl_srun true", **env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not log.exists()


def test_pals_template_renders_pbs_directives_ppn_and_depth():
    script = rendered_pbs("train_pals", nodes=3, tasks_per_node=2, time="00:30:00",
                          partition="debug", account="proj", job_name="pals",
                          extra={"filesystems": "home:grand"}, args=["--epochs", "2"])
    lines = script.splitlines()
    pbs_lines = [line for line in lines if line.startswith("#PBS")]
    assert pbs_lines == ["#PBS -N pals", "#PBS -l select=3:system=polaris",
                         "#PBS -l place=scatter", "#PBS -l walltime=00:30:00", "#PBS -j oe",
                         "#PBS -l filesystems=home:grand", "#PBS -q debug", "#PBS -A proj"]
    assert {"export MPIDL_PPN=2", "export MPIDL_DEPTH=8", "set -- --epochs 2 \"$@\""} <= \
        set(lines)
    assert "#SBATCH" not in script and "qsub THIS_FILE" in lines[1]


def test_pals_template_takes_ppn_from_the_profiles_gpus_and_refuses_ntasks():
    assert "export MPIDL_PPN=4" in rendered_pbs("train_pals", nodes=1).splitlines()
    with pytest.raises(RenderError, match="--ntasks 8: PALS runs --nodes x --tasks-per-node"):
        rendered_pbs("train_pals", ntasks=8)
    with pytest.raises(RenderError, match="'1-00:00:00' is not a PBS walltime"):
        rendered_pbs("train_pals", time="1-00:00:00")
    with pytest.raises(RenderError, match="--set exclusive: a PBS resource needs a value"):
        rendered_pbs("train_pals", extra={"exclusive": None})


def test_rendered_pals_job_runs_pals_mpiexec_over_every_node(tmp_path):
    log = _fake(tmp_path, "mpiexec")
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x3001\nx3001\nx3002\nx3002\n")  # 2 nodes, one line per chunk
    script = rendered_pbs("train_pals", nodes=2, tasks_per_node=4, cpus_per_task=8,
                          args=["--epochs", "3"])
    proc = _run_script(tmp_path, script, PBS_JOBID="123.polaris", PBS_NODEFILE=str(nodefile),
                       PBS_O_WORKDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    pals = "-n 8 --ppn 4 --depth 8 --cpu-bind depth --env OMP_NUM_THREADS=8"
    assert log.read_text().splitlines() == [
        f"{pals} {sys.executable} -m mpidl info | ",
        f"{pals} {sys.executable} -m mpidl train --epochs 3 | "]
    assert proc.stdout.startswith("=== job 123.polaris (), ") and "2 node(s)" in proc.stdout


def test_mpidl_sbatch_renders_the_pbs_template_and_says_qsub(tmp_path, capsys):
    target = tmp_path / "job.pbs"
    assert sbatch.main(["train_pals", "-N", "2", "-o", str(target), "--", "--epochs", "1"]) == 0
    assert "#PBS -l select=2:system=polaris" in target.read_text().splitlines()
    assert f"submit with: qsub {target}" in capsys.readouterr().err
    assert sbatch.main(["train_pals", "-n", "4"]) == 2
    assert "--ntasks 4: PALS runs" in capsys.readouterr().err
