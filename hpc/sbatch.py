"""Render a batch script from ``slurm/`` for a site profile: ``mpidl sbatch``.

The templates in ``slurm/`` run as they are (``sbatch slurm/train_cpu.sbatch``) and
find ``slurm/env.sh`` at run time. Rendering makes a self-contained script for one
cluster: the ``#SBATCH`` lines get the profile's partition, account and GPUs and the
requested nodes, tasks and time; the block between ``# >>> env`` and ``# <<< env`` is
replaced by the profile's settings (modules, virtual environment, launcher flags,
environment variables), the default training arguments, and ``env.sh`` itself::

    mpidl sbatch train_cpu --profile generic-cpu --nodes 2 --tasks-per-node 4 \\
        --time 01:00:00 -o job.sbatch -- --epochs 3
    sbatch job.sbatch                       # more training arguments may follow
    mpidl sbatch --list                     # templates and profiles

A profile is a TOML file (``hpc/profiles/*.toml`` ship ``generic-cpu``,
``generic-gpu``, ``cray-mpich``, ``intel-mpi`` and ``pbs-pals``; any path to a ``.toml``
works too) with the keys of :data:`PROFILE_KEYS` and three tables: ``[sbatch]`` (further
``#SBATCH`` long options), ``[pbs]`` (``#PBS -l`` resources of PBS templates) and
``[env]`` (variables exported in the job). ``srun_mpi`` and ``pmi_library`` choose how
srun starts the site's MPI. A ``.pbs`` template (PBS with HPE PALS) is rendered by
:mod:`hpc.pbs` from the same profile.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from hpc.argtypes import output_file, positive_int
from hpc.files import OutputError, check_output, write_text

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport (a dependency there)
    import tomli as tomllib

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"

# key -> (type, default, meaning)
PROFILE_KEYS: dict[str, tuple[type, Any, str]] = {
    "description": (str, "", "one line shown by --list"),
    "partition": (str, "", "partition; empty: the cluster's default"),
    "account": (str, "", "account to charge; empty: the user's default"),
    "modules": (list, [], "modules loaded in the job before anything runs"),
    "venv": (str, "", "virtual environment activated in the job; empty: the submitting one"),
    "python": (str, "", "the python that runs mpidl; empty: the environment's"),
    "gpus_per_node": (int, 0, "GPUs per node; GPU templates run one task per GPU"),
    "cpus_per_task": (int, 1, "CPUs per task; OMP_NUM_THREADS follows it"),
    "launcher_flags": (list, [], "extra srun flags for every step (PALS mpiexec flags "
                                 "for PBS templates)"),
    "srun_mpi": (str, "", "srun's --mpi plugin: pmix (the default: Open MPI, HPC-X), pmi2 "
                          "(MPICH, MVAPICH, Intel MPI), cray_shasta (HPE Cray MPICH)"),
    "pmi_library": (str, "", "Intel MPI under srun: Slurm's PMI library for srun_mpi "
                             "(I_MPI_PMI_LIBRARY), e.g. /usr/lib64/libpmi2.so"),
    "pbs": (dict, {}, "PBS templates: further '#PBS -l' resources {resource: value}; "
                      "select = 'system=polaris' joins the select line"),
    "sbatch": (dict, {}, "further #SBATCH long options: {option: value, or true for a flag}"),
    "env": (dict, {}, "variables exported in the job before env.sh"),
}

# sbatch's short options, so that a template's "#SBATCH -N 2" is overridden by --nodes.
_SHORT = {"-N": "nodes", "-n": "ntasks", "-c": "cpus-per-task", "-t": "time", "-p": "partition",
          "-A": "account", "-J": "job-name", "-o": "output", "-e": "error", "-G": "gpus",
          "-q": "qos", "-C": "constraint"}

# Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")
_OPTION = re.compile(r"[a-z][a-z0-9-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_BEGIN, _ENV_END = "# >>> env", "# <<< env"
# srun --mpi plugins an MPI job starts with (slurm/env.sh checks the same list at run time).
SRUN_MPI = re.compile(r"pmix|pmix_v[345]|pmi2|cray_shasta")


class RenderError(ValueError):
    """A template, profile or request that cannot become a valid batch script."""


@dataclass(frozen=True)
class Profile:
    """A site's settings for the templates; see :data:`PROFILE_KEYS`."""

    name: str
    source: str
    description: str = ""
    partition: str = ""
    account: str = ""
    modules: list[str] = field(default_factory=list)
    venv: str = ""
    python: str = ""
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    launcher_flags: list[str] = field(default_factory=list)
    srun_mpi: str = ""
    pmi_library: str = ""
    pbs: dict[str, Any] = field(default_factory=dict)
    sbatch: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def slurm_dirs() -> list[Path]:
    """Where templates are looked up, in order: ``$MPIDL_SLURM_DIR``, the source tree's
    ``slurm/`` (next to the ``hpc`` package), and ``<prefix>/share/mpidl/slurm`` (where a
    wheel installs them)."""
    here = Path(__file__).resolve().parent
    dirs = [Path(os.environ["MPIDL_SLURM_DIR"])] if os.environ.get("MPIDL_SLURM_DIR") else []
    return dirs + [here.parent / "slurm", Path(sys.prefix) / "share" / "mpidl" / "slurm"]


