"""Swap timing for policies: copy channels, free time, and the in-trigger (paper §4.4). No torch.

Times are on the baseline compute stream (Note [Baseline timeline] in problem.py), in ns.

# Note: [In-trigger search]
# ``SwapInStartTime = BackAccessTime - SwapTime`` is the latest moment a prefetch may start. Walk
# back from the back-access to the last op starting no later than that, skip ops inside the peak
# window (a prefetch there would put the tensor back exactly when memory is tightest, paper §4.4
# adjustment (a)), and respect the host->device channel: a copy cannot start while another one
# runs (adjustment (b)), so if the channel is busy the search looks for the latest free slot that
# still ends in time. When no trigger hides the copy completely, the trigger is the earliest
# allowed op and the exposed wait is the swap's overhead.
"""

from __future__ import annotations

import weakref
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .problem import Problem


class Channel:
    """One copy direction: reserved, non-overlapping ``[start, end)`` intervals in ns.

    Besides the intervals as reserved (``starts``/``ends``), the channel keeps their union as
    maximal runs (``_rs``/``_re``: back-to-back copies coalesced). A slot of positive length
    overlaps a run exactly when it overlaps one of its intervals, so ``first_fit`` and
    ``latest_fit`` step over a whole run of queued copies at once and give the same answer;
    zero-length slots (copies that round to 0 ns) use the intervals as reserved.
    """

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self._rs: list[int] = []
        self._re: list[int] = []
        self._gaps: np.ndarray | None = None  # _rs[j + 1] - _re[j], made when first asked

    def reserve(self, start: int, end: int) -> None:
        i = bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        rs, re_ = self._rs, self._re
        lo = bisect_left(re_, start)  # first run ending at or after start: touches or follows
        hi = bisect_right(rs, end)  # runs starting at or before end touch or overlap
        if lo < hi:
            start, end = min(start, rs[lo]), max(end, re_[hi - 1])
        rs[lo:hi] = [start]
        re_[lo:hi] = [end]
        self._gaps = None

    def first_fit(self, earliest: int, dur: int) -> int:
        """The earliest start >= ``earliest`` with ``dur`` ns free (Note [First fit])."""
        if dur <= 0:
            return scan_first_fit(self.starts, self.ends, earliest, dur)
        rs, re_ = self._rs, self._re
        t = earliest
        i = bisect_right(rs, t) - 1  # the last run starting at or before t
        if i >= 0 and re_[i] > t:
            t = re_[i]  # inside it: from its end
        i += 1
        n = len(rs)
        if i >= n or rs[i] >= t + dur:
            return t
        # the first gap after run i, i+1, ... that holds dur (after the last run: all free)
        for j in range(i, min(i + _SCAN, n - 1)):
            if rs[j + 1] - re_[j] >= dur:
                return re_[j]
        if i + _SCAN >= n - 1:
            return re_[-1]
        gaps = self._gaps
        if gaps is None:
            gaps = self._gaps = np.array(rs[1:], dtype=np.int64) - np.array(re_[:-1], np.int64)
        tail = gaps[i + _SCAN :] >= dur
        k = int(tail.argmax())
        return re_[i + _SCAN + k] if tail[k] else re_[-1]

    def latest_fit(self, earliest: int, deadline: int, dur: int) -> int | None:
        """The latest start in [earliest, deadline - dur] with ``dur`` ns free, or None."""
        starts, ends = (self._rs, self._re) if dur > 0 else (self.starts, self.ends)
        t = deadline - dur
        if t < earliest:
            return None
        i = bisect_right(starts, t + dur) - 1  # intervals starting before the slot ends
        while i >= 0:
            if ends[i] <= t:
                return t
            if starts[i] < t + dur:  # overlaps: move the slot before this interval
                t = starts[i] - dur
                if t < earliest:
                    return None
            i -= 1
        return t


