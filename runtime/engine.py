"""``Runtime``: train under a plan. ``with capuchin.Runtime(plan): train()``; ``capuchin run`` is the
same code around the unmodified script (runtime/launch.py).

The runtime carries out the plan; it plans nothing. What it decides while running is small and
named: on-demand restores (tracker.py), eviction over budget where no plan applies (the
plan-less guards in guards/, with the device's memory accounting in memory.py), late-prefetch
feedback (tracker.py), drops that cannot be replayed exactly become swaps (recompute.py). It reads the plan alone: no
trace is loaded at run time.

# Note: [Reads outside ops]
# An evicted storage comes back when an op reads it; a script may also read bytes without any op.
# ``torch.save`` (a checkpoint, often written after the last step, where passive mode may have
# evicted what it saves) is the common case: the runtime replaces ``torch.save`` while it runs
# with one that restores every evicted storage first (without it, the state a torchrun job saved
# after its last step held 0-byte storages and failed to load). The other raw reads
# (``Tensor.numpy()``, ``tolist()``, ``data_ptr()``, ...) restore what they read themselves,
# at any time (Note [Raw reads] in rawreads.py): wrap-around swaps and dynamic mode keep
# storages out between steps.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..distributed import default_warmup, per_rank, say, world
from ..errors import CapuchinError, PlanFormatError, RegionTagsRefused
from ..outputs import check_output
from ..planner.plan import Plan, load_plan
from ..tracer.hooks import OpIndexer
from ..tracer.optimizer_chunks import ChunkedOptimizers
from ..units import BudgetError
from . import rawreads, threads
from .actions import compile_plan
from .backend import backend_for
from .device import (
    LARGE_SEGMENT,
    OOMWatch,
    cap_bytes,
    cudnn_problem,
    determinism_problem,
    resolve_run_device,
    run_non_tensor_bytes,
    segment_bytes,
)
from .guards import EVICTIONS, REMAT, Guard, make_guard
from .recompute import RecomputeEngine
from .report import IterationStats, MemoryMeter, RunReport, short_of
from .swap import SwapEngine
from .tracker import Executor


def rank_plan_path(plan: str | os.PathLike) -> str | os.PathLike:
    """This rank's plan under a world of several ranks (``p.rank{R}.json`` when it exists, else
    ``p.json`` itself: one plan for every rank); ``plan`` as given in a single process."""
    rank, size = world()
    if size > 1 and not Path(plan).stem.endswith(f".rank{rank}"):
        mine = per_rank(plan)
        if mine.is_file() or not os.path.exists(plan):
            return mine
    return plan


def _is_path(plan) -> bool:
    return isinstance(plan, (str, os.PathLike))


def _budget(budget_bytes) -> int:
    """``budget_bytes`` as the integer number of bytes it is, at least 1 (as ``--budget``)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)):
        raise BudgetError(f"budget_bytes {budget_bytes!r}: expected a number of bytes")
    if budget_bytes != budget_bytes or budget_bytes in (float("inf"), float("-inf")):
        raise BudgetError(f"budget_bytes {budget_bytes!r}: not a finite number of bytes")
    if budget_bytes < 1 or int(budget_bytes) != budget_bytes:
        raise BudgetError(f"budget_bytes {budget_bytes!r}: expected a whole number of bytes >= 1")
    return int(budget_bytes)


def _empty(plan: Plan | None) -> bool:
    """A plan that evicts nothing in any kind of iteration (the baseline fits its budget)."""
    return plan is not None and not plan.decisions and all(not k.decisions for k in plan.kinds)


class _StepClock(OpIndexer):
    """What an empty plan installs (Note [Empty plan]): the optimizer step hooks only, which end
    one iteration and start the next for the report; no dispatch mode, nothing per op (so
    torch.compile is not refused either: Note [torch.compile] in tracer/compiled.py)."""

    guards_compile = False

    def __init__(self, runtime: Runtime):
        super().__init__()
        self._rt = runtime

    def mark_step(self, *args, **kwargs) -> None:
        super().mark_step(*args, **kwargs)
        rt = self._rt
        rt._t_step = time.perf_counter()
        rt._iteration_end(rt._cur.iteration, -1)
        rt._iteration_start(rt._cur_n + 1)


