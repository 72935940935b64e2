"""Keyed permutations of ``[0, n)`` that any rank evaluates on just the positions it needs.

:class:`FeistelPermutation` is a bijection with no structure (the sampler's ``"full"``
mode, and the order of blocks in ``"block"`` mode when the split fits in one window).
:class:`WindowedPermutation` is a bijection with locality, for data read from disk: the
positions are cut into *windows* of ``window`` consecutive positions, each window is
given ``window / chunk`` *chunks* (runs of ``chunk`` consecutive values) drawn at random
from the whole range, and the positions of a window are a random permutation of its
chunks' values. So a stretch of consecutive positions (a few steps of training) takes
its values from a few random contiguous regions, which a reader can fetch from disk
whole, in file order, instead of one random block at a time. It is FFCV's
``QUASI_RANDOM`` order (Leclerc et al., CVPR 2023), made exact for any number of ranks:
a function of the key only, evaluated per position.

Why: past the page cache, random 200 KB reads ran at 0.32-0.40 GB/s on this machine's
disk and reads of whole 3.2 MB chunks in file order at 0.43-0.54, against 0.69 for
``dd`` (a probe, 1 rank, 1 GB each, while another job wrote to the disk). With windows
the loader read a cold 51.9 GB split at 0.97-1.22x ``dd`` at 1 and 2 ranks, 1.06-1.7x
faster than without (benchmarks/README.md "Out of cache with windows", quiet runs).

Both are evaluated a chunk of positions at a time and cached (:meth:`take`), and
neither ever materialises all ``n`` values: a rank holds what it reads.
"""

from __future__ import annotations

import threading

import numpy

_CHUNK = 1 << 14  # positions per cached evaluation of a permutation
_KEEP_CHUNKS = 4
_M64 = (1 << 64) - 1
_C1, _C2 = numpy.uint64(0xBF58476D1CE4E5B9), numpy.uint64(0x94D049BB133111EB)


def splitmix64(x: int) -> int:
    """One step of the splitmix64 generator on a Python int (a good 64-bit mixer)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(z: numpy.ndarray) -> numpy.ndarray:
    """splitmix64's finaliser on uint64 arrays."""
    z = (z ^ (z >> numpy.uint64(30))) * _C1
    z = (z ^ (z >> numpy.uint64(27))) * _C2
    return z ^ (z >> numpy.uint64(31))


