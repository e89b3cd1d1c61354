"""Compile a ``Plan`` into the tables the tracker reads per op (everything decided before the run).

``ActionTable.fast[k]`` is the OpOverload expected at op ``k`` when op ``k`` needs nothing but the
check, else None: the tracker's hot path is ``func is fast[k]`` (Note [Hot path] in tracker.py).
``ActionTable.guarded[k]`` is the same less the ops that write an argument in place: the table of
the guarded hot path while storages are evicted.
``ActionTable.ops[k]`` (an ``OpActions``) says what else op ``k`` does: storages to name (the ids of
Note [Tensor and storage ids] are positional: ``"k:j"`` is output ``j`` of op ``k``, ``"x{k}:{a}"``
the ``a``-th flattened tensor argument of op ``k``, so naming needs no bookkeeping on other ops),
whether to record the call for a later replay, and the plan's before/after steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..planner.plan import Decision, Method, Plan, Step
from ..tracer.hooks import op_info
from ..tracer.schema import IdKind, TensorId, shape_signature


@dataclass
class OpActions:
    before: list[tuple[Step, str]] = field(default_factory=list)
    after: list[tuple[Step, str]] = field(default_factory=list)
    name_inputs: list[tuple[int, str]] = field(default_factory=list)  # (flat arg, storage id)
    name_outputs: list[tuple[int, str]] = field(default_factory=list)  # (flat output, storage id)
    record: bool = False  # a recompute decision replays this op
    sync_out: list[str] = field(default_factory=list)  # swap-outs the plan has complete by now

    @property
    def empty(self) -> bool:
        return not (
            self.before
            or self.after
            or self.name_inputs
            or self.name_outputs
            or self.record
            or self.sync_out
        )


def resolve_op(name: str):
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default``, or None if unknown here."""
    try:
        ns, op, overload = name.split(".", 2)
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (ValueError, AttributeError, RuntimeError):
        return None


@dataclass
class ActionTable:
    names: list[str]  # op name per op index (the trace's op_name)
    expected: list  # OpOverload (or None) per op index
    signatures: list[str]
    ops: dict[int, OpActions]
    fast: list
    # Note [Several windows per storage] in planner/plan.py: every decision of each storage, in
    # the order of their evicted-accesses (disjoint windows, so at most one is out at a time)
    windows: dict[str, tuple[Decision, ...]]
    op_peak_bytes: list[int] = field(default_factory=list)  # the plan's simulated curve
    guarded: list = field(default_factory=list)  # ``fast`` less the ops that write in place
    kind: str = "train"  # the plan's kind of iteration (Note [Iteration kinds] in tracker.py)
    # ``signatures`` parsed once at plan load: per op the tuple of its inputs' shapes, compared
    # with the live ``tuple(t.shape ...)`` (``torch.Size`` is a tuple) instead of formatting a
    # signature string per checked op; None where the string is ambiguous ("" is no tensor or
    # one 0-d tensor): those ops compare strings
    shapes: list = field(default_factory=list)
    # ops ``0..check_until-1`` are checked by shapes in every iteration: where kinds of the
    # same op names part (Note [Shape kinds at run time] in tracker.py)
    check_until: int = 0

    @property
    def n_ops(self) -> int:
        return len(self.expected)

    def decisions(self):
        """Every decision of the plan, storage by storage."""
        return (d for ds in self.windows.values() for d in ds)

    def evicting(self, sid: str, k: int) -> Decision | None:
        """The decision of storage ``sid`` whose evicted-access is op ``k``; None if none."""
        return next((d for d in self.windows.get(sid, ()) if d.evict_op == k), None)

    def size_of(self, sid: str) -> int | None:
        """Storage ``sid``'s bytes as traced (every window of it has them); None: no decision."""
        ds = self.windows.get(sid)
        return ds[0].size_bytes if ds else None

    def shapes_match(self, k: int, flat: list) -> bool:
        """Op ``k``'s live tensor inputs ``flat`` have the traced shapes (``signatures[k]``)."""
        exp = self.shapes[k] if k < len(self.shapes) else None
        if exp is None:
            return shape_signature(t.shape for t in flat) == self.signatures[k]
        return len(flat) == len(exp) and tuple([t.shape for t in flat]) == exp

    def actions(self, k: int) -> OpActions:
        a = self.ops.get(k)
        if a is None:
            a = self.ops[k] = OpActions()
            if k < len(self.fast):
                self.fast[k] = None
            if k < len(self.guarded):
                self.guarded[k] = None
        return a

    def late_match(self, k: int, func, info=None) -> bool:
        """Op ``k`` is ``func`` although no OpOverload was known for its name when the plan was
        compiled: ops of libraries the script imports later (``torch.ops.fsdp.*`` exists once
        FSDP2 is imported) resolve at their first call, by name. A compiled region (``info``
        of a higher-order op) matches by its name at every call and never takes the fast path:
        one op serves every region (Note [torch.compile] in tracer/compiled.py)."""
        if info is not None and info.hop:
            return self.expected[k] is None and info.name == self.names[k]
        if self.expected[k] is not None or str(func) != self.names[k]:
            return False
        self.expected[k] = func
        if k not in self.ops:
            self.fast[k] = func
            if k < len(self.guarded):
                self.guarded[k] = None if _writes(func) else func
        return True

    def move_before(self, step: Step, sid: str, src: int, dst: int) -> None:
        """Move a before-step from op ``src`` to op ``dst`` (late prefetch feedback)."""
        a = self.ops.get(src)
        if a is not None and (step, sid) in a.before:
            a.before.remove((step, sid))
        self.actions(dst).before.append((step, sid))


