"""The alpha-beta cost of collectives, and the network and device profiles that feed it.

A link is two numbers: ``alpha``, the seconds a message costs before its first byte
(latency), and ``bandwidth``, the bytes per second it then moves. The time of a
collective of ``n`` bytes over ``p`` ranks follows from the algorithm MPI libraries use
for large messages (Thakur, Rabenseifner & Gropp 2005; MPICH's comments)::

    allreduce (ring)          2(p-1) alpha + 2 (p-1)/p  n / bandwidth   (iallreduce alike)
    allgather, reduce_scatter  (p-1) alpha +   (p-1)/p  n / bandwidth   (n: all blocks)
    alltoall (pairwise)        (p-1) alpha +   (p-1)/p  n / bandwidth   (n: the send buffer)
    bcast (binomial tree)  ceil(lg p) alpha +           n / bandwidth
    sendrecv (a ring shift)           alpha +           n / bandwidth

(the reduction's arithmetic is left out: it runs at memory speed, far above any link).
The bandwidth here is NCCL-tests' *bus bandwidth*, which is why ``mpidl bench``'s
busbw of a measured collective is directly the link's: a fit ``t = a + n / b`` measured
at ``p`` ranks gives ``bandwidth = b * factor(op, p)`` and ``alpha = a / steps(op, p)``.

A single line fits a real network badly. Measured on the virtual cluster's 1 Gbit/s
links (tests/cluster, htb): an allreduce between two nodes moved 0.005 GB/s at 4 KB,
0.024 at 64 KB, 0.016 at 256 KB (Open MPI's TCP rendezvous) and 0.05-0.07 from 4 MB
on, so the one alpha-beta fit (215 us + 0.049 GB/s) is 2-3x off across the 64 KB-1 MB
sizes a gradient bucket has. A measured profile therefore also keeps the times it
measured (``[OP.measured.RANKS]``: ``sizes``, ``time_us``, at one or more rank
counts): :meth:`Link.time` interpolates the curve measured nearest the rank count asked
(log-log, piecewise linear) and carries it there by the alpha-beta model's ratio, exact
at a measured rank count; outside the measured sizes the alpha-beta line continues
from the nearest end.

Profiles are TOML files: ``hpc/profiles/network/*.toml`` and ``hpc/profiles/device/*.toml``
ship common ones, each naming the source of its numbers; ``mpidl bench
--save-profile NAME`` writes a measured one into ``$MPIDL_PROFILE_DIR/network`` (default
``~/.config/mpidl/network``), which :func:`load_network` finds by name first.
"""
from __future__ import annotations

import bisect
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SHIPPED = Path(__file__).resolve().parent / "profiles"
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "alltoall", "bcast", "sendrecv",
               "iallreduce")
STAND_IN = "allreduce"  # whose numbers price a collective a profile lacks


def steps(op: str, ranks: int) -> int:
    """Messages on the critical path of ``op`` over ``ranks`` (the alpha terms)."""
    if ranks <= 1:
        return 0
    if op in ("allreduce", "iallreduce"):
        return 2 * (ranks - 1)
    if op in ("allgather", "reduce_scatter", "alltoall"):
        return ranks - 1
    if op == "bcast":
        return math.ceil(math.log2(ranks))
    if op == "sendrecv":
        return 1
    raise ValueError(f"unknown collective {op!r}; one of {', '.join(COLLECTIVES)}")


def volume(op: str, ranks: int) -> float:
    """Bytes through each rank's link per byte of the collective: NCCL-tests' bus factor
    (doc/PERFORMANCE.md), the one rule ``mpidl bench``'s busbw uses too. A ring allreduce
    moves ``2(n-1)/n`` of the buffer through each link, an allgather, reduce-scatter or
    alltoall ``(n-1)/n``, a broadcast or a ring shift all of it."""
    if ranks < 1:
        raise ValueError(f"size={ranks}: a communicator has at least 1 rank")
    if op in ("allreduce", "iallreduce"):
        return 2.0 * (ranks - 1) / ranks
    if op in ("allgather", "reduce_scatter", "alltoall"):
        return (ranks - 1) / ranks
    if op in ("bcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}; one of {', '.join(COLLECTIVES)}")


Curve = tuple[tuple[float, float], ...]  # (bytes, seconds), sizes increasing