class _Cached:
    """:meth:`take` of consecutive positions, evaluated ``_CHUNK`` at a time and cached."""

    n: int

    def __init__(self) -> None:
        self._cache: dict[int, numpy.ndarray] = {}
        self._lock = threading.Lock()

    def __call__(self, positions: numpy.ndarray) -> numpy.ndarray:
        raise NotImplementedError

    def take(self, a: int, b: int) -> numpy.ndarray:
        """``self(arange(a, b))``, computed a chunk of positions at a time and cached.

        A step needs a few to a few hundred positions, and NumPy's per-call cost makes a
        small vectorised Feistel evaluation cost as much as a large one (about 1 ms per
        step, measured). One evaluation per chunk of 16384 consecutive positions, kept
        for the next steps, costs microseconds per step; only the last chunks are kept.
        """
        parts = []
        for c in range(a // _CHUNK, (b - 1) // _CHUNK + 1):
            values = self._chunk(c)
            parts.append(values[max(a - c * _CHUNK, 0) : min(b - c * _CHUNK, _CHUNK)])
        return parts[0] if len(parts) == 1 else numpy.concatenate(parts)

    def _chunk(self, c: int) -> numpy.ndarray:
        with self._lock:  # the loader's thread and the caller may both ask
            values = self._cache.get(c)
            if values is None:
                values = self(numpy.arange(c * _CHUNK, min((c + 1) * _CHUNK, self.n)))
                self._cache[c] = values
                while len(self._cache) > _KEEP_CHUNKS:
                    self._cache.pop(next(iter(self._cache)))
            return values


class FeistelPermutation(_Cached):
    """A keyed bijection of ``[0, n)``, evaluated on any subset of positions.

    A balanced Feistel network on ``2^bits >= n`` (bits even) is a bijection of that
    domain for any round function; cycle-walking (re-applying it until the value falls
    below ``n``) restricts it to a bijection of ``[0, n)``. The domain is under ``4n``,
    so a few walks suffice on average. ``tweak`` (one uint64 per position) selects one
    of many independent permutations per element: :class:`WindowedPermutation` permutes
    every window differently in one vectorised call.
    """

    def __init__(self, n: int, key: int, rounds: int = 4):
        super().__init__()
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self._half = numpy.uint64(bits // 2)
        self._mask = numpy.uint64((1 << (bits // 2)) - 1)
        keys, k = [], key & _M64
        for _ in range(rounds):
            k = splitmix64(k)
            keys.append(k)
        self._keys = [numpy.uint64(k) for k in keys]

    def _f(self, r: numpy.ndarray, key: numpy.ndarray) -> numpy.ndarray:
        return _mix(r ^ key) & self._mask

    def _walk(self, x: numpy.ndarray, inverse: bool, tweak: numpy.ndarray | None) -> numpy.ndarray:
        n = numpy.uint64(self.n)

        def once(v: numpy.ndarray, t: numpy.ndarray | None) -> numpy.ndarray:
            keys = self._keys if t is None else [_mix(k ^ t) for k in self._keys]
            left, right = v >> self._half, v & self._mask
            for k in keys[::-1] if inverse else keys:
                if inverse:  # undo (L, R) -> (R, L ^ F(R))
                    left, right = right ^ self._f(left, k), left
                else:
                    left, right = right, left ^ self._f(right, k)
            return (left << self._half) | right

        y = once(x, tweak)
        todo = numpy.flatnonzero(y >= n)
        while todo.size:  # cycle-walking: ends because x itself is < n
            y[todo] = once(y[todo], None if tweak is None else tweak[todo])
            todo = todo[y[todo] >= n]
        return y

    def __call__(self, positions: numpy.ndarray, tweak: numpy.ndarray | None = None
                 ) -> numpy.ndarray:
        """The values at ``positions`` (int64 array of values in ``[0, n)``)."""
        x = numpy.asarray(positions, dtype=numpy.uint64)
        return self._walk(x, False, tweak).astype(numpy.int64)

    def inverse(self, ids: numpy.ndarray, tweak: numpy.ndarray | None = None) -> numpy.ndarray:
        """The positions of ``ids``: ``inverse(perm(p)) == p``."""
        x = numpy.asarray(ids, dtype=numpy.uint64)
        return self._walk(x, True, tweak).astype(numpy.int64)


class WindowedPermutation(_Cached):
    """A keyed bijection of ``[0, n)`` whose windows of positions read few regions.

    Values are cut into chunks of ``chunk`` consecutive values (the last may be short);
    the chunks are put in a random order, except the last chunk, which stays last (so
    every window but the last is full); window ``w`` holds the values of chunks ``w k ..
    w k + k - 1`` of that order (``k = window // chunk``) and its positions are a
    random permutation of them, a different one per window. With a single window
    (``n <= window``) it is exactly ``FeistelPermutation(n, key)``.

    Args:
        n: the range.
        key: the permutation's key (64 bits).
        window: positions per window (rounded down to a multiple of ``chunk``).
        chunk: consecutive values per chunk.
    """

    def __init__(self, n: int, key: int, window: int, chunk: int):
        super().__init__()
        if chunk < 1 or window < chunk:
            raise ValueError(f"need 1 <= chunk <= window, got chunk {chunk}, window {window}")
        self.n, self.chunk = n, chunk
        self.window = window - window % chunk
        self._single = FeistelPermutation(n, key) if n <= self.window else None
        if self._single is not None:
            return
        self._chunks = -(-n // chunk)
        self._per = self.window // chunk  # chunks per window
        self._windows = -(-self._chunks // self._per)
        self._order = FeistelPermutation(self._chunks - 1, splitmix64(key ^ 1))
        self._inside = FeistelPermutation(self.window, splitmix64(key ^ 2))
        last = n - (self._windows - 1) * self.window  # positions of the last window
        self._last = FeistelPermutation(last, splitmix64(key ^ 3))

    def __call__(self, positions: numpy.ndarray) -> numpy.ndarray:
        """The values at ``positions`` (int64 array of values in ``[0, n)``)."""
        p = numpy.asarray(positions, dtype=numpy.int64)
        if self._single is not None:
            return self._single(p)
        w, j = numpy.divmod(p, self.window)
        last = w == self._windows - 1
        inner = numpy.empty_like(j)
        full = numpy.flatnonzero(~last)
        inner[full] = self._inside(j[full], w[full].astype(numpy.uint64))
        tail = numpy.flatnonzero(last)
        inner[tail] = self._last(j[tail])
        slot, offset = numpy.divmod(inner, self.chunk)
        slot += w * self._per
        return self._chunk_at(slot) * self.chunk + offset

    def inverse(self, values: numpy.ndarray) -> numpy.ndarray:
        """The positions of ``values``: ``inverse(perm(p)) == p``."""
        v = numpy.asarray(values, dtype=numpy.int64)
        if self._single is not None:
            return self._single.inverse(v)
        c, offset = numpy.divmod(v, self.chunk)
        slot = c.copy()  # the last chunk keeps the last slot
        head = numpy.flatnonzero(c < self._chunks - 1)
        slot[head] = self._order.inverse(c[head])
        w, inner_slot = numpy.divmod(slot, self._per)
        inner = inner_slot * self.chunk + offset
        j = numpy.empty_like(inner)
        last = w == self._windows - 1
        full = numpy.flatnonzero(~last)
        j[full] = self._inside.inverse(inner[full], w[full].astype(numpy.uint64))
        tail = numpy.flatnonzero(last)
        j[tail] = self._last.inverse(inner[tail])
        return w * self.window + j

    def _chunk_at(self, slot: numpy.ndarray) -> numpy.ndarray:
        out = slot.copy()
        head = numpy.flatnonzero(slot < self._chunks - 1)
        out[head] = self._order(slot[head])
        return out
