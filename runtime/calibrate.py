"""The runtime's own host costs timed in the traced process (Note [Calibrated host costs] in
planner/costs.py): its slow path, a swap's bookkeeping and a replayed op's, on this host at
this load. capuchin/tracing.py passes ``host_calibration`` to the tracer (the tracer never
imports the runtime); the tracer calls it after the script's timed steps.

# Note: [Calibration of the runtime's slow path]
# Each figure is what ``RuntimeCosts`` (planner/costs.py) names, timed the way its quiet-host
# constant was (benchmarks/runtime.py, "per-op cost" and "swap cycle" lines), but in the
# traced process, right after its steps, so the host's speed and load then are in it:
# - ``slow_op_ns``: a 16-float ``aten.add`` through a runtime whose plan has an action (a
#   prefetch of a storage that is not out: the slow path's bookkeeping, no copy) at every op,
#   less the same add through a plan without actions at those ops (the hot path);
# - ``replay_op_ns``: the add through passive mode (every op inspected, its outputs tracked;
#   the constant's own upper bound of a replayed op's bookkeeping), less the add without a mode;
# - ``swap_action_ns``: one swap cycle of a storage of the script's typical size through the
#   CPU backend (copy out to a pooled host buffer, free, resize back, copy in), less the copies
#   as the planner charges them (the trace's bandwidth or ``copy_ns_per_byte``, whichever is
#   slower, per byte and direction), halved: what
#   each direction costs beyond its copy;
# - ``drop_action_ns``: what the runtime does for a recompute decision besides its replay and
#   the slow path (Note [Recompute decisions on the host] in planner/costs.py): the add recorded
#   for a replay (``RecomputeEngine.record``: argument slots, call template), run, its output
#   named (``recorded_outputs``), the decision checked for an exact replay (rule R7,
#   ``check_replayable``), its sources looked up and its storage dropped (resized to 0), less
#   the add without a mode; the recompute engine's own steps, timed apart from a plan (the
#   residency's entry for the dropped storage is left out: the constant is the floor);
# - ``loop_hot_op_ns``: the hot path less the add without a mode, the loop's own figure of what
#   the tracer measured in the script as ``hot_op_ns``: their ratio scales the loop's per-op
#   figures to the script (Note [Calibrated host costs] in planner/costs.py).
# Each loop is timed ``reps`` times and the fastest kept (the host's other jobs only ever add
# time). A figure that comes out at 0 or below is left out, and the planner keeps the constant
# for it. The plans are made for the loop (no trace); a plan with actions but no decisions
# would install nothing (Note [Empty plan] in engine.py), so ``_installed`` lets it install
# its mode for the loop's duration.

# Note: [The runtime in the script's steps]
# The loops above time the runtime on a 16-float add with two arguments, alone on the host; a
# real op has more arguments and outputs to flatten, look up and name, and runs between the
# script's own Python, which the loop's figures reach only through the scaling by the hot path
# (Note [Calibrated host costs] in planner/costs.py), itself first timed through a dispatch
# mode that only passes ops on, cheaper than the runtime's hot path; and the guarded hot path
# (every op's inputs checked against the evicted storages while any is out) had only a
# quiet-host constant. So after the recorded iterations the tracer runs the runtime itself over
# the script's own steps: ``RuntimeProbe`` is a ``Runtime`` whose plan is the recorded
# iteration's ops (names and input shapes, as a plan stores them) and no decision, entered from
# the step hook, its step hooks following the tracer's (Note [Indexers that follow another] in
# tracer/hooks.py), one step at a time, each on one of the runtime's paths (``PATHS``): the hot
# path (no action), the guarded hot path (as while something is out: the mode checks each op's
# inputs against an evicted set that holds no storage; ops that write in place leave it for
# the slow path, as in a real window) and the slow path (the loop's action at every op: a
# prefetch of a storage that is not out, so the slow path's matching, before- and after-steps,
# no copy; and what a real plan's action op does besides moving bytes: its first input and
# output named, an eviction of that output tried after it, which finds no decision in the
# plan and evicts nothing, and its inputs looked up among the evicted storages, which hold one
# entry that is no storage's, as while a real plan has something out: ``_acting_everywhere``;
# an empty action alone missed them). The tracer runs them in rounds with a plain step (Note
# [Plain step] in tracer/record.py), one untimed warm-up step first; per op of the recorded
# iteration, the median within-round difference of the hot step over the plain one is
# ``host_costs["hot_op_ns"]``, of the slow step over the hot one ``["slow_op_script_ns"]``
# (charged in place of the loop's scaled ``slow_op_ns``), and of the guarded step over the hot
# one, less the ops it sent down the slow path (``slow_calls``) at that figure, per op that
# stayed on it, ``["guarded_op_ns"]``. A probe step that did not follow the recorded ops
# (another kind of iteration, other shapes: its ops then left the planned path) gives no
# figure (``extra["runtime_probe_note"]``), and a warm-up that does not makes the rest of the
# rounds time the passthrough mode for the hot path alone. The probes never evict (no
# decisions), never warn or refuse (no iteration is checked against the plan's fingerprint)
# and run without passive mode. With ``plain_steps`` 3 the rounds and the two plain steps before
# them take 15 steps after the plain warm-up and its untimed plain step (21 in all with one
# warm-up and three recorded iterations; Note [Plain step] in tracer/record.py); a script that
# ends sooner keeps what its steps measured.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch

from ..planner.costs import CPU
from ..planner.plan import Action, Decision, Method, Plan, Predictions, Provenance, Step
from . import engine
from .backend import backend_for
from .engine import Runtime
from .recompute import RecomputeEngine
from .state import Entry, Reason, Residency, resize, storage_key
from .tracker import _ANY

_OP = ["aten.add.Tensor", "16;16"]


def _loop_plan(n: int, acting: bool) -> Plan:
    prov = Provenance("none", {}, 1 << 40, "", "", 0, "cpu", 12e9, 12e9, "", 0.0)
    # the hot plan's one action is past the loop: a non-empty plan, no action in the loop
    actions = [Action(k, Step.PREFETCH, "0:0") for k in (range(n) if acting else [n])]
    return Plan(prov, Predictions(0, 0, 0, 0), [], [_OP] * (n + 1), actions=actions)


@contextlib.contextmanager
def _installed() -> Iterator[None]:
    saved = engine._empty
    engine._empty = lambda plan: False
    try:
        yield
    finally:
        engine._empty = saved


def per_op_ns(
    n: int = 2000, reps: int = 3, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """ns per 16-float add: without a mode, on the runtime's hot path, on its slow path, and
    through passive mode (Note [Calibration of the runtime's slow path])."""
    a, b = torch.ones(16, device="cpu"), torch.ones(16, device="cpu")
    add = torch.ops.aten.add.Tensor
    hot, acting = _loop_plan(n, False), _loop_plan(n, True)
    lines = {
        "no mode": contextlib.nullcontext,
        # the CPU named: on a host with CUDA a plan-less budget must name its device
        "hot path": lambda: Runtime(hot, measure_memory=False, device="cpu"),
        "slow path": lambda: Runtime(acting, measure_memory=False, device="cpu"),
        "passive mode": lambda: Runtime(budget_bytes=1 << 40, measure_memory=False, device="cpu"),
    }
    out = {}
    with _installed():
        for name, ctx in lines.items():
            best = math.inf
            for _ in range(reps):
                with ctx():
                    t0 = clock()
                    for _ in range(n):
                        add(a, b)
                    best = min(best, clock() - t0)
            out[name] = best / n * 1e9
    out["recompute drop"] = drop_cycle_ns(n, reps, clock)
    return out


def drop_cycle_ns(n: int, reps: int, clock: Callable[[], float]) -> float:
    """ns per 16-float add recorded for a replay, its output named, its decision checked and
    its storage dropped, the fastest of ``reps`` loops (``drop_action_ns``)."""
    a, b = torch.ones(16, device="cpu"), torch.ones(16, device="cpu")
    add = torch.ops.aten.add.Tensor
    eng = RecomputeEngine(lambda st: None, lambda nbytes: False)
    d = Decision("0:0", Method.RECOMPUTE, 64, 0, 1, replay_ops=(0,))
    inputs = {storage_key(a.untyped_storage()), storage_key(b.untyped_storage())}
    best = math.inf
    for _ in range(reps):
        t0 = clock()
        for _ in range(n):
            eng.reset()
            rec = eng.record(0, add, (a, b), {}, [a, b], (), False)
            out = add(a, b)
            eng.recorded_outputs(rec, out, inputs)
            st = out.untyped_storage()
            eng.check_replayable(d, st)
            eng.source_keys(d)
            resize(st, 0)
        best = min(best, clock() - t0)
    return best / n * 1e9


def swap_cycle_ns(
    nbytes: int, reps: int = 5, clock: Callable[[], float] = time.perf_counter
) -> float:
    """ns of one swap-out and swap-in of an ``nbytes`` storage through the CPU backend, the
    fastest of ``reps``."""
    be = backend_for("cpu")
    try:
        st = torch.ones(max(1, nbytes // 4), device="cpu").untyped_storage()
        n = st.nbytes()
        buf = be.host_buffer(n)
        best = math.inf
        for _ in range(reps):
            t0 = clock()
            c = be.copy_out(st, buf)
            c.wait()
            be.free_after_copy_out(st, c)
            resize(st, n)
            be.copy_in(buf, st).wait()
            best = min(best, clock() - t0)
    finally:
        be.close()
    return best * 1e9


def figures(
    lines: dict[str, float], cycle_ns: float, nbytes: int, ns_per_byte: tuple[float, float]
) -> dict:
    """``TraceMeta.host_costs`` keys from the timed lines (ns; Note [Calibration of the
    runtime's slow path]); ``ns_per_byte``: the trace's measured copy cost out and in, charged
    as ``runtime_cost_ns`` charges a swap's copies. A figure of 0 or less is left out."""
    copies = nbytes * sum(max(x, CPU.copy_ns_per_byte) for x in ns_per_byte)
    raw = {
        "slow_op_ns": lines["slow path"] - lines["hot path"],
        "replay_op_ns": lines["passive mode"] - lines["no mode"],
        "swap_action_ns": (cycle_ns - copies) / 2,
        "loop_hot_op_ns": lines["hot path"] - lines["no mode"],
    }
    if "recompute drop" in lines:
        raw["drop_action_ns"] = lines["recompute drop"] - lines["no mode"]
    return {k: int(round(v)) for k, v in raw.items() if int(round(v)) > 0}


def host_calibration(
    nbytes: int,
    ns_per_byte: tuple[float, float],
    *,
    clock: Callable[[], float] = time.perf_counter,
    n: int = 2000,
    reps: int = 3,
) -> tuple[dict, dict]:
    """The runtime's host costs on this host now, for a script whose typical storage is
    ``nbytes``: (``host_costs`` keys, the timed lines in µs for ``TraceMeta.extra``)."""
    lines = per_op_ns(n, reps, clock)
    cycle = swap_cycle_ns(nbytes, reps + 2, clock)
    shown = {f"{k} ns/op": round(v, 1) for k, v in lines.items()}
    shown[f"swap cycle {nbytes} B ns"] = round(cycle, 1)
    return figures(lines, cycle, nbytes, ns_per_byte), shown


PATHS = ("hot", "guarded", "slow")


class RuntimeProbe:
    """A runtime whose plan is ``ops`` (``[[name, shape_signature], ...]``, the recorded
    iteration), its ops on the runtime's ``path`` (``PATHS``: the hot path, the hot path
    guarded as while a storage is out, or the slow path: an action at every op), its step hooks
    following ``leader``'s, for the tracer's steps (Note [The runtime in the script's steps]). A
    context manager; ``steady(n)``: the last ``n`` iterations it saw all followed the plan;
    ``slow_calls``: how many ops took the slow path."""

    def __init__(self, ops: list[list[str]], leader, path: str, device: str = "cpu") -> None:
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        # the traced device's runtime: on CUDA its slow path names CUDA storages, as a run's
        # does (Note [Host work on CUDA] in planner/costs.py)
        prov = Provenance("none", {}, 1 << 40, "", "", 0, device, 12e9, 12e9, "", 0.0)
        # the loop's plans (_loop_plan): a prefetch of a storage that is not out at every op,
        # or one action past the iteration's end (a non-empty plan with none in it)
        n = len(ops)
        acting = path == "slow"
        actions = [Action(k, Step.PREFETCH, "0:0") for k in (range(n) if acting else [n])]
        plan = Plan(prov, Predictions(0, 0, 0, 0), [], [list(o) for o in ops], actions=actions)
        self.rt = Runtime(plan, measure_memory=False, device=device, passive=False)
        self.rt.first_checked_iteration = 1 << 62  # never a foreign-plan refusal or warning
        self.rt._step_leader = leader
        self.path = path
        self.slow_calls = 0

    def __enter__(self) -> RuntimeProbe:
        with _installed():
            self.rt.__enter__()
        ex = self.rt.ex
        slow_op = ex.slow_op

        def counted(func, args, kwargs):
            self.slow_calls += 1
            return slow_op(func, args, kwargs)

        ex.slow_op = counted
        if self.path == "slow":
            _acting_everywhere(ex)
        if self.path == "guarded":  # as while a storage is out: every op's inputs checked
            update = ex._update_fast

            def guarded() -> None:
                update()
                if ex.mode.fast is ex.cursor.table.fast:
                    ex.mode.fast, ex.mode.evicted = ex.cursor.table.guarded, _ANY

            ex._update_fast = guarded
            guarded()
        return self

    def __exit__(self, *exc) -> None:
        self.rt.__exit__(*exc)

    def steady(self, n: int) -> bool:
        its = self.rt.report.iterations if self.rt.report is not None else []
        done = [s for s in its if s.complete]
        return len(done) >= n and not any(s.diverged for s in done[-n:])


# no storage has this key (``storage_key`` is a StorageImpl's address): the slow probe's entry
_NO_STORAGE = -1


def _acting_everywhere(ex) -> None:
    """Note [The runtime in the script's steps]: each op of the slow probe's plan does what a
    real plan's action op does short of moving bytes: besides the prefetch of a storage that
    is not out, it names its first input and its first output (``"x{k}:0"``, ``"k:0"``) and,
    after it, evicts that output, which has no decision in the plan (the window lookup finds
    none, so nothing is evicted); and an entry that is no storage's keeps the executor's
    evicted-storage map non-empty, as while a real plan has something out, so every op's
    inputs are looked up in it (``_keys``, the on-demand restore's lookups)."""
    table = ex.cursor.table
    for k in range(table.n_ops):
        acts = table.actions(k)
        acts.name_inputs.append((0, f"x{k}:0"))
        acts.name_outputs.append((0, f"{k}:0"))
        acts.after.append((Step.EVICT_SWAP, f"{k}:0"))
    ex.entries[_NO_STORAGE] = Entry(
        "probe:none", lambda: None, 0, True, Reason.PASSIVE, state=Residency.OUT
    )
    ex._update_fast()


def runtime_probe(ops: list[list[str]], leader, path: str, device: str = "cpu") -> RuntimeProbe:
    """The tracer's ``runtime_probe`` (Note [The runtime in the script's steps])."""
    return RuntimeProbe(ops, leader, path, device)
