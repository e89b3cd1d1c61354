"""What running a plan costs beyond the device's own work: the runtime's per-op bookkeeping and,
on CPU, the copies. The constants live here, each with where it was measured; ``build_plan``
adds ``runtime_cost_ns`` to the simulated iteration for the plan's predicted time
(``Predictions.runtime_cost_ns``). No torch.

# Note: [Runtime cost model]
# The simulator (simulator.py) replays the plan on the device's streams: compute, one copy
# channel per direction. What it does not see is what the runtime pays on the host to carry the
# plan out (runtime/tracker.py, Note [Hot path]):
# - an empty plan installs nothing (Note [Empty plan] in runtime/engine.py): cost 0;
# - otherwise every op passes through the dispatch mode (``hot_op_ns``);
# - ops inside an eviction window (between a decision's evicted-access and back-access) take the
#   guarded hot path (``guarded_op_ns`` more: one storage-key lookup per tensor argument);
# - ops with an action (evict, prefetch, back-access, recorded for a replay, a planned swap-out
#   wait), the ops where a storage the plan refers to is named (its producer, or the op whose
#   argument it is: ``naming_ops``; on T5 at 50% about a third of the slow-path ops, which the
#   model had left out) and in-place ops inside a window take the slow path (``slow_op_ns``
#   more);
# - each swap pays its host-side bookkeeping twice (out and in, ``swap_action_ns``), each
#   replayed op the replay machinery (``replay_op_ns``), and each recompute decision its drop
#   and its replay's records (``drop_action_ns``, Note [Recompute decisions on the host]);
# - on CPU there is no copy engine: the copy threads share the cores with compute, so a swap's
#   copies (both directions, at the trace's measured bandwidth or the runtime's measured copy
#   cost per byte, whichever is slower) are added to the compute time
#   (``copies_share_compute``); on CUDA the copy engines are separate and the simulator's copy
#   channels already model them.
# Where the host is the device (CPU), the part of this cost that grows with the plan's decisions
# (per swap direction, per replayed op, per recompute decision, per op with an action) is host
# work on the compute
# stream itself; the simulator charges it there (Note [Host work on the compute stream]), so the
# policies, which compare the simulator's streams (``SimResult``), see it at every budget. The
# rest (the per-op dispatch cost, the same for every non-empty plan; the guarded path; in-place
# ops inside a window; on CPU the copies) the policies do not see; ``build_plan`` adds it to the
# plan's prediction as ``runtime_cost_ns``.
#
# Note: [Host work on the compute stream]
# On CPU every swap costs the runtime a fixed ~90 µs per direction on the host (thread handoff,
# views, bookkeeping: ``swap_action_ns``), and every op with an action takes the slow path; a
# 64 KiB copy itself takes ~4 µs. The simulator's copy channels hid that cost, so a plan of many
# tiny swaps (e.g. 88 wrap-around swaps of 4 MiB in all: biases and their optimizer state) looked
# as fast as one of few large swaps and measured up to 1.6x slower. ``HostCost`` is this cost as
# the simulator charges it on the compute stream: ``swap_ns`` when a swap-out is handed over
# (after its evicted-access) and when a swap-in starts (prefetch or on-demand restore),
# ``replay_op_ns`` per replayed op, ``drop_ns`` after each recompute decision's drop,
# ``action_op_ns`` before each op with an action (evict, prefetch, back-access, recorded for a
# replay; ``action_ops``). It is a property of the problem
# (``Problem.host``), the same at every budget, so a policy that is monotone in the simulated
# time stays so. On CUDA the host runs ahead of the device (kernel launches are asynchronous), so
# its work overlaps the device's and nothing is charged (``NO_HOST_COST``); synthetic traces
# (tracer/synthetic.py) model no runtime and charge nothing either.
# Sources: ``python benchmarks/runtime.py`` prints the per-op figures (its "per-op cost" lines:
# a 16-float ``aten.add`` without a mode, through a passthrough mode, on the runtime's hot path and
# on its slow path; a swap cycle through the CPU backend) and the table whose "measured /
# predicted" column checks this model; the figures below are from its runs recorded in
# docs/runtime.md (CPU, 1 intra-op thread, a 2-core host; each constant says its load). Under
# load the host-side costs grow with it (about 3x at load 10), and so do the op times a trace
# records: trace and run on a quiet machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ..tracer.schema import IdKind, TensorId
from .plan import Decision, Method

if TYPE_CHECKING:
    from .problem import Problem


@dataclass(frozen=True)
class RuntimeCosts:
    """Host-side costs of the runtime on one kind of device (ns)."""

    hot_op_ns: int  # every op, through the dispatch mode (passthrough mode minus no mode)
    guarded_op_ns: int  # more, per op inside an eviction window (the evicted-input check)
    slow_op_ns: int  # more, per op on the slow path (slow path minus hot path)
    swap_action_ns: int  # per swap-out and per swap-in: copy-thread handoff, views, bookkeeping
    replay_op_ns: int  # per replayed op: argument views, version checks
    copies_share_compute: bool  # no separate copy engine (CPU)
    copy_ns_per_byte: float = 0.0  # the runtime's own copy path, when slower than the trace's
    #                                measured bandwidth (fresh pages after a resize, thread handoff)
    drop_action_ns: int = 0  # per recompute decision: its drop and its replay's records, beyond
    #                          the slow path (Note [Recompute decisions on the host])


# Where each figure comes from (benchmarks/runtime.py; its table and the host it ran on are in
# docs/runtime.md, "Measured"; rerun it on a quiet host, one intra-op thread, to refresh them):
# hot_op_ns: the passthrough-mode line minus the no-mode line; slow_op_ns: the "runtime slow path"
# line (a plan's action op) minus the hot path; guarded_op_ns: the argument check;
# swap_action_ns: the "implied swap cost per direction" line, what the capuchin rows leave
# unexplained per swap and direction. The 64 KiB "swap cycle" line alone misses it: swap-outs up
# to 1 MiB copy on the calling thread (Note [Inline copies on CPU] in runtime/backend.py), and it
# leaves out the copy thread's wake-up and interpreter-lock handoff while compute runs.
# copy_ns_per_byte: the 2-8 MiB swap-cycle lines. replay_op_ns has no line of its own: about
# passive mode's per-op line (every op inspected, its outputs tracked), an upper bound of a
# replayed op's bookkeeping. drop_action_ns: Note [Recompute decisions on the host].
CPU = RuntimeCosts(
    hot_op_ns=3_400,
    guarded_op_ns=400,
    slow_op_ns=3_000,
    swap_action_ns=90_000,
    replay_op_ns=40_000,
    copies_share_compute=True,
    copy_ns_per_byte=0.06,
    drop_action_ns=40_000,
)
# CUDA without a measurement: the host runs ahead of the device (kernel launches are
# asynchronous), so the runtime's host work is taken to overlap the device's and nothing is
# charged, as the simulator charges no host work there (Note [Host work on the compute stream]);
# the copies run on the copy engines, which the simulator's channels model. An assumption that
# fails where ops are so short that the host is the bottleneck (on an H200 the bundled
# examples; the DTR project's LSTM and TreeLSTM traces, microsecond kernels): a trace whose
# probe measured the script's steps is charged what it measured (Note [Host work on CUDA]).
CUDA = RuntimeCosts(
    hot_op_ns=0,
    guarded_op_ns=0,
    slow_op_ns=0,
    swap_action_ns=0,
    replay_op_ns=0,
    copies_share_compute=False,
)


# Note: [Recompute decisions on the host]
# A recompute decision costs the runtime more than its replay: at its evicted-access the slow
# path checks that the replay is exact (rule R7 in runtime/recompute.py: every replayed op's
# record and source), registers its sources for copy-on-write and drops the storage (an entry,
# a weak reference, the resize), and every op it replays was recorded when it ran (argument
# slots, a call template, RNG state, the outputs named) on top of the slow path. On T5 (tests/
# frameworks/hf_t5.py, batch 16, 50%) a drop cost ~42 µs of CPU (23 µs of it the R7 check;
# 32 and 13 µs once the check took each op's name from ``op_info``'s per-op cache) and
# a recorded op ~12 µs more than an op on the slow path: ~30-60 µs a decision in all (the
# constant: 40 µs), where the model charged a decision its replayed ops (``replay_op_ns``) and
# its action ops (``slow_op_ns``, 3 µs) only. The replays themselves were charged about right
# (~250 µs of CPU per replay of ~4.5 ops, ~55 µs per op scaled plus their compute), but T5's
# plans of drops measured 1.21-1.28x their prediction where the same host's swap-only plan
# measured 1.05x (benchmarks/results/plain_prediction_real.txt, runtime_profile_real.txt).
# ``drop_action_ns`` is charged once per recompute decision, and the simulator charges it
# (``HostCost.drop_ns``) on the compute stream after the drop, so the policies weigh it
# against a swap's host work. The calibration times the recompute engine's own steps in a
# loop (runtime/calibrate.py), scaled to the script's hot path like the other per-op figures
# and floored at the constant (the loop leaves out the residency's entry and the slow path's
# recorded-op steps, so it reads low: 17-19 µs scaled on the hosts above).

# the figures a trace may carry (``TraceMeta.host_costs``; Note [Calibrated host costs])
HOST_COST_KEYS = (
    "hot_op_ns",
    "guarded_op_ns",
    "slow_op_ns",
    "swap_action_ns",
    "replay_op_ns",
    "drop_action_ns",
)
# the figures the runtime's calibration times in loops, charged at least at their constants
FLOORED_KEYS = ("slow_op_ns", "swap_action_ns", "replay_op_ns", "drop_action_ns")
# the loops' per-op figures, charged at the script's hot path over the loop's (``LOOP_HOT_KEY``)
SCALED_KEYS = ("slow_op_ns", "replay_op_ns", "drop_action_ns")
LOOP_HOT_KEY = "loop_hot_op_ns"  # the runtime's hot path in the calibration's loop
# the slow path timed over the script's own steps (Note [The runtime in the script's steps] in
# runtime/calibrate.py): charged in place of the loop's ``slow_op_ns``, unscaled, floored
SCRIPT_SLOW_KEY = "slow_op_script_ns"


# Note: [Calibrated host costs]
# The constants above are the runtime's host costs on a quiet host, timed in loops of tiny ops;
# the plain step a plan's overhead is stated against is timed at trace time, at whatever load
# the host has then. Inside a real script on a busy host a dispatch mode costs several times
# the loop's figure per op (nanoGPT: 12-17 µs over its ~1,490 ops a step, where the loop
# measured 4.3 µs in the same hour: benchmarks/results/plain_prediction_real.txt), so the
# constant under-charged every op of every managed step. The tracer measures it where it
# arises: after the plain steps it runs the runtime itself over the script's steps, in rounds
# with plain steps (Note [Plain step] in tracer/record.py, Note [The runtime in the script's
# steps] in runtime/calibrate.py); the extra time per op of the recorded iteration over the
# plain step is ``host_costs["hot_op_ns"]``, what ``CPU.hot_op_ns`` is on the quiet host (a
# passthrough mode less no mode; without the runtime composed in, the tracer times such a mode,
# ``_CountingMode``), and ``calibrated`` charges it in its place. The slow path's, the swaps' and the
# replays' costs need a plan, so they are timed apart: after the script's steps the tracer calls
# the calibration it was given (capuchin/tracing.py passes the runtime's, runtime/calibrate.py,
# Note [Calibration of the runtime's slow path]), which times the runtime's slow path, a swap
# cycle of a storage of the script's typical size and passive mode's per-op cost in the traced
# process: ``host_costs["slow_op_ns"]``, ``["swap_action_ns"]``, ``["replay_op_ns"]``.
# ``calibrated`` charges each figure present in place of its constant (``HostCost`` too, so
# the simulator's host work on the compute stream is charged at them), the calibration's never
# below their constants (``FLOORED_KEYS``): those constants are lower bounds of what a real run
# pays (the swap's is what whole managed runs left unexplained per swap; inside a script the
# slow path cost 21 + 13 µs per call and a replayed decision 243 µs where the loops measure
# 3 and 25-40: benchmarks/results/runtime_profile_real.txt), and a loop, alone on the host,
# misses what a run adds to them (a swap's copy thread contending with compute for the core and
# the interpreter lock; small swap-outs copy inline and only restores hand over), so a loop's
# figure below the constant says the loop missed part of the cost, not that the host is faster
# than the quiet one. The host's load raises them above it. And the slow path's and a replayed
# op's figures are per-op Python bookkeeping of the same dispatch mode as the hot path, which
# the script slows alike: the calibration also times the runtime's hot path in its loop
# (``host_costs["loop_hot_op_ns"]``), and the two are charged at the script's hot path over the
# loop's (``SCALED_KEYS``; never below 1). The swap's is not scaled: its cost is the copy
# thread's handoff, not the op's bookkeeping. Scaling every constant, the swap's too, by the
# hot path over its quiet-host constant (a ratio against another host state, 3-5x) instead
# over-charged (predicted 3.65x and 3.79x where nanoGPT and the Llama measured 2.66x and 2.72x:
# benchmarks/results/plain_prediction_real.txt). Limits: the hot path is a difference of two
# medians of a few steps, run one after the other, and the others are differences of loops of
# tiny ops: noisy on a busy host, and a hot path measured high also raises the scaled figures;
# a figure of 0 or less is not used (the constant is); the trace's load is assumed to be the
# run's. Where the tracer also ran the runtime's slow path over the script's own steps
# (``host_costs["slow_op_script_ns"]``, Note [The runtime in the script's steps] in
# runtime/calibrate.py), that figure is charged per slow-path op instead of the loop's, neither
# scaled (it is the script's own) nor below the constant: the loop's add has two arguments and
# one output where the script's ops have more to flatten, look up and name.


def _figure(measured: dict, key: str) -> int | None:
    """A figure of a trace's ``host_costs``: an integer above 0, else None (no measurement)."""
    try:
        v = int(measured[key])
    except (KeyError, TypeError, ValueError):
        return None
    return v if v > 0 else None


