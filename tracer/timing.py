"""Per-op device times and allocator peaks from a ``torch.profiler`` run of the recorded iterations.

Every indexed op runs inside a ``record_function`` range named ``capuchin#{iteration}:{op_index}``
(``marker_name``). Matching profiler events to trace ops by that name is exact; matching them by
order is not (the prototype report, §2: autograd-internal ops have no profiler event of their own).

# Note: [Device timeline]
# CUDA: an op's duration is the sum of the kernels it launched (CUPTI, through Kineto), its start
# is its first kernel's start, relative to the iteration's first kernel; ops that launch nothing
# start where the previous op ended and last 0 ns. Kernels run asynchronously, so the tracer's
# Python overhead (which only delays launches) does not show unless it starves the GPU.
# CPU: the device is the CPU itself, so an op's duration is its CPU time inside the range, and ops
# are laid back to back (start = sum of the durations of the earlier ops of the iteration): the
# gaps between ranges are the tracer's own Python (and the script's), which a GPU timeline would
# not show either.
"""

from __future__ import annotations

import bisect
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

MARKER_PREFIX = "capuchin#"

# Note: [Profiler noise]
# Starting and stopping torch.profiler prints ``USDT:... profiler_start`` / ``profiler_stop``
# lines from native code straight to file descriptor 2, into the user's output on every trace
# and every measured run. ``profiler_quiet`` runs a start or a stop with descriptor 2 sent to a
# temporary file and writes back whatever else arrived there. Only capuchin's own calls run in
# between, never the script. The CPU allocator warns once per process ("Memory block of unknown
# size was allocated before the profiling started") when a block allocated before the profiler
# started is freed while it runs, which the script's ops would do at some point of the run; the
# start frees such a block itself, inside the quiet section, so the one warning is spent there.
_PROFILER_NOISE = re.compile(
    r"^(USDT:.*\] profiler_(start|stop)|\[W.*CPUAllocator\.cpp:\d+\] Memory block of unknown size)"
)


def start_profiler_quietly(start) -> None:
    """Call ``start()`` (a profiler's) under ``profiler_quiet``, with the allocator's one-time
    warning spent (Note [Profiler noise])."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    with profiler_quiet(), _disable_current_modes():  # not an op of the script
        block = torch.empty(64, device="cpu")  # allocated before the start ...
        start()
        del block  # ... freed after it: the warning, now


@contextmanager
def profiler_quiet() -> Iterator[None]:
    """Note [Profiler noise]."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode("utf-8", "replace").splitlines(keepends=True)
            rest = "".join(ln for ln in lines if not _PROFILER_NOISE.match(ln))
            if rest:
                os.write(2, rest.encode("utf-8"))


def marker_name(iteration: int, op_index: int) -> str:
    """The ``record_function`` name that carries an op's identity into the profiler."""
    return f"{MARKER_PREFIX}{iteration}:{op_index}"


def _parse_marker(name: str) -> tuple[int, int] | None:
    if not name.startswith(MARKER_PREFIX):
        return None
    it, _, k = name[len(MARKER_PREFIX) :].partition(":")
    try:
        return int(it), int(k)
    except ValueError:
        return None


@dataclass(frozen=True)
class ProfileTimes:
    """What the profiler measured for the recorded iterations.

    op_times: (iteration, op_index) -> (start_ns, duration_ns) on the device timeline, relative to
        the iteration start (Note [Device timeline]).
    allocator_peak_bytes: iteration -> peak of the bytes allocated *inside* that iteration and not
        yet freed, from the allocator's own events (profile_memory=True) on the traced device.
        Frees of blocks allocated before the iteration are not subtracted, exactly like the CPU
        allocator's "Total Allocated" over a one-iteration profiling window.
    op_alloc_peak_bytes: (iteration, op_index) -> the highest point, relative to the op's start,
        of the allocator's running balance (allocations minus frees) inside the op's range: what
        the op's kernels needed at once, outputs and temporary workspace together.
    live_peak_bytes: iteration -> the most bytes live in the allocator during it, every block
        allocated since the profiler started counted until its free (by address, as the
        runtime's measured peak). The whole memory only when the profiler started before the
        script (tracing under a budget, Note [Tracing under a budget] in tracer/record.py).
    """

    op_times: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    allocator_peak_bytes: dict[int, int] = field(default_factory=dict)
    op_alloc_peak_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    live_peak_bytes: dict[int, int] = field(default_factory=dict)


def parse_profile(prof, device_type: str) -> ProfileTimes:
    """Extract op times and allocator peaks from a stopped ``torch.profiler.profile``."""
    results = prof.profiler.kineto_results
    events = results.events()
    ranges: dict[tuple[int, int], tuple[int, int, int, int]] = {}  # key -> start, end, thread, corr
    for e in events:
        key = _parse_marker(e.name())
        if (
            key is not None
            and str(e.device_type()).endswith("CPU")
            and (key not in ranges or e.start_ns() > ranges[key][0])
        ):  # a retried op: the last run
            ranges[key] = (
                e.start_ns(),
                e.start_ns() + e.duration_ns(),
                e.start_thread_id(),
                e.correlation_id(),
            )
    if device_type == "cuda":
        op_times = _cuda_times(events, ranges)
    else:
        op_times = _cpu_times(ranges)
    allocs = _allocations(results, device_type)
    return ProfileTimes(
        op_times=op_times,
        allocator_peak_bytes=_allocator_peaks(allocs, ranges),
        op_alloc_peak_bytes=_op_alloc_peaks(allocs, ranges),
        live_peak_bytes=_live_peaks(allocs, ranges),
    )


