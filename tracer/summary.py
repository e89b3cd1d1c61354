"""What ``capuchin show TRACE`` prints: a summary of one trace (torch-free; reads a ``Trace``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import pandas as pd

from ..units import format_bytes
from .reader import Trace
from .schema import Col, Kind, Phase, Role


@dataclass(frozen=True)
class TraceSummary:
    """Summary of the steady iteration of a trace (``meta.steady_iteration``).

    start_bytes: bytes live when the iteration starts (RESIDENT rows); start_bytes_by_kind splits
        them by ``Kind`` (parameters, gradients, optimizer state, ...).
    peak_bytes: maximum bytes live while an op of the iteration runs, everything included
        (``Trace.memory.op_peak_bytes``: its scratch memory too).
    peak_op_index / peak_op_name / peak_phase: the op during which that maximum is reached.
    activation_bytes_at_peak: of ``peak_bytes``, the storages of kind activation.
    transient_peak_bytes: peak of the bytes allocated inside the iteration and not yet freed
        (what the CPU allocator's "Total Allocated" shows over a one-iteration profiling window).
    allocator_peak_bytes: the same, as the allocator's own events measured it during recording
        (None if the trace has no such measurement; under a cap, the capped run's).
    trace_budget_bytes / measured_peak_bytes: the memory cap the trace was recorded under
        (``capuchin trace --budget``) and the peak the allocator measured while tracing under it;
        None for an uncapped trace. The other figures are the unmanaged program's either way.
    """

    path: str
    device: str
    device_name: str
    torch_version: str
    script: str
    iterations: list[int]
    steady_iteration: int
    ops_per_iteration: int
    ops_by_phase: dict[str, int]
    tensors: int
    storages: int
    start_bytes: int
    start_bytes_by_kind: dict[str, int]
    peak_bytes: int
    peak_op_index: int
    peak_op_name: str
    peak_phase: str
    activation_bytes_at_peak: int
    transient_peak_bytes: int
    allocator_peak_bytes: int | None
    regular: bool
    first_divergence: dict | None
    bandwidth_d2h_bytes_per_s: float
    bandwidth_h2d_bytes_per_s: float
    trace_budget_bytes: int | None = None
    measured_peak_bytes: int | None = None
    # kinds of iteration, most frequent first: {"train": [1, 3], "kind1": [2]} (iteration_kinds)
    kinds: dict | None = None
    # the steady iteration's summed op times (under the profiler) and the plain step the tracer
    # timed without tracer or profiler (None: not timed; Note [Plain step] in tracer/record.py)
    op_time_ns: int = 0
    plain_iteration_ns: int | None = None
    plain_iteration_note: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def transient_memory(trace: Trace, iteration: int) -> pd.Series:
    """Bytes allocated inside ``iteration`` and not yet freed, at their highest while each op runs
    (its SCRATCH included). Index: op_index."""
    ev = trace.iteration(iteration)
    alloc = ev[(ev[Col.ROLE] == Role.OUTPUT.value) & ev[Col.ALLOC].fillna(False).astype(bool)]
    mine = set(alloc[Col.STORAGE])
    frees = ev[(ev[Col.ROLE] == Role.FREE.value) & ev[Col.STORAGE].isin(mine)]
    scratch = ev[ev[Col.ROLE] == Role.SCRATCH.value]
    ops = sorted(set(ev.loc[ev[Col.OP] >= 0, Col.OP]))
    grow = alloc.groupby(Col.OP)[Col.STORAGE_BYTES].sum().reindex(ops, fill_value=0)
    shrink = frees.groupby(Col.OP)[Col.STORAGE_BYTES].sum().reindex(ops, fill_value=0)
    extra = scratch.groupby(Col.OP)[Col.STORAGE_BYTES].sum().reindex(ops, fill_value=0)
    after = (grow - shrink).cumsum()
    during = after.shift(1, fill_value=0) + grow + extra
    return during.astype("int64")


def summarize(trace: Trace, iteration: int | None = None) -> TraceSummary:
    """Summarize ``iteration`` (default: the trace's steady iteration)."""
    meta = trace.meta
    it = (
        iteration
        if iteration is not None
        else (meta.steady_iteration if meta.steady_iteration is not None else max(meta.iterations))
    )
    ev = trace.iteration(it)
    ops = trace.ops[trace.ops[Col.ITERATION] == it]
    by_phase = {p.value: int((ops[Col.PHASE] == p.value).sum()) for p in Phase}
    acc = ev[ev[Col.ROLE].isin([Role.INPUT.value, Role.WRITE.value, Role.OUTPUT.value])]
    resident = ev[ev[Col.ROLE] == Role.RESIDENT.value]
    start = int(resident[Col.STORAGE_BYTES].sum())
    by_kind = {
        str(k): int(v) for k, v in resident.groupby(Col.KIND)[Col.STORAGE_BYTES].sum().items() if v
    }
    mem = trace.memory[trace.memory[Col.ITERATION] == it]
    if len(mem):
        top = mem.loc[mem["op_peak_bytes"].idxmax()]
        peak, peak_op = int(top["op_peak_bytes"]), int(top[Col.OP])
    else:
        peak, peak_op = start, -1
    if peak < start:
        peak, peak_op = start, -1
    row = ops[ops[Col.OP] == peak_op]
    peak_name = str(row[Col.OP_NAME].iloc[0]) if len(row) else ""
    peak_phase = str(row[Col.PHASE].iloc[0]) if len(row) else ""
    transient = transient_memory(trace, it)
    allocator = meta.extra.get("allocator_peak_bytes", {}).get(str(it))
    return TraceSummary(
        path=str(trace.path) if trace.path else "",
        device=meta.device,
        device_name=meta.device_name,
        torch_version=meta.torch_version,
        script=" ".join([meta.script, *meta.argv]).strip(),
        iterations=list(meta.iterations),
        steady_iteration=int(it),
        ops_per_iteration=int(len(ops)),
        ops_by_phase=by_phase,
        tensors=int(acc[Col.TENSOR].nunique()),
        storages=int(ev.loc[ev[Col.ROLE] != Role.SCRATCH.value, Col.STORAGE].nunique()),
        start_bytes=start,
        start_bytes_by_kind=by_kind,
        peak_bytes=peak,
        peak_op_index=peak_op,
        peak_op_name=peak_name,
        peak_phase=peak_phase,
        activation_bytes_at_peak=_activation_bytes_at(ev, peak_op),
        transient_peak_bytes=int(transient.max()) if len(transient) else 0,
        allocator_peak_bytes=int(allocator) if allocator is not None else None,
        regular=bool(meta.regular),
        first_divergence=meta.first_divergence,
        bandwidth_d2h_bytes_per_s=float(meta.bandwidth_d2h_bytes_per_s),
        bandwidth_h2d_bytes_per_s=float(meta.bandwidth_h2d_bytes_per_s),
        trace_budget_bytes=meta.trace_budget_bytes,
        measured_peak_bytes=meta.measured_peak_bytes,
        kinds=dict(_planned_kinds(trace)),
        op_time_ns=int(ops[Col.DURATION_NS].fillna(0).clip(lower=0).sum()),
        plain_iteration_ns=meta.plain_iteration_ns,
        plain_iteration_note=meta.extra.get("plain_iteration_note"),
    )


def _planned_kinds(trace: Trace) -> list[tuple[str, list[int]]]:
    """The kinds ``capuchin plan`` plans: ``iteration_kinds`` split by shapes (Note [Shape
    kinds] in planner/api.py, which imports this module: imported here, not at the top)."""
    from ..planner.api import shape_kinds

    return shape_kinds(trace, iteration_kinds(trace))


def iteration_kinds(trace: Trace) -> list[tuple[str, list[int]]]:
    """The kinds of iteration a trace recorded (Note [Iteration kinds] in planner/api.py):
    ``[(kind, [iterations...]), ...]`` grouped by op names, the most frequent first (ties: the
    one recorded last first), named "train", "kind1", ... ."""
    ops = trace.ops.sort_values([Col.ITERATION, Col.OP], kind="stable")
    groups: dict[tuple, list[int]] = {}
    for it, names in ops.groupby(Col.ITERATION, sort=True)[Col.OP_NAME]:
        groups.setdefault(tuple(names), []).append(int(it))
    order = sorted(groups.values(), key=lambda its: (-len(its), -its[-1]))
    return [("train" if i == 0 else f"kind{i}", its) for i, its in enumerate(order)]


def _activation_bytes_at(ev: pd.DataFrame, op_index: int) -> int:
    """Bytes of activation storages allocated in the iteration and still live after op_index."""
    act = ev[
        (ev[Col.ROLE] == Role.OUTPUT.value)
        & ev[Col.ALLOC].fillna(False).astype(bool)
        & (ev[Col.KIND] == Kind.ACTIVATION.value)
        & (ev[Col.OP] <= op_index)
    ]
    freed = set(ev.loc[(ev[Col.ROLE] == Role.FREE.value) & (ev[Col.OP] <= op_index), Col.STORAGE])
    live = act[~act[Col.STORAGE].isin(freed)]
    return int(live.drop_duplicates(Col.STORAGE)[Col.STORAGE_BYTES].sum())


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_summary(s: TraceSummary) -> str:
    """Human-readable summary (what ``capuchin show`` prints)."""
    phases = ", ".join(f"{v} {k}" for k, v in s.ops_by_phase.items())
    lines = [
        f"trace      {s.path}",
        f"script     {s.script}",
        f"device     {s.device} ({s.device_name}), torch {s.torch_version}",
        f"iterations {s.iterations} recorded; steady iteration {s.steady_iteration}; "
        + ("regular (identical op sequences)" if s.regular else "NOT regular"),
    ]
    if s.first_divergence:
        d = s.first_divergence
        lines.append(
            f"           first divergence: iteration {d.get('iteration')} op "
            f"{d.get('op_index')}: expected {d.get('expected')}, got {d.get('got')}"
        )
    if s.kinds and len(s.kinds) > 1:
        # what planner/api.py make_plan does (Note [Iteration kinds] there): kinds are planned
        # only when the most frequent one was recorded at least twice
        first = next(iter(s.kinds.values()))
        lines.append(
            "kinds      "
            + "; ".join(f"{k}: iterations {its}" for k, its in s.kinds.items())
            + (
                " (capuchin plan plans each kind)"
                if len(first) > 1
                else " (each recorded once: capuchin plan needs --iteration N, or a trace of "
                "more iterations with --iterations)"
            )
        )
    lines += [
        f"ops        {s.ops_per_iteration} per iteration ({phases})",
        f"tensors    {s.tensors} tensors in {s.storages} storages",
        f"memory     {_mb(s.start_bytes)} live at iteration start ("
        + ", ".join(
            f"{k} {_mb(v)}" for k, v in sorted(s.start_bytes_by_kind.items(), key=lambda kv: -kv[1])
        )
        + ")",
        f"           peak {_mb(s.peak_bytes)} during op {s.peak_op_index} {s.peak_op_name} "
        f"({s.peak_phase}); activations at the peak {_mb(s.activation_bytes_at_peak)}",
        f"           allocated inside the iteration: peak {_mb(s.transient_peak_bytes)}"
        + (
            f" (allocator measured {_mb(s.allocator_peak_bytes)})"
            if s.allocator_peak_bytes is not None
            else ""
        ),
        f"bandwidth  device->host {s.bandwidth_d2h_bytes_per_s / 1e9:.2f} GB/s, "
        f"host->device {s.bandwidth_h2d_bytes_per_s / 1e9:.2f} GB/s",
        f"time       {s.op_time_ns / 1e6:.2f} ms of op times in the steady iteration (as "
        "recorded); "
        + (
            f"plain step {s.plain_iteration_ns / 1e6:.2f} ms (timed without tracer or profiler)"
            if s.plain_iteration_ns is not None
            else f"plain step not timed ({s.plain_iteration_note or 'no such field in the trace'})"
        ),
    ]
    if s.trace_budget_bytes is not None:
        measured = (
            "not measured"
            if s.measured_peak_bytes is None
            else f"measured peak {format_bytes(s.measured_peak_bytes)} "
            f"({s.measured_peak_bytes / s.trace_budget_bytes:.0%} of it)"
        )
        lines.append(
            f"cap        traced under {format_bytes(s.trace_budget_bytes)} by passive eviction: "
            f"{measured}; the figures above are the unmanaged program's"
        )
    return "\n".join(lines)