def calibrated(measured: dict | None) -> RuntimeCosts | None:
    """The CPU runtime's costs with each figure a trace measured (Note [Calibrated host costs];
    ``HOST_COST_KEYS``) in place of its constant in ``CPU``: the loops' per-op figures scaled by
    how much slower the script's hot path was than the loop's (``SCALED_KEYS``), the loops'
    figures never below their constants (``FLOORED_KEYS``); None where nothing usable was
    measured (a figure of 0 or less, or not an integer, is not used)."""
    m = measured or {}
    hot, loop_hot = _figure(m, "hot_op_ns"), _figure(m, LOOP_HOT_KEY)
    scale = max(1.0, hot / loop_hot) if hot and loop_hot else 1.0
    found = {}
    for key in HOST_COST_KEYS:
        v = _figure(m, key)
        if v is None:
            continue
        if key in SCALED_KEYS:
            v = int(round(v * scale))
        found[key] = max(v, getattr(CPU, key)) if key in FLOORED_KEYS else v
    script_slow = _figure(m, SCRIPT_SLOW_KEY)
    if script_slow:
        found["slow_op_ns"] = max(script_slow, CPU.slow_op_ns)
    return replace(CPU, **found) if found else None


# Note: [Host work on CUDA]
# On CUDA the host runs ahead of the device, so the runtime's host work costs a step only what
# the device's kernels do not hide: nothing on a device-bound script, all of it on a host-bound
# one (on an H200 the bundled examples, 1-2 ms of kernels a step, measured 3.6-11x the plain
# step at 50% where no host cost was charged: docs/runtime.md, On CUDA). The tracer's probe over
# the script's own steps measures exactly that share: its steps are wall time with the device
# synchronized at their ends (tracer/record.py ``_now``), so the within-round differences (Note
# [The runtime in the script's steps] in runtime/calibrate.py) are what the runtime's dispatch
# mode, its guarded path and its slow path add to a step on this device. ``cuda_calibrated``
# charges them per op as measured (``hot_op_ns``, ``guarded_op_ns``, ``slow_op_script_ns`` as
# ``slow_op_ns``), never floored (a reading near 0 is right on a device-bound script), in the
# plan's ``runtime_cost_ns``; nothing goes on the simulator's compute stream (``HostCost``
# stays empty). A swap's and a replay's own host work (the copies' calls: about 50 µs a
# direction alone and 140-150 µs inside a run on the H200) is not measured there (the probe
# moves no bytes; the calibration's loops run on CPU only) and not charged; the plan's note
# says so.