def compile_plan(plan: Plan) -> ActionTable:
    expected = [resolve_op(o[0]) for o in plan.ops]
    signatures = [o[1] if len(o) > 1 else "" for o in plan.ops]
    ops: dict[int, OpActions] = {}

    def at(k: int) -> OpActions:
        return ops.setdefault(k, OpActions())

    # Note [Several windows per storage] in planner/plan.py: decisions by storage and window
    # (a dead decision is one more window, planner/dead.py Note [Dead storages])
    windows: dict[str, list[Decision]] = {}
    for d in sorted(plan.decisions, key=lambda d: d.evict_op):
        windows.setdefault(d.storage_id, []).append(d)
    named: set[str] = set()
    for d in plan.decisions:
        named.update((d.storage_id, *d.sources, *d.keep))
        if d.method is Method.RECOMPUTE:
            for k in d.replay_ops:
                at(k).record = True
        elif d.out_done_op is not None:
            at(d.out_done_op).sync_out.append(d.storage_id)
    for sid in sorted(named):
        try:
            tid = TensorId.parse(sid)
        except ValueError:
            continue
        if tid.kind is IdKind.OUTPUT:
            at(tid.op_index).name_outputs.append((tid.position, sid))
        elif tid.kind is IdKind.INPUT:
            at(tid.op_index).name_inputs.append((tid.position, sid))
    for a in plan.actions:
        (at(a.op_index).before if a.before else at(a.op_index).after).append((a.step, a.storage_id))
    fast = [None if k in ops else f for k, f in enumerate(expected)]
    guarded = [None if f is None or _writes(f) else f for f in fast]
    return ActionTable(
        [o[0] for o in plan.ops],
        expected,
        signatures,
        ops,
        fast,
        {sid: tuple(ds) for sid, ds in windows.items()},
        list(plan.op_peak_bytes),
        guarded,
        plan.kind,
        [parse_signature(s) for s in signatures],
    )


def parse_signature(sig: str) -> tuple | None:
    """``"4x8;8"`` -> ``((4, 8), (8,))`` (the inverse of ``shape_signature``); None for ``""``
    (no tensor input, or one 0-d tensor) and for anything that does not parse."""
    if not sig:
        return None
    try:
        return tuple(
            tuple(int(d) for d in part.split("x")) if part else () for part in sig.split(";")
        )
    except ValueError:
        return None


def _writes(func) -> bool:
    info = op_info(func)
    return bool(info.write_args or info.unannotated_write_args)