@dataclass(frozen=True)
class Link:
    """One collective's link parameters: latency (s) and bus bandwidth (bytes/s), and
    optionally the measured curves behind them: ``curves`` of ``(ranks, ((bytes,
    seconds), ...))``, the collective itself timed at that many ranks (``mpidl bench``
    sweeps saved in a profile), rank counts increasing."""

    alpha: float
    bandwidth: float
    curves: tuple[tuple[int, Curve], ...] = ()

    def line(self, op: str, nbytes: float, ranks: int) -> float:
        """The alpha-beta model alone (0 on one rank or nothing to send)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return steps(op, ranks) * self.alpha + volume(op, ranks) * nbytes / self.bandwidth

    def time(self, op: str, nbytes: float, ranks: int) -> float:
        """Seconds of ``op`` on ``nbytes`` over ``ranks`` (0 on one rank)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        if not self.curves:
            return self.line(op, nbytes, ranks)
        # The curve measured nearest this rank count (MPI libraries switch algorithms
        # with the rank count: measured here, a 4 MB allreduce over 3 nodes took 1.6x
        # the 2-node time where a ring's volume says 1.33x), then the line's ratio
        # between the rank counts (1 where they are equal).
        at, points = min(self.curves, key=lambda c: (abs(c[0] - ranks), -c[0]))
        measured = _on_curve(points, lambda n: self.line(op, n, at), nbytes)
        if ranks == at:
            return measured
        return measured * self.line(op, nbytes, ranks) / self.line(op, nbytes, at)


def _on_curve(points: Curve, line: Any, nbytes: float) -> float:
    """``points`` interpolated at ``nbytes``: straight in log-log between two measured
    sizes; beyond them the line's shape, from the nearest end."""
    lo, hi = points[0], points[-1]
    if nbytes <= lo[0]:
        return lo[1] * line(nbytes) / line(lo[0])
    if nbytes >= hi[0]:
        return hi[1] * line(nbytes) / line(hi[0])
    i = bisect.bisect_right([n for n, _ in points], nbytes)
    (n0, t0), (n1, t1) = points[i - 1], points[i]
    w = math.log(nbytes / n0) / math.log(n1 / n0)
    return math.exp((1 - w) * math.log(t0) + w * math.log(t1))


@dataclass
class NetworkProfile:
    """A named network: a :class:`Link` per collective (``default`` for the others)."""

    name: str
    source: str
    links: dict[str, Link]
    path: str = ""
    notes: str = ""

    def link(self, op: str) -> Link:
        """``op``'s own numbers, else ``[default]``, else the allreduce's (see
        :meth:`stand_ins`); ProfileError when the profile has none of them."""
        for name in (op, "default", STAND_IN):
            if name in self.links:
                return self.links[name]
        lacks = ", ".join(f"[{name}]" for name in dict.fromkeys((op, "default", STAND_IN)))
        raise ProfileError(f"network profile {self.name!r} ({self.path}) has no {lacks} "
                           f"table, only {sorted(self.links)}: measure the collectives with "
                           f"`mpidl bench --op all --save-profile {self.name}`")

    def stand_ins(self, ops: Sequence[str]) -> list[str]:
        """The collectives of ``ops`` priced with the allreduce's numbers, for want of
        their own or a ``[default]`` (a profile saved by ``mpidl bench --op allreduce``).
        Bus bandwidths are comparable across collectives (NCCL-tests), so it is an
        estimate, not an error; ProfileError when the allreduce is missing too."""
        missing = [op for op in ops if op not in self.links and "default" not in self.links]
        for op in missing:
            self.link(op)
        return missing

    def time(self, op: str, nbytes: float, ranks: int) -> float:
        """Seconds of ``op`` on ``nbytes`` over ``ranks`` ranks of this network."""
        return self.link(op).time(op, nbytes, ranks)


@dataclass
class DeviceProfile:
    """A named device: sustained float32 throughput of a training step, memory."""

    name: str
    source: str
    flops: float                  # sustained FLOP/s of a training step (not the peak)
    memory_bytes: float
    kind: str = "cpu"
    path: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class ProfileError(ValueError):
    """A profile that is missing or malformed; the message names the file and the fix."""