def scan_first_fit(starts: list[int], ends: list[int], earliest: int, dur: int) -> int:
    """``Channel.first_fit`` by a plain scan over sorted, disjoint ``[start, end)`` intervals
    (zero-length slots, and the reference the faster search is tested against)."""
    t = earliest
    i = max(0, bisect_right(starts, t) - 1)
    while i < len(starts):
        if ends[i] <= t:
            i += 1
            continue
        if starts[i] >= t + dur:
            return t
        t = max(t, ends[i])
        i += 1
    return t


_SCAN = 8  # gaps looked at one by one before the vectorised search

# Note: [First fit]
# A slot of positive length starting at t fits before run i when ``rs[i] >= t + dur``; past
# that, the runs are disjoint and maximal, so the slot starts at the end of the first run j >= i
# whose following gap ``rs[j + 1] - re[j]`` holds ``dur`` (or after the last run). A busy
# channel walks tens of runs per query (DenseNet-121 at 60%: 30 on average, 94 at the 90th
# percentile), so after ``_SCAN`` gaps the rest are compared at once on an array of the gaps,
# made again after a reservation. The answer is the plain scan's (``scan_first_fit``; tested
# against it in tests/test_channel.py).


def _op_times(problem: Problem) -> tuple[list[int], list[int]]:
    """The problem's baseline op start and end times as lists, once per problem."""
    got = _OP_TIMES.get(problem)
    if got is None:
        got = _OP_TIMES[problem] = (problem.start_ns.tolist(), problem.end_ns.tolist())
    return got


_OP_TIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class SwapEstimate(NamedTuple):
    """A swap of one storage over one access pair, as a policy foresees it (ns). A named tuple:
    a policy makes hundreds of thousands per plan (DenseNet-121 at 60%: 310,000), and a frozen
    dataclass's construction cost 3% of its hybrid selection's time there."""

    trigger_op: int | None  # None: on demand at the back-access
    out_start_ns: int
    out_end_ns: int
    in_start_ns: int
    in_end_ns: int
    overhead_ns: int  # exposed wait at the back-access
    cover_lo: int  # ops cover_lo..cover_hi run entirely while the storage is out
    cover_hi: int