class _Indexer(OpIndexer):
    """The tracer's op indexer, plus: every step end restores all evicted storages at once (the
    script may read tensors outside ops between steps)."""

    def __init__(self, runtime: Runtime, **kw):
        super().__init__(**kw)
        self._rt = runtime

    def _pre_step(self, *args, **kwargs):
        threads.refuse_step(self._rt)  # Note [Other threads] in threads.py
        return super()._pre_step(*args, **kwargs)

    def mark_step(self, *args, **kwargs) -> None:
        super().mark_step(*args, **kwargs)
        self._rt._step_end()


class Runtime:
    """Enforce ``plan`` (a ``Plan``, a path to a plan file, or None) while the code inside the
    ``with`` block trains.

    budget_bytes: the memory budget (default: the plan's). Without a plan, the whole run is in
        passive mode under this budget.
    device: the device whose memory is managed (default or ``"auto"``: the plan's provenance
        device; without a plan cpu where CUDA is not available, and refused where it is: name
        it). An index-less ``"cuda"`` is this rank's GPU (Note [Per-rank device] in device.py).
    passive: evict on demand where no plan applies (no plan, iteration 0, divergence).
    eviction: how, where no plan applies: "dtr" (dynamic mode, runtime/guards/dtr.py: DTR's
        heuristic; dropped storages are replayed, the others swapped) or "lru" (swap the least
        recently used storage synchronously, paper §4.2).
    remat: dynamic mode's way back: "auto" (the cheaper of replay and swap by measured costs),
        "recompute" (replay whatever replays exactly), "swap" (never replay).
    measure_memory: measure each iteration's peak with PyTorch's allocator accounting (Note
        [Measured peak] in report.py); costs profiler overhead on CPU.
    report_path: write the JSON report there on exit; checked now, before any training (Note
        [Output files] in outputs.py): an existing file is kept unless ``force``.
    lift_cap: on CUDA, raise the allocator cap where an out-of-memory error under it finds
        nothing to evict, with a warning (Note [Lifting the cap]); False: the error reaches the
        script (a cap that must hold: tracing under a budget, max-batch's verifying run).

    After the block, ``report`` holds a ``RunReport``.

    # Note: [Empty plan]
    # A plan that evicts nothing (the traced peak fits the budget) installs nothing per op: no
    # dispatch mode, no op checks, no budget guard; only the optimizer step hooks that time each
    # iteration for the report (and the profiler when ``measure_memory``). Its run costs what
    # plain training costs. A run that then differs from the trace (another batch size) is not
    # noticed; ``Runtime(budget_bytes=...)`` guards a budget without a plan.
    """

    def __init__(
        self,
        plan: Plan | str | os.PathLike | None = None,
        *,
        budget_bytes: int | None = None,
        device: str | torch.device | None = None,
        passive: bool = True,
        eviction: str = "dtr",
        remat: str = "auto",
        measure_memory: bool = True,
        report_path: str | os.PathLike | None = None,
        force: bool = False,
        lift_cap: bool = True,
    ):
        if budget_bytes is not None:
            budget_bytes = _budget(budget_bytes)
        if report_path is not None:
            check_output(report_path, force=force, inputs=[plan if _is_path(plan) else None])
        self.force = force
        if isinstance(plan, (str, os.PathLike)):
            plan = rank_plan_path(plan)  # Note [Per-rank files] in distributed.py
            self.plan_source = str(plan)
            plan = load_plan(plan)
        else:
            self.plan_source = "<plan>"
        self.plan = plan
        if plan is None and budget_bytes is None:
            raise PlanFormatError("Runtime needs a plan or a budget_bytes (passive mode)")
        self.budget_bytes = int(budget_bytes if budget_bytes is not None else plan.budget_bytes)
        self.device = resolve_run_device(device, plan)  # Note [Per-rank device] in device.py
        self._check_region_tags()  # before CUDA is looked for: refused on a GPU either way
        self._partitioner = None
        planned = plan.provenance.device if plan is not None else None
        if planned and torch.device(planned).type != self.device.type:
            raise PlanFormatError(
                f"{self.plan_source}: plan is for {planned}, but the run manages {self.device}; "
                "make a plan from a trace of this device"
            )
        if self.device.type == "cuda" and not torch.cuda.is_available():
            if plan is None:
                raise PlanFormatError(f"device {self.device}: CUDA is not available here")
            raise PlanFormatError(
                f"{self.plan_source}: plan is for {self.device}, but CUDA is not "
                "available here; make a plan from a trace of this device"
            )
        self.passive_enabled = passive
        if eviction not in EVICTIONS or remat not in REMAT:
            raise PlanFormatError(
                f"eviction must be dtr or lru (got {eviction!r}), remat one of "
                f"{', '.join(REMAT)} (got {remat!r})"
            )
        self.eviction = eviction
        self.remat = remat
        self.measure_memory = measure_memory
        self.report_path = report_path
        # CAPUCHIN_VERIFY=1: keep a copy of every evicted storage and check it comes back equal
        self.verify = os.environ.get("CAPUCHIN_VERIFY", "") not in ("", "0")
        self.bandwidth_h2d_bytes_per_s = plan.provenance.bandwidth_h2d_bytes_per_s if plan else 12e9
        # iteration 0 runs everything before the first step (model creation, optimizer state
        # init), so it never matches a steady plan; a foreign plan is refused at iteration 1.
        self.first_checked_iteration = default_warmup()  # Note [Distributed warm-up]
        self.report: RunReport | None = None
        self._iters: list[IterationStats] = []
        self._cur: IterationStats | None = None
        self._t0 = 0.0
        self._t_step = None
        self._fraction_set = False
        self._entered = False
        # the CUDA allocator cap (Note [Budget and the allocator] in device.py)
        self.cap_bytes: int | None = None
        self.non_tensor_bytes = 0  # CUDA: what the budget does not count (_count_non_tensor)
        self.oom_watch: OOMWatch | None = None  # Note [Out-of-memory errors caught inside an op]
        self.lift_cap_allowed = lift_cap
        # an installed indexer whose step hooks this runtime's follow (Note [Indexers that
        # follow another] in tracer/hooks.py): the host-cost calibration's, entered in a step hook
        self._step_leader = None

    # ---- context manager ----------------------------------------------------------------------------
    def __enter__(self) -> Runtime:
        if self._entered:
            raise CapuchinError(
                "this Runtime is already active (entered and not exited): a Runtime manages "
                "one block at a time; nest another Runtime object instead"
            )
        self._entered = True
        try:
            return self._enter()
        except BaseException:
            self._entered = False
            raise

    def _check_region_tags(self) -> None:
        """Refuse up front a plan whose region tags cannot be compiled in exactly (Note [Region
        tags] in tracer/region_tags.py): proposed but not traced, or on a GPU."""
        rt = self.plan.region_tags if self.plan is not None else None
        if rt is None:
            return
        if not rt.traced:
            raise RegionTagsRefused(
                f"{self.plan_source}: the plan proposes recompute tags inside compiled regions "
                "that its trace was not recorded with: trace again with them (capuchin trace "
                "--plan PLAN SCRIPT) and plan that trace"
            )
        if self.device.type != "cpu":
            raise RegionTagsRefused(
                f"{self.plan_source}: recompute tags inside compiled regions are refused on "
                f"{self.device.type}: their bit-identity is checked by a verifying run, and "
                "none has run on a GPU"
            )

    def _install_region_tags(self) -> None:
        """Compile with the plan's region tags (Note [Region tags]): the regions the trace saw."""
        if self.plan is not None and self.plan.region_tags is not None:
            from ..tracer import region_tags

            self._partitioner = region_tags.install(self.plan.region_tags.tags)

    def _uninstall_region_tags(self) -> None:
        if self._partitioner is not None:
            from ..tracer import region_tags

            region_tags.uninstall()
            self._partitioner = None

    def _enter(self) -> Runtime:
        self._install_region_tags()
        try:
            return self._enter_tagged()
        except BaseException:
            self._uninstall_region_tags()
            raise

    def _enter_tagged(self) -> Runtime:
        if _empty(self.plan):
            return self._enter_empty()
        self.backend = backend_for(self.device, self.plan)
        self.indexer = _Indexer(
            self, on_iteration_start=self._iteration_start, on_iteration_end=self._iteration_end
        )
        table = compile_plan(self.plan) if self.plan is not None else None
        swap = SwapEngine(
            self.backend,
            self.plan.provenance.bandwidth_d2h_bytes_per_s if self.plan is not None else 12e9,
        )
        swap.lift_cap = self.lift_cap  # Note [Lifting the cap]
        memory = self.backend.memory
        budget = self.budget_bytes if self.passive_enabled else None
        self.ex = None
        recompute = RecomputeEngine(lambda st: self.ex.ensure_resident(st), self._may_keep)
        recompute.device_type = self.device.type
        self.ex = Executor(
            self,
            self.indexer,
            table,
            swap,
            recompute,
            lambda ex: self._guard(budget, memory, swap, ex),
            self.backend,
        )
        if self.plan is not None:  # Note [Iteration kinds] in tracker.py
            self.ex.kind_tables += [compile_plan(k) for k in self.plan.kinds]
            self.ex.check_shape_kinds()
        self._iters = []
        self.meter = MemoryMeter(self.device) if self.measure_memory else None
        if self.device.type == "cuda":
            self._count_non_tensor(memory)
        if self.device.type == "cuda" and self.budget_bytes:
            self._set_cap()
        if self.device.type == "cuda":  # Note [Out-of-memory errors caught inside an op]
            self.oom_watch = OOMWatch(self.device)
        ops = (o[0] for p in (self.plan, *self.plan.kinds) for o in p.ops) if self.plan else ()
        for why in (
            determinism_problem(self.device, self._replays()),
            cudnn_problem(self.device, ops, self.cap_bytes),
        ):
            if why is not None:
                say(why)
        if self.meter is not None:
            self.meter.start()
        self.indexer.install(self._step_leader)
        self._patch_save()
        rawreads.install(self.ex)
        self.thread_id = threading.get_ident()
        self.refusal = None
        threads.install(self, self.ex)
        # Note [Multi-tensor optimizers per chunk] in tracer/optimizer_chunks.py: as the tracer
        self._chunks = ChunkedOptimizers().__enter__()
        self.ex.mode.__enter__()
        return self

    def _count_non_tensor(self, memory) -> None:
        """CUDA: what the budget does not count (Note [Budget and the allocator] in device.py),
        made real first (the cuBLAS workspaces, ``warm_cublas``) so that subtracting it from the
        allocator's count is exact from the first op; the guard's count (``memory``) and the
        measured peaks (Note [Measured peak] in report.py) subtract the same figure."""
        measured = getattr(self.plan.provenance, "device_non_tensor_bytes", 0) if self.plan else 0
        self.non_tensor_bytes = run_non_tensor_bytes(self.device, measured)
        if memory is not None and hasattr(memory, "non_tensor_bytes"):
            memory.non_tensor_bytes = self.non_tensor_bytes
        if getattr(self, "meter", None) is not None:
            self.meter.non_tensor_bytes = self.non_tensor_bytes

    def lift_cap(self, need: int) -> bool:
        """Raise the allocator cap by what an op (or a restore) that met it could not get.

        # Note: [Lifting the cap]
        # The cap limits what the allocator *reserves*; its headroom over the budget (Note
        # [Budget and the allocator] in device.py) covers one new segment and rounding, not every
        # fragmentation: on the H200 dynamic mode met it with 7.5 MiB reserved but unallocated in
        # partly used segments and a 20 MiB segment asked for, and with nothing left to evict
        # the error killed the run, on a GPU with 139 GiB free. Evicting frees blocks, not
        # segments, so where nothing is left to evict the cap, not the device, is what fails.
        # Then the runtime raises the cap by one segment for the request (at least 20 MiB, never
        # past the device's memory), retries, and counts the bytes in the iteration's
        # ``cap_lifted_bytes``; the run ends with a warning naming the iterations. Training is
        # unchanged (no op is skipped or altered); the memory used went over what the budget
        # promised, and the warning says so. Where the cap must hold (tracing under a budget,
        # max-batch's verifying run: ``lift_cap=False``), or it is already the whole device, the
        # error reaches the script as before."""
        if not (self.lift_cap_allowed and self._fraction_set and self.cap_bytes):
            return False
        total = torch.cuda.get_device_properties(self.device).total_memory
        if self.cap_bytes >= total:
            return False
        step = max(segment_bytes(max(1, int(need))), LARGE_SEGMENT)
        self.cap_bytes = min(total, self.cap_bytes + step)
        torch.cuda.set_per_process_memory_fraction(self.cap_bytes / total, self.device)
        if self._cur is not None:
            self._cur.cap_lifted_bytes += step
        return True

    def _set_cap(self) -> None:
        """Cap the CUDA allocator at the budget plus what the budget does not count (Note
        [Budget and the allocator] in device.py)."""
        props = torch.cuda.get_device_properties(self.device)
        self.cap_bytes = cap_bytes(self.budget_bytes, self.non_tensor_bytes)
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, self.cap_bytes / props.total_memory), self.device
        )
        self._fraction_set = True

    def _replays(self) -> bool:
        """Does this run replay ops (Note [Determinism precondition] in device.py)?"""
        plans = [self.plan, *self.plan.kinds] if self.plan is not None else []
        if any(p.recompute_count for p in plans):
            return True
        return self.passive_enabled and self.eviction == "dtr" and self.remat != "swap"

    def _guard(self, budget, memory, swap, ex) -> Guard:
        return make_guard(
            self.eviction,
            budget,
            self.device,
            memory,
            swap,
            ex,
            bandwidth_bytes_per_s=self.bandwidth_h2d_bytes_per_s,
            remat=self.remat,
        )

    def _patch_save(self) -> None:
        """Note [Reads outside ops]: ``torch.save`` reads storages' bytes directly, not through
        an op, so everything evicted comes back first, wrap-around decisions' storages too
        (e.g. optimizer state in ``optimizer.state_dict()``)."""
        save = self._save = torch.save

        def capuchin_save(*args, **kwargs):
            with _disable_current_modes(), torch.no_grad():
                self.ex.restore_all(wrapping=True)
            with rawreads.quiet():
                return save(*args, **kwargs)

        torch.save = capuchin_save

    def _enter_empty(self) -> Runtime:
        self.ex = None
        self._iters = []
        self.meter = MemoryMeter(self.device) if self.measure_memory else None
        if self.device.type == "cuda":
            self._count_non_tensor(None)
        self.indexer = _StepClock(self)
        if self.meter is not None:
            self.meter.start()
        self.indexer.install()
        self._iteration_start(0)
        return self

    def _exit_empty(self, exc_type) -> None:
        self.indexer.uninstall()
        self._uninstall_region_tags()
        if self._cur is not None and self.meter is not None:
            self.meter.iteration_end(self._cur.iteration)
        self._cur = None  # what ran after the last step is not reported (ops are not seen)
        self._take_peaks(self.meter.finish() if self.meter is not None else {})
        self.report = RunReport(
            self.budget_bytes, str(self.device), self.plan_source, self._iters, ops_checked=False
        )
        if self.report_path is not None and exc_type is None:
            self.report.save(self.report_path, force=self.force)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._entered = False
        if self.ex is None:
            return self._exit_empty(exc_type)
        try:
            self.indexer.finish()
            if self._cur is not None:  # ops after the last step: an incomplete iteration,
                self._cur.complete = False  # no divergence (Note [End of run] in tracker.py)
                self._cur.diverged, self._cur.diverged_at = False, None
                self.ex.cursor.warning = self.ex.cursor.foreign = None
                self._iteration_end(self._cur.iteration, self.indexer.op_index)
            # the user's state is whole after the run, outside the budget: what the guard or
            # the plan keeps out across steps (parameters, optimizer state) may outweigh it
            # (Note [Persistent state under the guard] in guards/lru.py)
            self.ex.guard.stop()
            if self._fraction_set:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
                self._fraction_set = False
            with _disable_current_modes(), torch.no_grad():
                self.ex.restore_all(wrapping=True)
        except Exception:
            if exc_type is None:
                raise  # otherwise the script's own error is the one to report
        finally:
            self.ex.mode.__exit__(exc_type, exc, tb)
            self._chunks.__exit__(None, None, None)
            rawreads.uninstall(self.ex)
            threads.uninstall(self)
            torch.save = self._save
            self.indexer.uninstall()
            self._uninstall_region_tags()
            peaks = self.meter.finish() if self.meter is not None else {}
            if self._fraction_set:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.backend.close()
        if self.refusal is not None and exc_type is None:
            raise self.refusal
        self._take_peaks(peaks)
        self._warn_over(exc_type)
        lifted = [s for s in self._iters if s.cap_lifted_bytes]
        if lifted and exc_type is None:
            say(
                f"capuchin: warning: the allocator cap was raised by "
                f"{sum(s.cap_lifted_bytes for s in lifted) / 2**20:.0f} MiB in iteration(s) "
                f"{[s.iteration for s in lifted][:8]}: an out-of-memory error under it found "
                "nothing left to evict (fragmentation the cap's headroom did not cover), so the "
                "run used more memory than the budget there; PYTORCH_CUDA_ALLOC_CONF="
                "expandable_segments:True keeps reserved memory close to allocated (docs/"
                "runtime.md, On CUDA); see cap_lifted_bytes in the report"
            )
        short = [s for s in self._iters if s.passive_short_bytes > 0]
        if short and exc_type is None:
            worst = max(short_of(s, self.budget_bytes) for s in short)
            say(
                f"capuchin: warning: passive mode could not keep {len(short)} iteration(s) "
                f"{[s.iteration for s in short][:8]} within the budget of "
                f"{self.budget_bytes / 2**20:.1f} MiB: up to {worst / 2**20:.1f} MiB over it "
                "with nothing left to evict (an op's own inputs and outputs stay resident); see "
                "passive_short_bytes in the report"
            )
        self.report = RunReport(
            self.budget_bytes,
            str(self.device),
            self.plan_source if self.plan is not None else None,
            self._iters,
            self.first_checked_iteration,
        )
        if self.report_path is not None and exc_type is None:
            self.report.save(self.report_path, force=self.force)

    def _take_peaks(self, peaks: dict[int, int]) -> None:
        """Each iteration's measured peak (Note [Measured peak] in report.py) and, on CUDA, the
        allocator's own."""
        raw = self.meter.allocator_peaks() if self.meter is not None else {}
        for s in self._iters:
            s.peak_bytes = peaks.get(s.iteration)
            s.allocator_peak_bytes = raw.get(s.iteration)

    def _warn_over(self, exc_type) -> None:
        """Name every checked, complete iteration whose measured peak is over the budget that
        passive mode's shortfall warning does not name (a planned iteration above all: memory
        the plan did not see, such as tensors the script keeps from an iteration that diverged)."""
        over = [
            s
            for s in self._iters
            if s.complete
            and s.iteration >= self.first_checked_iteration
            and s.peak_bytes is not None
            and s.peak_bytes > self.budget_bytes
            and s.passive_short_bytes == 0
        ]
        if not over or exc_type is not None:
            return
        worst = max(over, key=lambda s: s.peak_bytes)
        say(
            f"capuchin: warning: {len(over)} iteration(s) {[s.iteration for s in over][:8]} "
            f"measured over the budget of {self.budget_bytes / 2**20:.1f} MiB with no shortfall "
            f"of passive mode: up to {worst.peak_bytes / self.budget_bytes:.3f}x it (iteration "
            f"{worst.iteration}{', planned' if not worst.diverged else ''}); memory the plan did "
            "not foresee was resident (tensors the script keeps across iterations, or what the "
            "plan keeps out across the step, resident in the first planned iteration); see "
            "peak_bytes in the report"
        )

    # ---- iteration callbacks (from the indexer, inside the first op of an iteration) ----------
    def _iteration_start(self, n: int) -> None:
        self._cur = IterationStats(iteration=n)
        self._cur_n = n
        self._t0 = time.perf_counter()
        self._t_step = None
        if self.meter is not None:
            self.meter.iteration_start(n)
        if self.ex is not None:
            self.ex.begin_iteration(self._cur)

    def _iteration_end(self, n: int, last_op: int) -> None:
        s = self._cur
        if s is None:
            return
        if self.ex is not None:
            self.ex.restore_all()
            self.ex.end_iteration()
        end = self._t_step if self._t_step is not None else time.perf_counter()
        s.time_s = end - self._t0
        s.ops = last_op + 1
        if self.meter is not None:
            self.meter.iteration_end(n)
        self._iters.append(s)
        self._cur = None
        self._check_ooms(n)

    def _check_ooms(self, n: int) -> None:
        """Note [Out-of-memory errors caught inside an op] in device.py."""
        why = self.oom_watch.problem(n) if self.oom_watch is not None else None
        if why is not None:
            say(why)

    def _step_end(self) -> None:
        self._t_step = time.perf_counter()
        with _disable_current_modes(), torch.no_grad():
            self.ex.restore_all()
        self.ex.step_ended()

    def _may_keep(self, nbytes: int) -> bool:
        alloc = self.backend.allocated_bytes()
        if alloc is None:
            return True  # CPU: the plan's simulation decided the keep set fits
        return alloc + nbytes <= self.budget_bytes