def cuda_calibrated(measured: dict | None) -> RuntimeCosts | None:
    """The CUDA runtime's costs with the per-op figures the trace's probe measured in the
    script's steps (Note [Host work on CUDA]); None where it measured none above 0."""
    m = measured or {}
    keys = {
        "hot_op_ns": "hot_op_ns",
        "guarded_op_ns": "guarded_op_ns",
        SCRIPT_SLOW_KEY: "slow_op_ns",
    }
    found = {field: v for key, field in keys.items() if (v := _figure(m, key)) is not None}
    return replace(CUDA, **found) if found else None


def on_cuda(device) -> bool:
    """Whether a trace's or plan's device (``"cuda"``, ``"cuda:1"``, a ``torch.device``'s
    text) is a CUDA device."""
    return str(device).startswith("cuda")


def costs_for(device: str, measured: dict | None = None) -> RuntimeCosts:
    """The runtime's costs on ``device``: on CUDA the per-op figures the trace measured in the
    script's steps (``cuda_calibrated``) or none, else the CPU figures a trace measured
    (``calibrated``) or, without them, the constants."""
    if on_cuda(device):
        return cuda_calibrated(measured) or CUDA
    return calibrated(measured) or CPU


@dataclass(frozen=True)
class HostCost:
    """The runtime's host work that the simulator charges on the compute stream (ns; Note
    [Host work on the compute stream])."""

    swap_ns: int = 0  # per swap-out (after its evicted-access) and per swap-in (at its start)
    replay_op_ns: int = 0  # per replayed op
    action_op_ns: int = 0  # before each op with an action (``action_ops``)
    drop_ns: int = 0  # per recompute decision, after its evicted-access (its drop)

    def __bool__(self) -> bool:
        return bool(self.swap_ns or self.replay_op_ns or self.action_op_ns or self.drop_ns)