class SwapTimer:
    """Estimates swaps on one problem against reserved channels and a peak-window mask."""

    def __init__(self, problem: Problem, in_peak: np.ndarray):
        self.p = problem
        self.start = problem.start_ns
        self.end = problem.end_ns
        # the same as Python lists: ``estimate`` looks up one op at a time (bisect on the
        # sorted lists gives np.searchsorted's answer)
        self._start, self._end = _op_times(problem)
        self._out_ns: dict[int, int] = {}
        self._in_ns: dict[int, int] = {}
        self.d2h = Channel()
        self.h2d = Channel()
        self.set_peak(in_peak)

    def set_peak(self, in_peak: np.ndarray) -> None:
        """Ops where a prefetch must not be triggered (the peak window)."""
        n = len(in_peak)
        idx = np.where(~np.asarray(in_peak, dtype=bool), np.arange(n), -1)
        self.prev_ok = np.maximum.accumulate(idx) if n else idx  # last allowed op <= k
        pk = np.where(np.asarray(in_peak, dtype=bool), np.arange(n), -1)
        self.last_peak = np.maximum.accumulate(pk) if n else pk  # last peak op <= k
        nxt = np.where(~np.asarray(in_peak, dtype=bool), np.arange(n), n)
        self.next_ok = np.minimum.accumulate(nxt[::-1])[::-1] if n else nxt  # first >= k
        self.next_ok = np.append(self.next_ok, n)  # so that next_ok[n] exists
        self._prev_ok = self.prev_ok.tolist()
        self._last_peak = self.last_peak.tolist()
        self._next_ok = self.next_ok.tolist()

    def out_time(self, size: int) -> int:
        t = self._out_ns.get(size)
        if t is None:
            t = self._out_ns[size] = int(round(size / self.p.bandwidth_d2h_bytes_per_s * 1e9))
        return t

    def in_time(self, size: int) -> int:
        t = self._in_ns.get(size)
        if t is None:
            t = self._in_ns[size] = int(round(size / self.p.bandwidth_h2d_bytes_per_s * 1e9))
        return t

    def free_time(self, size: int, a: int, b: int) -> int:
        """FT (paper Eq. 1) of evicting after op ``a`` and needing it at op ``b``, ideal case."""
        return int(self.start[b] - self.end[a]) - self.out_time(size) - self.in_time(size)

    def least_overhead(self, size: int, a: int, b: int) -> int:
        """A lower bound on ``estimate(size, a, b, ...).overhead_ns`` whatever its in-trigger:
        the in-copy of every option starts no earlier than the first free slot after the
        out-copy ends (``first_fit`` is monotone in its earliest start)."""
        t_out = self.out_time(size)
        t_in = self.in_time(size)
        out_end = self.d2h.first_fit(self._end[a], t_out) + t_out
        return max(0, self.h2d.first_fit(out_end, t_in) + t_in - self._start[b])

    def hidden_span(self, size: int, a: int, b: int) -> tuple[int, int] | None:
        """The ops that an ``estimate(size, a, b, ...)`` option without overhead can cover lie
        in the returned range (inclusive); None when every option has overhead
        (``least_overhead`` above zero). Every option's out-copy is the same and ends at
        ``out_end``; a copy that ends in time starts by ``start[b] - t_in``, and an option
        covers the ops from the first starting after ``out_end`` to the last ending by its
        copy's start (``_at``)."""
        t_out = self.out_time(size)
        t_in = self.in_time(size)
        out_end = self.d2h.first_fit(self._end[a], t_out) + t_out
        latest = self._start[b] - t_in
        if self.h2d.first_fit(out_end, t_in) > latest:
            return None
        lo = max(bisect_left(self._start, out_end), a + 1)
        return lo, min(bisect_right(self._end, latest) - 1, b - 1)

    def estimate(self, size: int, a: int, b: int, useful=None) -> SwapEstimate:
        """Swap-out after op ``a``, back at op ``b``, in-trigger per Note [In-trigger search].

        ``useful(lo, hi)`` says whether covering ops lo..hi helps; when the hidden trigger does
        not help (it would bring the storage back before the peak ops it should cover), the
        trigger moves after the last peak op of the gap (or on demand) and the wait is exposed.
        """
        t_out = self.out_time(size)
        t_in = self.in_time(size)
        start, next_ok = self._start, self._next_ok
        out_start = self.d2h.first_fit(self._end[a], t_out)
        out_end = out_start + t_out
        back = start[b]
        options = []
        slot = self.h2d.latest_fit(out_end, back, t_in)
        if slot is not None:  # walk back from the back-access, skipping the peak window
            k = min(bisect_right(start, slot) - 1, b - 1)
            k = self._prev_ok[k] if k >= 0 else -1
            if k > a:
                options.append(k)
        lp = self._last_peak[b - 1]  # move later: after the last peak op in the gap
        k = next_ok[lp + 1] if lp > a else next_ok[a + 1]
        options.append(k if k < b else None)
        k = max(a + 1, bisect_left(start, out_end))  # earliest
        k = next_ok[k] if k < len(next_ok) else b
        options.append(k if k < b else None)
        best = None
        for k in dict.fromkeys(options):
            e = self._at(k, a, b, out_start, out_end, t_in)
            ok = useful is None or useful(e.cover_lo, e.cover_hi)
            key = (not ok, e.overhead_ns)
            if best is None or key < best[0]:
                best = (key, e)
        return best[1]

    def _at(
        self, k: int | None, a: int, b: int, out_start: int, out_end: int, t_in: int
    ) -> SwapEstimate:
        start = self._start
        issue = start[k] if k is not None else start[b]
        in_start = self.h2d.first_fit(max(issue, out_end), t_in)
        in_end = in_start + t_in
        lo = bisect_left(start, out_end)
        hi = bisect_right(self._end, in_start) - 1
        return SwapEstimate(
            k,
            out_start,
            out_end,
            in_start,
            in_end,
            max(0, in_end - start[b]),
            max(lo, a + 1),
            min(hi, b - 1),
        )

    def reserve(self, e: SwapEstimate) -> None:
        self.d2h.reserve(e.out_start_ns, e.out_end_ns)
        self.h2d.reserve(e.in_start_ns, e.in_end_ns)