def profile_dir() -> Path:
    """Where measured profiles go: ``$MPIDL_PROFILE_DIR`` or ``~/.config/mpidl``."""
    root = os.environ.get("MPIDL_PROFILE_DIR")
    return Path(root) if root else Path.home() / ".config" / "mpidl"


def _candidates(kind: str, name: str) -> list[Path]:
    if name.endswith(".toml") or os.sep in name:
        return [Path(name)]
    return [profile_dir() / kind / f"{name}.toml", SHIPPED / kind / f"{name}.toml"]


def list_profiles(kind: str) -> list[str]:
    """Names of the ``kind`` ("network" or "device") profiles: measured, then shipped."""
    names: list[str] = []
    for root in (profile_dir() / kind, SHIPPED / kind):
        if root.is_dir():
            names += [p.stem for p in sorted(root.glob("*.toml")) if p.stem not in names]
    return names


def _read(kind: str, name: str) -> tuple[dict, Path]:
    for path in _candidates(kind, name):
        if path.is_file():
            try:
                with open(path, "rb") as f:
                    return tomllib.load(f), path
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
                raise ProfileError(f"{kind} profile {path} is not valid TOML: {e}") from None
    raise ProfileError(f"no {kind} profile {name!r}; known: {', '.join(list_profiles(kind))} "
                       f"(or a .toml path; measure one with `mpidl bench --save-profile NAME`)")


def _number(table: Mapping, key: str, where: str, positive: bool = True) -> float:
    value = table.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
            value > 0 if positive else value >= 0) or not math.isfinite(value):
        raise ProfileError(f"{where}: {key} = {value!r} must be a finite number "
                           f"{'> 0' if positive else '>= 0'}")
    return float(value)


def load_network(name: str) -> NetworkProfile:
    """Read network profile ``name`` (a name or a .toml path).

    Format: ``name``, ``source`` (where the numbers come from), and one table per
    collective or ``[default]``, each with ``alpha_us`` and ``bandwidth_GBps`` (bus
    bandwidth, 1e9 bytes/s), and optionally measured curves: ``[OP.measured.RANKS]``
    tables of ``sizes`` (bytes) and ``time_us``, measured at RANKS ranks.
    """
    data, path = _read("network", name)
    if not isinstance(data.get("source"), str) or not data["source"].strip():
        raise ProfileError(f"network profile {path} names no source: add source = \"...\" "
                           "(a measurement or a datasheet)")
    links = {}
    for op, table in data.items():
        if isinstance(table, dict):
            if op not in COLLECTIVES + ("default",):
                raise ProfileError(f"network profile {path}: unknown table [{op}]; use "
                                   f"{', '.join(COLLECTIVES)} or default")
            where = f"network profile {path} [{op}]"
            links[op] = Link(_number(table, "alpha_us", where, positive=False) * 1e-6,
                             _number(table, "bandwidth_GBps", where) * 1e9,
                             _curves(table, where))
    if not links:
        raise ProfileError(f"network profile {path} has no [default] or per-collective table")
    return NetworkProfile(str(data.get("name", path.stem)), data["source"], links, str(path),
                          str(data.get("notes", "")))


def _curves(table: Mapping, where: str) -> tuple[tuple[int, Curve], ...]:
    """A table's measured curves, ``[OP.measured.RANKS]`` sub-tables each with ``sizes``
    (bytes, increasing) and ``time_us``; () where it has none."""
    measured = table.get("measured", {})
    if not isinstance(measured, dict):
        raise ProfileError(f"{where}: measured = {measured!r} must be tables "
                           f"[OP.measured.RANKS] of sizes and time_us")
    curves = []
    for key, curve in measured.items():
        at = f"{where}.measured.{key}"
        if not (key.isdigit() and int(key) >= 2) or not isinstance(curve, dict):
            raise ProfileError(f"{at}: name each measured curve by its rank count (>= 2), "
                               f"as `mpidl bench --save-profile NAME` does")
        sizes, times = curve.get("sizes"), curve.get("time_us")
        ok = (isinstance(sizes, list) and isinstance(times, list)
              and len(sizes) == len(times) >= 2
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                      and math.isfinite(v) for v in sizes + times)
              and all(a < b for a, b in zip(sizes, sizes[1:])))
        if not ok:
            raise ProfileError(f"{at}: sizes = {sizes!r} and time_us = {times!r} must be "
                               "lists of one length (at least 2) of positive numbers, sizes "
                               "increasing; measure them again with `mpidl bench "
                               "--save-profile NAME`")
        curves.append((int(key), tuple((float(n), float(t) * 1e-6)
                                       for n, t in zip(sizes, times))))
    return tuple(sorted(curves))


