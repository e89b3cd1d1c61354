"""What a run reports: per-iteration statistics, the measured peak, the JSON report, the summary.

# Note: [Measured peak]
# ``peak_bytes`` comes from PyTorch's own allocator accounting, never from the runtime's
# bookkeeping. On CUDA it is ``torch.cuda.max_memory_allocated`` (reset at each iteration start)
# minus the memory a budget does not count, the same figure the cap and the budget guard use
# (cuBLAS workspaces and allocator rounding, Note [Budget and the allocator] in device.py), so
# that it compares with a budget of tensor bytes; the allocator's own figure is
# ``allocator_peak_bytes``. On CPU it is the
# profiler's allocator events (``torch.profiler`` with ``profile_memory=True``: each allocation
# and free with its address and size; live bytes rebuilt by address, Note [Profiler allocation
# offset]), taking the maximum inside each
# iteration's ``record_function`` range. The CPU allocator counts only blocks allocated while the
# profiler runs, so the runtime starts it on entry: with ``capuchin run`` that is before the
# script, so the model, the data and the optimizer state are counted as in the trace. Host
# buffers of swapped storages are numpy memory the allocator never sees (runtime/backend.py).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..outputs import write_text
from ..peak import peak_bytes, reset_peak
from ..tracer.timing import profiler_quiet, start_profiler_quietly

REPORT_FORMAT = "capuchin.run-report"
REPORT_VERSION = 1
_RANGE = "capuchin.iteration."


@dataclass
class IterationStats:
    """One iteration of a run (mutable while it runs)."""

    iteration: int
    peak_bytes: int | None = None  # tensor bytes (Note [Measured peak])
    allocator_peak_bytes: int | None = None  # CUDA: max_memory_allocated, non-tensor bytes too
    time_s: float = 0.0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    recomputed_ops: int = 0
    stall_s: float = 0.0
    late_prefetches: int = 0
    diverged: bool = False
    diverged_at: int | None = None  # op index of the first mismatch
    ops: int = 0
    evictions: int = 0  # planned evictions carried out
    passive_evictions: int = 0
    dynamic_drops: int = 0  # of those, dropped to be replayed (dynamic mode, runtime/guards/dtr.py)
    dynamic_swaps: int = 0  # of those, swapped by dynamic mode
    cow_restores: int = 0  # R3 regenerations before a source was overwritten
    fallback_swaps: int = 0  # planned drops swapped instead (not replayable)
    refused: int = 0  # planned evictions of storages that may not be evicted
    trigger_moves: int = 0  # in-triggers moved earlier after a late prefetch
    trigger_moves_refused: int = 0  # ... not moved: the plan's curve leaves no room in the budget
    complete: bool = True  # ended by an optimizer step (or capuchin.step())
    kind: str | None = None  # the plan's kind of iteration it ran under (Note [Iteration kinds])
    # unexpected ops skipped, the plan followed on after them (Note [Resync after an unexpected
    # op] in tracker.py)
    resynced_ops: int = 0
    # the most that passive mode's resident bytes (plus the next op's allocation) stayed over the
    # budget with nothing left it may evict (Note [Passive budget on CPU] in guards/lru.py); 0 when
    # the budget was kept
    passive_short_bytes: int = 0
    # CUDA: bytes the allocator cap was raised by in this iteration, each time an out-of-memory
    # error under it found nothing to evict (Note [Lifting the cap] in engine.py)
    cap_lifted_bytes: int = 0


@dataclass
class RunReport:
    budget_bytes: int | None
    device: str
    plan: str | None
    iterations: list[IterationStats]
    # iterations before it run before any plan applies (model building, warm-up): not counted
    # as diverged in the summary (Note [Distributed warm-up] in distributed.py)
    first_checked_iteration: int = 1
    ops_checked: bool = True  # False: an empty plan installed nothing (Note [Empty plan])

    def to_dict(self) -> dict:
        return {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "budget_bytes": self.budget_bytes,
            "device": self.device,
            "plan": self.plan,
            "ops_checked": self.ops_checked,
            "iterations": [asdict(s) for s in self.iterations],
        }

    def save(self, path: str | os.PathLike, force: bool = True) -> Path:
        """Write the JSON report atomically; without ``force`` an existing file is kept
        (``OutputExistsError``)."""
        return write_text(path, json.dumps(self.to_dict(), indent=1), force=force)

    @property
    def steady(self) -> list[IterationStats]:
        """Complete iterations after the first (the first builds optimizer state and warms up)."""
        done = [s for s in self.iterations if s.complete]
        return done[1:] if len(done) > 1 else done

    def summary(self) -> str:
        """A few lines for the terminal."""
        its = self.iterations
        if not its:
            return "capuchin run: no iteration completed (no optimizer step was seen)"
        st = self.steady
        peak = max((s.peak_bytes or 0) for s in its)
        steady_peak = max((s.peak_bytes or 0) for s in st)
        t = statistics.median(s.time_s for s in st)  # robust to a host's other jobs
        lines = [
            f"capuchin run: {len(its)} iterations on {self.device}"
            + (f", budget {_mb(self.budget_bytes)}" if self.budget_bytes else "")
        ]
        if any(s.peak_bytes is not None for s in its):
            fit = ""
            if self.budget_bytes:
                fit = f" ({steady_peak / self.budget_bytes:.0%} of budget)"
            lines.append(f"  peak {_mb(steady_peak)} steady{fit}, {_mb(peak)} over all iterations")
        profiled = str(self.device).startswith("cpu") and any(
            s.peak_bytes is not None for s in its
        )  # Note [Measured peak]: on CPU the peaks come from the profiler, which slows every op
        lines.append(
            f"  time {t * 1e3:.1f} ms/iteration (steady median"
            + (
                "; the CPU memory profiler was on and slows ops: --no-measure times without it)"
                if profiled
                else ")"
            )
        )
        lines.append(
            f"  swapped out {_mb(sum(s.swapped_out_bytes for s in its))}, in "
            f"{_mb(sum(s.swapped_in_bytes for s in its))}; recomputed ops "
            f"{sum(s.recomputed_ops for s in its)}; stalls {sum(s.stall_s for s in its) * 1e3:.1f} ms;"
            f" late prefetches {sum(s.late_prefetches for s in its)}"
        )
        if not self.ops_checked:
            lines.append(
                "  the plan evicts nothing: nothing was installed, ops were not checked "
                "against the trace"
            )
            return "\n".join(lines)
        div = [
            s.iteration for s in its if s.diverged and s.iteration >= self.first_checked_iteration
        ]
        lines.append(
            f"  diverged from the plan: {len(div)} iteration(s)"
            + (f" {div[:8]}" if div else "")
            + f"; passive evictions {sum(s.passive_evictions for s in its)}"
        )
        short = max(
            (short_of(s, self.budget_bytes) for s in its if s.passive_short_bytes), default=0
        )
        if short:
            lines.append(
                f"  budget not reachable: up to {_mb(short)} over it with nothing left "
                f"to evict (passive_short_bytes in the report)"
            )
        return "\n".join(lines)


def short_of(s, budget_bytes: int | None) -> int:
    """How far iteration ``s``, which passive mode could not keep within the budget, went over
    it: the estimate's shortfall (``passive_short_bytes``) or, when larger, the measured peak's
    excess (memory the estimate did not see), so the line agrees with the measured peak."""
    if s.peak_bytes is None or budget_bytes is None:
        return s.passive_short_bytes
    return max(s.passive_short_bytes, s.peak_bytes - budget_bytes)


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


class MemoryMeter:
    """Per-iteration peak from PyTorch's allocator accounting (Note [Measured peak])."""

    def __init__(self, device: torch.device):
        self.device = device
        self.prof = None
        self._handle = None
        self._cuda_peaks: dict[int, int] = {}
        # CUDA: what the budget does not count, subtracted from the allocator's peak (Note
        # [Measured peak]); set by the runtime with its cap
        self.non_tensor_bytes = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            return
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(
            activities=[ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=False,
            with_stack=False,
        )
        start_profiler_quietly(self.prof.__enter__)  # Note [Profiler noise] in tracer/timing.py

    def iteration_start(self, n: int) -> None:
        with _disable_current_modes():
            if self.device.type == "cuda":
                reset_peak(self.device)  # Note [One peak counter] in peak.py
            elif self.prof is not None:
                self._handle = torch.ops.profiler._record_function_enter_new(f"{_RANGE}{n}", None)

    def iteration_end(self, n: int) -> None:
        with _disable_current_modes():
            if self.device.type == "cuda":
                self._cuda_peaks[n] = peak_bytes(self.device)
            elif self._handle is not None:
                torch.ops.profiler._record_function_exit._RecordFunction(self._handle)
                self._handle = None

    def allocator_peaks(self) -> dict[int, int]:
        """CUDA: iteration -> the allocator's own peak (``max_memory_allocated``); else empty."""
        return dict(self._cuda_peaks)

    def finish(self) -> dict[int, int]:
        """Stop measuring; returns iteration -> peak bytes (on CUDA, of tensor bytes)."""
        if self.device.type == "cuda":
            return {n: max(0, b - self.non_tensor_bytes) for n, b in self._cuda_peaks.items()}
        if self.prof is None:
            return {}
        prof, self.prof = self.prof, None
        with _disable_current_modes(), profiler_quiet():
            prof.__exit__(None, None, None)
        return cpu_peaks(prof)


def cpu_peaks(prof) -> dict[int, int]:
    """Peak of the CPU allocator's live bytes inside each ``capuchin.iteration.N`` range, from
    the profiler's allocation events (Note [Profiler allocation offset])."""
    import bisect

    from torch._C._profiler import _EventType

    ranges: list[tuple[int, int, int]] = []
    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        if ev.tag == _EventType.Allocation:
            a = ev.extra_fields
            if a.device.type == "cpu":
                events.append((ev.start_time_ns, a.ptr, a.alloc_size))
        elif ev.tag == _EventType.TorchOp and ev.name.startswith(_RANGE):
            ranges.append((ev.start_time_ns, ev.end_time_ns, int(ev.name[len(_RANGE) :])))
    times, values = live_bytes_series(events)
    peaks: dict[int, int] = {}
    for t0, t1, n in ranges:
        lo = bisect.bisect_left(times, t0)
        hi = bisect.bisect_right(times, t1)
        if hi > lo:
            peaks[n] = max(values[lo:hi])
    return peaks


def live_bytes_series(events: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    """``(times, live bytes after each event)`` from allocator events ``(time_ns, ptr, size)``
    (size < 0 for a free). Note: [Profiler allocation offset]
    The allocator's own running total ("Total Allocated") is process-global: a block allocated
    while an *earlier* profiler ran stays in its size table, and when it is freed inside this
    window the total drops by its size (seen in CI: -0.9 to -1.5 MB when an earlier test's
    objects were released mid-iteration). So the total is rebuilt from the events by address:
    allocations seen in this window count until their own free; a free of a block allocated
    before the window is ignored, which is what the allocator itself does with blocks allocated
    before any profiler ran. With ``capuchin run`` (a fresh process, profiler started before the
    script) both readings agree."""
    live: dict[int, int] = {}
    total = 0
    times: list[int] = []
    values: list[int] = []
    for t, ptr, size in sorted(events):
        if size > 0:
            total += size - live.get(ptr, 0)
            live[ptr] = size
        elif ptr in live:
            total -= live.pop(ptr)
        times.append(t)
        values.append(total)
    return times, values