NO_HOST_COST = HostCost()


def host_cost(device: str, source: str = "capuchin", measured: dict | None = None) -> HostCost:
    """What the simulator charges on the compute stream for a trace recorded on ``device`` by
    ``source`` (Note [Host work on the compute stream]): the CPU runtime's per-swap, per-replay
    and slow-path costs on CPU (the trace's ``measured`` figures where it has them), nothing on
    CUDA or for synthetic traces."""
    c = costs_for(device, measured)
    if not c.copies_share_compute or source == "synthetic":
        return NO_HOST_COST
    return HostCost(c.swap_action_ns, c.replay_op_ns, c.slow_op_ns, c.drop_action_ns)


def action_ops(decisions: Iterable[Decision], *, out_done: bool = False) -> set[int]:
    """The ops with an action of ``decisions`` (they take the runtime's slow path): evicted- and
    back-accesses, in-triggers, ops recorded for a replay, and with ``out_done`` the planned
    swap-out waits (written from the simulation, so the simulator itself does not see them)."""
    action: set[int] = set()
    for d in decisions:
        action.add(d.evict_op)
        if not d.dead:  # a dead decision's back_op is where the script frees it: no action
            action.add(d.back_op)
        if d.method == Method.SWAP:
            if d.trigger_op is not None:
                action.add(d.trigger_op)
            if out_done and d.out_done_op is not None:
                action.add(d.out_done_op)
        else:
            action.update(d.replay_ops)
    return action