def load_device(name: str) -> DeviceProfile:
    """Read device profile ``name``: ``source``, ``kind`` ("cpu"/"gpu"), ``tflops``
    (sustained float32 TFLOP/s of training steps) and ``memory_GB``."""
    data, path = _read("device", name)
    if not isinstance(data.get("source"), str) or not data["source"].strip():
        raise ProfileError(f"device profile {path} names no source: add source = \"...\"")
    where = f"device profile {path}"
    return DeviceProfile(str(data.get("name", path.stem)), data["source"],
                         _number(data, "tflops", where) * 1e12,
                         _number(data, "memory_GB", where) * 1e9,
                         str(data.get("kind", "cpu")), str(path),
                         {k: v for k, v in data.items()
                          if k not in ("name", "source", "tflops", "memory_GB", "kind")})


def link_from_fit(op: str, alpha: float, beta: float, ranks: int) -> Link:
    """The link behind a fit ``t = alpha + bytes / beta`` of ``op`` measured at ``ranks``."""
    if ranks < 2:
        raise ProfileError(f"a fit measured on {ranks} rank says nothing about a network: "
                           "measure at 2 ranks or more (on 2 nodes for the network)")
    return Link(alpha / steps(op, ranks), beta * volume(op, ranks))


def check_profile_name(name: str) -> str:
    """``name`` if it can name a profile file, else ProfileError saying what can."""
    if not name or os.sep in name or name.startswith("."):
        raise ProfileError(f"profile name {name!r}: use a plain name like 'mycluster' (no "
                           "path, not starting with a dot)")
    return name


def network_profile_path(name: str) -> Path:
    """Where :func:`save_network_profile` writes profile ``name`` (a plain name)."""
    check_profile_name(name)
    return profile_dir() / "network" / f"{name}.toml"


def save_network_profile(name: str, fits: Mapping[str, Any], ranks: int, nodes: int,
                         source: str,
                         curves: Mapping[str, Sequence[tuple[float, float]]] | None = None
                         ) -> Path:
    """Write the fits of ``mpidl bench`` (op -> AlphaBeta) as network profile ``name``,
    with each op's measured (bytes, seconds) at ``ranks`` where ``curves`` has them.

    The curves an existing profile of that name holds at other rank counts are kept
    (measure the same network at 2 and at 3 nodes, save both under one name); the
    fits and the curves at ``ranks`` are replaced. Delete the file to start over.
    """
    path = network_profile_path(name)
    kept: dict[str, list[tuple[int, Curve]]] = {}
    if path.is_file():
        try:
            old = load_network(str(path))
        except ProfileError:
            old = None  # a broken file is replaced whole
        for op, link in (old.links.items() if old else ()):
            kept[op] = [(r, c) for r, c in link.curves if r != ranks]
    lines = [f"# Measured by `mpidl bench --save-profile {name}`; read by `mpidl plan "
             f"--network {name}`.", f"name = {_toml(name)}", f"source = {_toml(source)}",
             f"ranks = {ranks}", f"nodes = {nodes}", ""]
    if nodes < 2:
        lines.insert(3, 'notes = "measured on one node: shared memory, not a network"')
    for op, fit in fits.items():
        link = link_from_fit(op, fit.alpha, fit.beta, ranks)
        bandwidth = link.bandwidth / 1e9 if math.isfinite(link.bandwidth) else 1e6
        lines += [f"[{op}]", f"alpha_us = {link.alpha * 1e6:.6g}",
                  f"bandwidth_GBps = {bandwidth:.6g}", ""]
        mine = tuple(sorted((curves or {}).get(op, ())))
        for at, curve in sorted(kept.get(op, []) + ([(ranks, mine)] if len(mine) >= 2
                                                     and ranks >= 2 else [])):
            lines += [f"[{op}.measured.{at}]",
                      f"sizes = [{', '.join(str(int(n)) for n, _ in curve)}]",
                      f"time_us = [{', '.join(f'{t * 1e6:.6g}' for _, t in curve)}]", ""]
    from hpc.files import write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "\n".join(lines))
    return path


def _toml(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