@dataclass(frozen=True)
class WrapEstimate:
    """A swap over a wrap-around gap (Note [Wrap-around swaps]). Times are on the unrolled
    timeline: iteration i from 0, iteration i+1 from ``T`` (the iteration time) on."""

    trigger_op: int | None  # op index of the in-trigger (iteration i if > evict_op, else i+1)
    out_start_ns: int
    out_end_ns: int
    in_start_ns: int
    in_end_ns: int
    overhead_ns: int  # exposed wait at the back-access (in iteration i+1)
    cover: tuple[tuple[int, int], ...]  # op ranges (inclusive) run entirely while it is out


# Note: [Wrap-around swaps]
# A storage with a wrap-around gap (problem.py Note [Wrap-around gaps]) is evicted after op ``a``
# (its last access) and needed before op ``b`` (its first access) of the next iteration. On the
# unrolled timeline (iteration i+1 starts at ``T``) this is an ordinary gap from end[a] to
# T + start[b], and the in-trigger search is Note [In-trigger search] on it: the latest op not in
# the peak window whose copy ends in time with the host->device channel free, either early in
# iteration i+1 (trigger <= b) or at the end of iteration i (trigger > a). Every iteration repeats
# the same copies, so the channels are one iteration long and a copy past ``T`` occupies them
# again from 0 (the steady state). What the swap saves is the ops it covers, in two ranges:
# after ``a`` to the end of iteration i, and from the start of iteration i+1 up to the swap-in.


def _wrap_reserve(ch: Channel, start: int, end: int, period: int) -> None:
    """Reserve [start, end) on a channel that repeats every ``period`` ns."""
    if period <= 0 or end <= start:
        return
    s, e = start % period, start % period + (end - start)
    if e <= period:
        ch.reserve(s, e)
    else:
        ch.reserve(s, period)
        ch.reserve(0, e - period)