def naming_ops(decisions: Iterable[Decision]) -> set[int]:
    """The ops where the runtime names a storage the plan refers to (a decision's storage, its
    replay's sources and kept targets): the op that produces it, or the op whose argument it
    is for a storage from before the iteration. They take the slow path as the action ops do
    (``compile_plan`` in runtime/actions.py), though nothing is done to memory there."""
    ops: set[int] = set()
    for d in decisions:
        for sid in (d.storage_id, *d.sources, *d.keep):
            try:
                tid = TensorId.parse(sid)
            except ValueError:
                continue
            if tid.kind in (IdKind.OUTPUT, IdKind.INPUT):
                ops.add(tid.op_index)
    return ops


def simulated_host_ns(problem: Problem, decisions: Sequence[Decision]) -> int:
    """What the simulator charged on the compute stream for ``decisions`` (``Problem.host``)."""
    h = problem.host
    if not h or not decisions:
        return 0
    swaps = sum(d.method == Method.SWAP for d in decisions)
    replays = sum(len(d.replay_ops) for d in decisions if d.method != Method.SWAP)
    acts = sum(0 <= k < problem.n_ops for k in action_ops(decisions))
    drops = len(decisions) - swaps
    return (
        2 * swaps * h.swap_ns + replays * h.replay_op_ns + acts * h.action_op_ns + drops * h.drop_ns
    )