# Template suffixes: Slurm's, and PBS's (rendered by hpc.pbs).
SUFFIXES = (".sbatch", ".pbs")


def list_templates() -> list[str]:
    """Names of the templates found in :func:`slurm_dirs`."""
    names = {p.stem for d in slurm_dirs() if d.is_dir() for suffix in SUFFIXES
             for p in d.glob(f"*{suffix}")}
    return sorted(names)


def find_template(name: str) -> Path:
    """The template ``name`` (``train_cpu``) or the file at path ``name``."""
    path = Path(name)
    if path.is_file() or os.sep in name:
        if not path.is_file():
            raise RenderError(f"template file {name!r} does not exist")
        return path
    name = name.removesuffix(".sbatch").removesuffix(".pbs")
    for d in slurm_dirs():
        for suffix in SUFFIXES:
            if (d / f"{name}{suffix}").is_file():
                return d / f"{name}{suffix}"
    raise RenderError(f"no template {name!r}; known: {', '.join(list_templates()) or 'none'} "
                      f"(searched {', '.join(map(str, slurm_dirs()))}; set MPIDL_SLURM_DIR)")


def list_profiles() -> list[str]:
    """Names of the profiles shipped in ``hpc/profiles``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def _check_type(key: str, value: Any, where: str) -> Any:
    kind = PROFILE_KEYS[key][0]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is list and ok:
        ok = all(isinstance(v, str) for v in value)
    if not ok:
        raise RenderError(f"{where}: {key} = {value!r} should be a {kind.__name__}"
                          f"{' of strings' if kind is list else ''} ({PROFILE_KEYS[key][2]})")
    return value


def load_profile(name: str) -> Profile:
    """Read profile ``name`` from ``hpc/profiles``, or the TOML file at path ``name``.

    Raises:
        RenderError: no such profile, invalid TOML, an unknown key (a typo would
            otherwise be ignored silently), or a value of the wrong type.
    """
    path = Path(name)
    if path.suffix != ".toml" and os.sep not in name:
        path = PROFILE_DIR / f"{name}.toml"
        if not path.is_file():
            raise RenderError(f"no profile {name!r}; shipped: {', '.join(list_profiles())}; "
                              f"or pass the path of a .toml file")
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise RenderError(f"cannot read profile {str(path)!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise RenderError(f"profile {str(path)!r} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(PROFILE_KEYS))
    if unknown:
        raise RenderError(f"profile {str(path)!r}: unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(PROFILE_KEYS)}")
    values = {k: _check_type(k, v, str(path)) for k, v in data.items()}
    for key in ("gpus_per_node", "cpus_per_task"):
        if key in values and values[key] < (0 if key == "gpus_per_node" else 1):
            raise RenderError(f"profile {str(path)!r}: {key} = {values[key]} is too small")
    for key, value in values.get("env", {}).items():
        if not _ENV_NAME.fullmatch(key) or not isinstance(value, (str, int, float)):
            raise RenderError(f"profile {str(path)!r}: [env] {key} = {value!r}: names are "
                              f"shell variable names, values strings or numbers")
    values["env"] = {k: str(v) for k, v in values.get("env", {}).items()}
    if values.get("srun_mpi") and not SRUN_MPI.fullmatch(values["srun_mpi"]):
        raise RenderError(f"profile {str(path)!r}: srun_mpi = {values['srun_mpi']!r} is not "
                          f"an srun --mpi plugin an MPI job starts with: use pmix (Open MPI, "
                          f"HPC-X), pmi2 (MPICH, MVAPICH, Intel MPI) or cray_shasta (HPE "
                          f"Cray MPICH); `srun --mpi=list` shows the site's")
    if values.get("pmi_library") and not values["pmi_library"].startswith("/"):
        raise RenderError(f"profile {str(path)!r}: pmi_library = {values['pmi_library']!r} "
                          f"must be an absolute path on the cluster's nodes, e.g. "
                          f"/usr/lib64/libpmi2.so")
    return Profile(name=path.stem, source=str(path), **values)


def _parse_directive(line: str) -> tuple[str, str | None]:
    """``"#SBATCH --nodes=2"`` -> ``("nodes", "2")``; a flag gives ``(option, None)``."""
    words = line.split("#", 2)[1][len("SBATCH"):].split()
    if not words:
        raise RenderError(f"empty directive {line!r}")
    word = words[0]
    if word.startswith("--"):
        option, eq, value = word[2:].partition("=")
        return option, value if eq else (words[1] if len(words) > 1 else None)
    if word[:2] in _SHORT:
        value = word[2:] or (words[1] if len(words) > 1 else "")
        return _SHORT[word[:2]], value.lstrip("=")
    raise RenderError(f"cannot read directive {line!r}: use long options (--nodes=2)")


def _directive(option: str, value: str | None) -> str:
    if not _OPTION.fullmatch(option):
        raise RenderError(f"#SBATCH option {option!r} is not a long option name like 'qos'")
    if value is None:
        return f"#SBATCH --{option}"
    # sbatch splits #SBATCH lines on whitespace; a value with spaces or quotes would
    # silently become another option.
    if not value or re.search(r"[\s'\"\\#]", value):
        raise RenderError(f"#SBATCH --{option}={value!r}: values must be non-empty and free "
                          f"of spaces, quotes, backslashes and '#'")
    return f"#SBATCH --{option}={value}"


@dataclass
class Request:
    """What the user asks for on the command line; None keeps the template's value."""

    nodes: int | None = None
    tasks_per_node: int | None = None
    ntasks: int | None = None
    cpus_per_task: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    extra: dict[str, str | None] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)