def _wrap_fit(ch: Channel, earliest: int, dur: int, period: int) -> int:
    """``first_fit`` at or after ``earliest`` (unrolled time) on a channel repeating every
    ``period``."""
    if period <= 0 or earliest < period:
        return ch.first_fit(earliest, dur)
    base = (earliest // period) * period
    return base + ch.first_fit(earliest - base, dur)


def estimate_wrap(timer: SwapTimer, size: int, a: int, b: int, useful=None) -> WrapEstimate:
    """A swap-out after op ``a`` of iteration i, back before op ``b`` of iteration i+1; see
    Note [Wrap-around swaps]. ``useful(lo, hi)`` as in ``SwapTimer.estimate``.

    The unrolled ops are ops a+1..n-1 of iteration i, then 0..b of iteration i+1 (unrolled index
    ``v``: ``v < m`` is op a+1+v, else op v-m, shifted by ``T``); their start and end times are
    sorted, so each set the in-trigger search needs (the ops after the swap-out, those whose
    copy would end in time, those covered) is a range found by bisection on the problem's op
    times, and the peak window's allowed ops by the timer's prev/next tables."""
    p = timer.p
    n = p.n_ops
    T = int(timer.end[-1]) if n else 0
    start, end, prev_ok, next_ok = timer._start, timer._end, timer._prev_ok, timer._next_ok
    t_out, t_in = timer.out_time(size), timer.in_time(size)
    out_start = _wrap_fit(timer.d2h, end[a], t_out, T)
    out_end = out_start + t_out
    deadline = T + start[b]
    m = n - a - 1  # unrolled ops of iteration i
    last = m + b  # the back-access itself: not a trigger

    def real(v: int) -> int:
        return a + 1 + v if v < m else v - m

    def vstart(v: int) -> int:
        return start[a + 1 + v] if v < m else T + start[v - m]

    def first_start_ge(x: int) -> int:  # the first v whose start is >= x (last + 1: none)
        k = bisect_left(start, x, a + 1, n)
        if k < n:
            return k - a - 1
        return m + bisect_left(start, x - T, 0, b + 1)

    def last_start_le(x: int) -> int:  # the last v whose start is <= x (-1: none)
        k = bisect_right(start, x - T, 0, b + 1) - 1
        if k >= 0:
            return m + k
        return bisect_right(start, x, a + 1, n) - 1 - a - 1

    def last_end_le(x: int) -> int:  # the last v whose end is <= x (-1: none)
        k = bisect_right(end, x - T, 0, b + 1) - 1
        if k >= 0:
            return m + k
        return bisect_right(end, x, a + 1, n) - 1 - a - 1

    def prev_allowed(v: int) -> int:  # the last v' <= v outside the peak window (-1: none)
        if v >= m:
            r = prev_ok[v - m]
            if r >= 0:
                return m + r
            v = m - 1
        if v < 0:
            return -1
        r = prev_ok[a + 1 + v]
        return r - a - 1 if r > a else -1

    def next_allowed(v: int) -> int:  # the first v' >= v outside the peak window (> last: none)
        if v < m:
            r = next_ok[a + 1 + v]
            if r < n:
                return r - a - 1
            v = m
        return m + next_ok[v - m]

    def at(v: int | None) -> WrapEstimate:
        issue = vstart(v) if v is not None else deadline
        in_start = _wrap_fit(timer.h2d, max(issue, out_end), t_in, T)
        in_end = in_start + t_in
        lo, hi = first_start_ge(out_end), last_end_le(in_start)  # the ops covered: lo..hi
        rng = []
        if lo <= hi:
            if lo < m:  # contiguous in each iteration
                rng.append((a + 1 + lo, a + 1 + min(hi, m - 1)))
            if hi >= m:
                rng.append((max(lo, m) - m, hi - m))
        trig = None if v is None else real(v)
        return WrapEstimate(
            trig, out_start, out_end, in_start, in_end, max(0, in_end - deadline), tuple(rng)
        )

    options: list[int | None] = []
    first = first_start_ge(out_end)  # triggers issue after the swap-out
    # latest trigger whose copy ends in time, outside the peak window, channel free (of the
    # eight latest such triggers)
    v = prev_allowed(min(last - 1, last_start_le(deadline - t_in)))
    for _ in range(8):
        if v < first:
            break
        if _wrap_fit(timer.h2d, vstart(v), t_in, T) + t_in <= deadline:
            options.append(v)
            break
        v = prev_allowed(v - 1)
    # earliest allowed trigger after the swap-out, and on demand
    v = next_allowed(first)
    if v < last:
        options.append(v)
    options.append(None)
    best = None
    for v in dict.fromkeys(options):
        e = at(v)
        helps = useful is None or any(useful(lo, hi) for lo, hi in e.cover)
        key = (not helps, e.overhead_ns)
        if best is None or key < best[0]:
            best = (key, e)
    return best[1]


def reserve_wrap(timer: SwapTimer, e: WrapEstimate) -> None:
    """Reserve a wrap-around swap's copies on the timer's (one-iteration, repeating) channels."""
    T = int(timer.end[-1]) if len(timer.end) else 0
    _wrap_reserve(timer.d2h, e.out_start_ns, e.out_end_ns, T)
    _wrap_reserve(timer.h2d, e.in_start_ns, e.in_end_ns, T)


def wrap_free_time(timer: SwapTimer, size: int, a: int, b: int) -> int:
    """FT (paper Eq. 1) over a wrap-around gap: end of op ``a`` to op ``b`` of the next
    iteration."""
    T = int(timer.end[-1]) if len(timer.end) else 0
    return int(T + timer.start[b] - timer.end[a]) - timer.out_time(size) - timer.in_time(size)
