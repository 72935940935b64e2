"""Render a PBS template from ``slurm/`` for a site profile: ``mpidl sbatch train_pals``.

The PBS sibling of :mod:`hpc.sbatch`, for machines whose batch system is PBS Pro and
whose MPI launcher is HPE PALS's ``mpiexec --ppn N --depth D --cpu-bind depth`` (ALCF's
Polaris and Aurora). The same profiles and the same ``# >>> env`` block (env.sh); the
request becomes ``#PBS`` lines:

- ``--nodes N`` -> ``#PBS -l select=N`` (joined with the profile's ``[pbs] select``,
  e.g. ``system=polaris``), ``--time`` -> ``-l walltime``, ``--partition`` -> ``-q``
  (the queue), ``--account`` -> ``-A``, ``--job-name`` -> ``-N``;
- the profile's other ``[pbs]`` entries and ``--set RESOURCE=VALUE`` -> ``-l`` lines;
- ``--tasks-per-node`` (default: the profile's ``gpus_per_node``) and
  ``--cpus-per-task`` (default: its ``cpus_per_task``) are not PBS's: they become
  ``MPIDL_PPN`` and ``MPIDL_DEPTH``, which env.sh's ``mpidl_pals`` passes to mpiexec.

PALS runs ``nodes x ppn`` ranks, so ``--ntasks`` is refused rather than guessed at.
"""
from __future__ import annotations

import datetime
import re

from hpc.sbatch import Profile, RenderError, Request, _env_block, split_template

# PBS walltime: [[HH:]MM:]SS, no days.
_WALLTIME = re.compile(r"\d+(:\d{2}){0,2}")
_RESOURCE = re.compile(r"[a-z][a-z0-9_]*")
_FLAG = re.compile(r"[A-Za-z]")


def _parse(line: str) -> tuple[str, str]:
    """``"#PBS -l select=2"`` -> ``("l:select", "2")``; ``"#PBS -q debug"`` -> ``("q", "debug")``."""
    words = line[len("#PBS"):].split()
    if len(words) < 2 or not words[0].startswith("-") or not _FLAG.fullmatch(words[0][1:]):
        raise RenderError(f"cannot read directive {line!r}: use '#PBS -X VALUE' or "
                          f"'#PBS -l RESOURCE=VALUE'")
    if words[0] == "-l":
        name, eq, value = words[1].partition("=")
        if not eq:
            raise RenderError(f"cannot read directive {line!r}: -l takes RESOURCE=VALUE")
        return f"l:{name}", value
    return words[0][1:], words[1]


def _line(key: str, value: str) -> str:
    # qsub reads a directive up to the first space: a value with one would lose its rest.
    if not value or re.search(r"[\s'\"\\#]", value):
        raise RenderError(f"#PBS {key.replace('l:', '-l ')}={value!r}: values must be "
                          f"non-empty and free of spaces, quotes, backslashes and '#'")
    if key.startswith("l:"):
        if not _RESOURCE.fullmatch(key[2:]):
            raise RenderError(f"PBS resource {key[2:]!r} is not a name like 'filesystems'")
        return f"#PBS -l {key[2:]}={value}"
    return f"#PBS -{key} {value}"


def _settings(directives: dict[str, str], profile: Profile, req: Request) -> dict[str, str]:
    out = {f"l:{name}": str(value) for name, value in profile.pbs.items() if name != "select"}
    chunk = str(profile.pbs.get("select", ""))
    nodes = str(req.nodes) if req.nodes is not None else \
        directives.get("l:select", "1").split(":")[0]
    if req.nodes is not None or chunk:
        out["l:select"] = nodes + (f":{chunk}" if chunk else "")
    for key, value in (("q", req.partition or profile.partition),
                       ("A", req.account or profile.account), ("N", req.job_name),
                       ("l:walltime", req.time)):
        if value:
            out[key] = value
    for option, value in req.extra.items():
        if value is None:
            raise RenderError(f"--set {option}: a PBS resource needs a value "
                              f"(--set {option}=VALUE becomes '#PBS -l {option}=VALUE')")
        out[f"l:{option}"] = value
    return out


def render(template: str, profile: Profile, req: Request, env_sh: str,
           template_name: str = "template") -> str:
    """Render the PBS ``template`` for ``profile`` (see the module docstring).

    Raises:
        RenderError: a malformed template or value, or ``--ntasks``; the message names it.
    """
    if req.ntasks is not None:
        raise RenderError(f"--ntasks {req.ntasks}: PALS runs --nodes x --tasks-per-node "
                          f"ranks; give those instead (e.g. --nodes 2 --tasks-per-node 4)")
    if req.time is not None and not _WALLTIME.fullmatch(req.time):
        raise RenderError(f"--time {req.time!r} is not a PBS walltime: use HH:MM:SS "
                          f"(e.g. 01:30:00; PBS takes no days)")
    lines, directives, positions, begin, end = split_template(template, template_name,
                                                              "#PBS", _parse)

    header: list[str] = list(lines[:begin])
    added: list[str] = []
    for key, value in _settings(directives, profile, req).items():
        if key in positions:
            header[positions[key]] = _line(key, value)
        else:
            added.append(_line(key, value))
    last = max(positions.values())
    header[last + 1:last + 1] = added
    ppn = req.tasks_per_node or profile.gpus_per_node or None
    launcher = {"MPIDL_PALS_FLAGS": " ".join(profile.launcher_flags),
                "MPIDL_PPN": str(ppn or ""),
                "MPIDL_DEPTH": str(req.cpus_per_task or profile.cpus_per_task)}
    out_lines = header + _env_block(profile, req, env_sh, launcher) + lines[end + 1:]
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    out_lines.insert(1, f"# Rendered by `mpidl sbatch` from {template_name} for profile "
                        f"{profile.name!r} on {stamp}. Submit: qsub THIS_FILE")
    return "\n".join(out_lines) + "\n"