def _settings(directives: Mapping[str, str | None], profile: Profile,
              req: Request) -> dict[str, str | None]:
    """The directives to set (``""`` means: remove the template's line)."""
    out: dict[str, str | None] = {}
    for option, value in profile.sbatch.items():
        # true: a flag (exclusive = true); false: drop the template's line.
        out[option] = None if value is True else "" if value is False else str(value)
    if profile.partition:
        out["partition"] = profile.partition
    if profile.account:
        out["account"] = profile.account
    gpu_template = "gpus-per-task" in directives
    tasks_per_node = req.tasks_per_node
    if gpu_template:
        if profile.gpus_per_node == 0:
            raise RenderError(f"profile {profile.name!r} has no GPUs (gpus_per_node = 0) but "
                              f"the template asks for --gpus-per-task; use a GPU profile "
                              f"(generic-gpu) or a CPU template (train_cpu)")
        if tasks_per_node is None and req.ntasks is None:
            tasks_per_node = profile.gpus_per_node
        if tasks_per_node is not None and tasks_per_node > profile.gpus_per_node:
            raise RenderError(f"--tasks-per-node {tasks_per_node} exceeds profile "
                              f"{profile.name!r}'s gpus_per_node = {profile.gpus_per_node}, "
                              f"and each task needs its own GPU; ask for at most "
                              f"{profile.gpus_per_node}")
    if "cpus-per-task" in directives or profile.cpus_per_task != 1:
        out["cpus-per-task"] = str(profile.cpus_per_task)
    for option, value in (("nodes", req.nodes), ("ntasks-per-node", tasks_per_node),
                          ("ntasks", req.ntasks), ("cpus-per-task", req.cpus_per_task),
                          ("time", req.time), ("partition", req.partition),
                          ("account", req.account), ("job-name", req.job_name)):
        if value is not None:
            out[option] = str(value)
    # A task count given one way replaces the template's count given the other way:
    # with both, Slurm takes --ntasks and treats --ntasks-per-node as a maximum.
    if tasks_per_node is not None and req.ntasks is None:
        out["ntasks"] = ""
    if req.ntasks is not None and tasks_per_node is None:
        out["ntasks-per-node"] = ""
    out.update(req.extra)
    return out