def runtime_cost_ns(
    problem: Problem, decisions: Sequence[Decision], costs: RuntimeCosts | None = None
) -> int:
    """What the runtime adds to the simulated iteration time for ``decisions`` on ``problem``'s
    device (Note [Runtime cost model]): its whole cost less what the simulator already charged
    on the compute stream (``simulated_host_ns``)."""
    if not decisions:
        return 0
    total = sum(runtime_cost_parts(problem, decisions, costs).values())
    return max(0, int(total) - simulated_host_ns(problem, decisions))


def runtime_cost_parts(
    problem: Problem, decisions: Sequence[Decision], costs: RuntimeCosts | None = None
) -> dict[str, float]:
    """The runtime's whole host cost for ``decisions`` by what it is charged for (ns a step):
    ``hot`` (every op), ``guarded`` and ``slow`` (the ops in a decision's window and those with
    an action), ``swap actions``, ``replayed ops``, ``drops`` and, where copies share the
    compute thread, ``copies`` (Note [Runtime cost model])."""
    c = costs if costs is not None else costs_for(problem.device, problem.host_costs)
    n = problem.n_ops
    # the ops with an action and those that name a storage: the runtime's slow path
    action = action_ops(decisions, out_done=True) | naming_ops(decisions)
    edges = [0] * (n + 1)  # +1 where a decision's window opens, -1 after it closes
    swaps = 0
    replays = 0
    copy_ns = 0.0
    for d in decisions:
        if d.method == Method.SWAP:
            swaps += 1
            for bw in (problem.bandwidth_d2h_bytes_per_s, problem.bandwidth_h2d_bytes_per_s):
                copy_ns += d.size_bytes * max(1e9 / bw, c.copy_ns_per_byte)
        else:
            replays += len(d.replay_ops)
        lo, hi = (d.evict_op, d.back_op) if d.evict_op <= d.back_op else (0, n - 1)
        lo, hi = max(0, lo), min(n, hi + 1)
        if lo < hi:
            edges[lo] += 1
            edges[hi] -= 1
    in_window = (np.cumsum(edges[:n]) > 0).tolist()  # linear in ops + decisions
    guarded = slow = 0
    for k, op in enumerate(problem.ops):
        if k in action or (in_window[k] and op.writes):
            slow += 1
        elif in_window[k]:
            guarded += 1
    return {
        "hot": n * c.hot_op_ns,
        "guarded": guarded * c.guarded_op_ns,
        "slow": slow * c.slow_op_ns,
        "swap actions": 2 * swaps * c.swap_action_ns,
        "replayed ops": replays * c.replay_op_ns,
        "drops": (len(decisions) - swaps) * c.drop_action_ns,
        "copies": copy_ns if c.copies_share_compute else 0.0,
    }