def _cpu_times(ranges) -> dict:
    out = {}
    clock: dict[int, int] = {}
    for key in sorted(ranges):
        it = key[0]
        start, end, _, _ = ranges[key]
        dur = end - start
        t = clock.get(it, 0)
        out[key] = (t, dur)
        clock[it] = t + dur
    return out


def _cuda_times(events, ranges) -> dict:
    """Sum each op's kernels. A kernel is linked (``linked_correlation_id``) to the CPU op that
    launched it (an aten op nested in our range, or the range itself); that op is attributed to the
    ``capuchin#`` range that contains it on the same thread."""
    by_corr = {}  # correlation id of a CPU-side op -> (thread, start_ns)
    for e in events:
        if str(e.device_type()).endswith("CPU") and e.linked_correlation_id() == 0:
            by_corr[e.correlation_id()] = (e.start_thread_id(), e.start_ns())
    range_by_corr = {v[3]: k for k, v in ranges.items()}
    per_thread: dict[int, list] = {}
    for key, (start, end, thread, _) in ranges.items():
        per_thread.setdefault(thread, []).append((start, end, key))
    for lst in per_thread.values():
        lst.sort()
    starts = {th: [r[0] for r in lst] for th, lst in per_thread.items()}

    def enclosing(thread, t):
        lst = per_thread.get(thread)
        if not lst:
            return None
        i = bisect.bisect_right(starts[thread], t) - 1
        if i >= 0 and lst[i][0] <= t <= lst[i][1]:
            return lst[i][2]
        return None

    kernels: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for e in events:
        if not str(e.device_type()).endswith("CUDA"):
            continue
        corr = e.linked_correlation_id()
        key = range_by_corr.get(corr)
        if key is None and corr in by_corr:
            key = enclosing(*by_corr[corr])
        if key is not None:
            kernels.setdefault(key, []).append((e.start_ns(), e.duration_ns()))

    out = {}
    for it in sorted({k[0] for k in ranges}):
        keys = sorted(k for k in ranges if k[0] == it)
        firsts = [min(s for s, _ in kernels[k]) for k in keys if k in kernels]
        origin = min(firsts) if firsts else 0
        t_end = 0
        for key in keys:
            ks = kernels.get(key)
            if ks:
                start = min(s for s, _ in ks) - origin
                dur = sum(d for _, d in ks)
            else:
                start, dur = t_end, 0
            out[key] = (start, dur)
            t_end = max(t_end, start + dur)
    return out


def _allocations(results, device_type: str) -> list[tuple[int, int, int]]:
    """The allocator's events on the traced device: (time_ns, ptr, +bytes | -bytes), by time."""
    try:
        from torch._C._profiler import _EventType
    except ImportError:  # pragma: no cover - very old torch
        return []
    allocs = []
    stack = list(results.experimental_event_tree())
    while stack:
        n = stack.pop()
        stack.extend(n.children)
        if n.typed[0] == _EventType.Allocation:
            f = n.typed[1]
            dev = getattr(f, "device", None)
            if dev is not None and getattr(dev, "type", device_type) != device_type:
                continue
            allocs.append((n.start_time_ns, f.ptr, f.alloc_size))
    allocs.sort(key=lambda a: a[0])
    return allocs


def _allocator_peaks(allocs, ranges) -> dict[int, int]:
    """Per iteration, the peak of (bytes allocated in the iteration - their frees so far)."""
    if not ranges:
        return {}
    it_start = {}
    for (it, _), (start, _, _, _) in ranges.items():
        it_start[it] = min(start, it_start.get(it, start))
    order = sorted(it_start, key=it_start.get)
    bounds = [it_start[i] for i in order]
    peaks = {i: 0 for i in order}
    live = {i: 0 for i in order}
    owner: dict[int, int] = {}  # ptr -> iteration that allocated the live block
    for t, ptr, size in allocs:
        j = bisect.bisect_right(bounds, t) - 1
        if j < 0:
            continue
        it = order[j]
        if size > 0:
            owner[ptr] = it
            live[it] += size
            peaks[it] = max(peaks[it], live[it])
        else:
            src = owner.pop(ptr, None)
            if src is not None:
                live[src] += size
    return peaks


def _live_peaks(allocs, ranges) -> dict[int, int]:
    """Per iteration (from its first op's start to the next iteration's), the most bytes live,
    rebuilt by address from every allocation event of the profiler (Note [Profiler allocation
    offset] in runtime/report.py: a free of a block allocated before the profiler is ignored)."""
    if not ranges:
        return {}
    it_start: dict[int, int] = {}
    for (it, _), (start, _, _, _) in ranges.items():
        it_start[it] = min(start, it_start.get(it, start))
    order = sorted(it_start, key=it_start.get)
    bounds = [it_start[i] for i in order]
    live: dict[int, int] = {}
    total = 0
    peaks: dict[int, int] = {}
    for t, ptr, size in allocs:
        if size > 0:
            total += size - live.get(ptr, 0)
            live[ptr] = size
        elif ptr in live:
            total -= live.pop(ptr)
        j = bisect.bisect_right(bounds, t) - 1
        if j >= 0 and total > peaks.get(order[j], -1):
            peaks[order[j]] = total
    return peaks


def _op_alloc_peaks(allocs, ranges) -> dict[tuple[int, int], int]:
    """Per op range, the max of the running allocation balance from the range's start."""
    spans = sorted((start, end, key) for key, (start, end, _, _) in ranges.items())
    starts = [s[0] for s in spans]
    peak: dict[tuple[int, int], int] = {}
    run: dict[tuple[int, int], int] = {}
    for t, _, size in allocs:
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t > spans[i][1]:
            continue
        key = spans[i][2]
        r = run.get(key, 0) + size
        run[key] = r
        if r > peak.get(key, 0):
            peak[key] = r
    return peak