def _env_block(profile: Profile, req: Request, env_sh: str,
               launcher: Mapping[str, str] | None = None) -> list[str]:
    """The rendered ``# >>> env`` block: the profile's settings, ``launcher``'s variables
    (a Slurm template's by default), the training arguments and env.sh."""
    lines = [f"{_ENV_BEGIN}: rendered by `mpidl sbatch` from profile {profile.name!r} "
             f"({profile.source}) and slurm/env.sh"]
    if launcher is None:
        launcher = {"MPIDL_SRUN_FLAGS": " ".join(profile.launcher_flags),
                    "MPIDL_SRUN_MPI": profile.srun_mpi,
                    "MPIDL_PMI_LIBRARY": profile.pmi_library}
    exports = {"MPIDL_MODULES": " ".join(profile.modules), "MPIDL_VENV": profile.venv,
               "MPIDL_PYTHON": profile.python, **launcher}
    for name, items in (("modules", profile.modules), ("launcher_flags", profile.launcher_flags)):
        bad = [i for i in items if not i or re.search(r"\s", i)]
        if bad:
            raise RenderError(f"profile {profile.name!r}: {name} entries must be single words "
                              f"without spaces, got {bad!r}")
    for name, value in list(exports.items()) + list(profile.env.items()):
        if value:
            lines.append(f"export {name}={shlex.quote(value)}")
    if req.args:
        lines.append("# Training arguments chosen at rendering; those given to sbatch follow.")
        lines.append("set -- " + " ".join(shlex.quote(a) for a in req.args) + ' "$@"')
    body = env_sh.splitlines()
    if body and body[0].startswith("# shellcheck shell="):
        body = body[1:]
    return lines + body + [_ENV_END]


def split_template(template: str, template_name: str, prefix: str,
                   parse: Any) -> tuple[list[str], dict, dict[str, int], int, int]:
    """A batch template's lines, its directives (``prefix`` lines before the first
    command, each read by ``parse(line) -> (key, value)``) with their line numbers, and
    the first and last line of its ``# >>> env`` block; RenderError naming the template
    when it lacks a shebang, directives or the block. Slurm's and PBS's templates alike."""
    lines = template.splitlines()
    if not lines or not lines[0].startswith("#!"):
        raise RenderError(f"{template_name}: the first line must be a shebang (#!/bin/bash)")
    header_end = next((i for i, line in enumerate(lines)
                       if line.strip() and not line.lstrip().startswith("#")), len(lines))
    directives: dict = {}
    positions: dict[str, int] = {}
    for i, line in enumerate(lines[:header_end]):
        if line.startswith(prefix):
            key, value = parse(line)
            directives[key], positions[key] = value, i
    if not positions:
        raise RenderError(f"{template_name}: no {prefix} lines before the first command")
    try:
        begin = next(i for i, line in enumerate(lines) if line.startswith(_ENV_BEGIN))
        end = next(i for i, line in enumerate(lines) if line.startswith(_ENV_END))
    except StopIteration:
        raise RenderError(f"{template_name}: no '{_ENV_BEGIN}' ... '{_ENV_END}' block to "
                          f"replace with env.sh and the profile") from None
    return lines, directives, positions, begin, end


def render(template: str, profile: Profile, req: Request, env_sh: str,
           template_name: str = "template") -> str:
    """Render ``template`` (the text of a ``slurm/*.sbatch``) for ``profile``.

    Args:
        template: the template's text; its ``#SBATCH`` lines come before the first
            command, and it has one ``# >>> env`` ... ``# <<< env`` block.
        profile: the site's settings.
        req: nodes, tasks, time etc. and the default training arguments.
        env_sh: the text of ``slurm/env.sh``, inlined into the result.
        template_name: named in the result's header.

    Returns:
        The batch script, ready for ``sbatch``.

    Raises:
        RenderError: a malformed template or value; the message names it.
    """
    if req.time is not None and not _TIME.fullmatch(req.time):
        raise RenderError(f"--time {req.time!r} is not a Slurm time: use MINUTES, "
                          f"HH:MM:SS or DAYS-HH:MM:SS (e.g. 01:30:00)")
    lines, directives, positions, begin, end = split_template(
        template, template_name, "#SBATCH", _parse_directive)

    settings = _settings(directives, profile, req)
    header: list[str | None] = list(lines[:begin])
    added: list[str] = []
    for option, value in settings.items():
        if option in positions:
            header[positions[option]] = None if value == "" else _directive(option, value)
        elif value != "":
            added.append(_directive(option, value))
    last = max(positions.values())
    header[last + 1:last + 1] = added
    out_lines = ([line for line in header if line is not None]
                 + _env_block(profile, req, env_sh) + lines[end + 1:])
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    out_lines.insert(1, f"# Rendered by `mpidl sbatch` from {template_name} for profile "
                        f"{profile.name!r} on {stamp}. Submit: sbatch THIS_FILE [ARGS]")
    return "\n".join(out_lines) + "\n"


def _extra(text: str) -> tuple[str, str | None]:
    option, eq, value = text.partition("=")
    return option.lstrip("-"), value if eq else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpidl sbatch",
        description="Render a Slurm batch script from slurm/ for a site profile. "
                    "Arguments after -- become the job's default training arguments.",
        epilog="example: mpidl sbatch train_cpu --profile generic-cpu --nodes 2 "
               "--tasks-per-node 4 --time 01:00:00 -o job.sbatch -- --epochs 3")
    p.add_argument("template", nargs="?", help="template name (train_cpu, train_gpu, "
                   "preemptible, test, bench; train_pals for PBS with HPE PALS) or a "
                   ".sbatch or .pbs file")
    p.add_argument("--profile", help="profile name in hpc/profiles or a .toml file "
                   "(default: generic-gpu for GPU templates, pbs-pals for PBS ones, else "
                   "generic-cpu)")
    p.add_argument("-N", "--nodes", type=positive_int)
    p.add_argument("--tasks-per-node", type=positive_int, help="MPI ranks per node")
    p.add_argument("-n", "--ntasks", type=positive_int, help="MPI ranks in all")
    p.add_argument("-c", "--cpus-per-task", type=positive_int)
    p.add_argument("-t", "--time", help="time limit: MINUTES, HH:MM:SS or DAYS-HH:MM:SS")
    p.add_argument("-p", "--partition")
    p.add_argument("-A", "--account")
    p.add_argument("-J", "--job-name")
    p.add_argument("--set", dest="extra", action="append", type=_extra, default=[],
                   metavar="OPTION[=VALUE]", help="another #SBATCH option (qos=high, exclusive)")
    p.add_argument("-o", "--output", type=output_file,
                   help="write the script here instead of stdout")
    p.add_argument("--force", action="store_true", help="write over an existing --output")
    p.add_argument("--list", action="store_true", help="list templates and profiles")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``mpidl sbatch TEMPLATE [OPTIONS] [-- TRAINING ARGS]``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args_at = argv.index("--") if "--" in argv else len(argv)
    parser = _parser()
    opts = parser.parse_args(argv[:args_at])
    if opts.list:
        print("templates: " + ", ".join(list_templates()))
        for name in list_profiles():
            print(f"profile {name}: {load_profile(name).description}")
        return 0
    if not opts.template:
        parser.print_usage(sys.stderr)
        print("mpidl sbatch: name a template (see --list)", file=sys.stderr)
        return 2
    try:
        path = find_template(opts.template)
        if opts.output:  # before rendering: never over a file not named for writing
            check_output(opts.output, force=opts.force, reads=[path, path.parent / "env.sh"])
        text = path.read_text()
        env_path = path.parent / "env.sh"
        if not env_path.is_file():
            raise RenderError(f"{env_path} not found: the template's folder must hold env.sh")
        pbs = path.suffix == ".pbs"
        profile_name = opts.profile or ("pbs-pals" if pbs else "generic-gpu"
                                        if "--gpus-per-task" in text else "generic-cpu")
        req = Request(nodes=opts.nodes, tasks_per_node=opts.tasks_per_node, ntasks=opts.ntasks,
                      cpus_per_task=opts.cpus_per_task, time=opts.time,
                      partition=opts.partition, account=opts.account, job_name=opts.job_name,
                      extra=dict(opts.extra), args=argv[args_at + 1:])
        if pbs:
            from hpc import pbs as pbs_render

            script = pbs_render.render(text, load_profile(profile_name), req,
                                       env_path.read_text(), template_name=f"slurm/{path.name}")
        else:
            script = render(text, load_profile(profile_name), req, env_path.read_text(),
                            template_name=f"slurm/{path.name}")
    except (RenderError, OutputError) as e:
        print(f"mpidl sbatch: {e}", file=sys.stderr)
        return 2
    if opts.output:
        write_text(opts.output, script)
        submit = "qsub" if pbs else "sbatch"
        print(f"mpidl sbatch: wrote {opts.output}; submit with: {submit} {opts.output}",
              file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
