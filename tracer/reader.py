"""Reading and writing trace files. Imports no torch (the planner and notebooks use it).

``load_trace(path)`` validates once (schema version, columns, dtypes) and returns a ``Trace`` whose
DataFrames downstream code can trust. ``write_trace`` is atomic: the file appears whole or not at
all.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import TraceFormatError
from ..outputs import write_with_fallback
from .schema import ACCESS_ROLES, META_KEY, SCHEMA, SCHEMA_VERSION, Col, Role, TraceMeta


def write_trace(
    events: pd.DataFrame | pa.Table, meta: TraceMeta, path: str | os.PathLike, *, force: bool = True
) -> Path:
    """Write ``events`` (columns of ``SCHEMA``) and ``meta`` to ``path`` atomically; without
    ``force`` an existing file is kept (``OutputExistsError``). See Note [Output files]."""
    path = Path(path)
    table = events if isinstance(events, pa.Table) else _to_table(events)
    table = table.replace_schema_metadata({META_KEY: meta.to_bytes()})
    return write_with_fallback(
        path, lambda tmp: pq.write_table(table, tmp, compression="zstd"), force=force
    )


def _to_table(events: pd.DataFrame) -> pa.Table:
    missing = [c for c in SCHEMA.names if c not in events.columns]
    if missing:
        raise ValueError(f"event table lacks columns {missing}")
    return pa.Table.from_pandas(events[list(SCHEMA.names)], schema=SCHEMA, preserve_index=False)


@dataclass
class Trace:
    """A loaded trace: the event table, its metadata, and derived DataFrames (cached)."""

    path: Path | None
    events: pd.DataFrame
    meta: TraceMeta

    @cached_property
    def accesses(self) -> pd.DataFrame:
        """One row per tensor access (roles input, write, output)."""
        roles = [r.value for r in ACCESS_ROLES]
        return self.events[self.events[Col.ROLE].isin(roles)].reset_index(drop=True)

    @cached_property
    def ops(self) -> pd.DataFrame:
        """One row per (iteration, op): name, phase, start_ns, duration_ns, seeded, op_args."""
        acc = self.accesses
        cols = [
            Col.ITERATION,
            Col.OP,
            Col.OP_NAME,
            Col.PHASE,
            Col.START_NS,
            Col.DURATION_NS,
            Col.SEEDED,
            Col.OP_ARGS,
        ]
        return (
            acc[cols]
            .drop_duplicates([Col.ITERATION, Col.OP])
            .sort_values([Col.ITERATION, Col.OP])
            .reset_index(drop=True)
        )

    @cached_property
    def tensors(self) -> pd.DataFrame:
        """One row per (iteration, storage): bytes, kind, first/last access, alloc and free op."""
        ev = self.events
        acc = self.accesses
        g = acc.groupby([Col.ITERATION, Col.STORAGE], sort=False)
        out = g.agg(
            storage_bytes=(Col.STORAGE_BYTES, "max"),
            kind=(Col.KIND, "first"),
            first_op=(Col.OP, "min"),
            last_op=(Col.OP, "max"),
            accesses=(Col.OP, "size"),
        )
        allocs = acc[acc[Col.ALLOC].fillna(False).astype(bool)]
        out["alloc_op"] = allocs.groupby([Col.ITERATION, Col.STORAGE])[Col.OP].min()
        frees = ev[ev[Col.ROLE] == Role.FREE.value]
        out["free_op"] = frees.groupby([Col.ITERATION, Col.STORAGE])[Col.OP].min()
        return out.reset_index()

    @cached_property
    def memory(self) -> pd.DataFrame:
        """The memory curve, per iteration: columns iteration, op_index, live_bytes, op_peak_bytes.

        live_bytes: after op k = bytes resident at iteration start + allocations so far - frees
            so far (FREE rows of op k count: they happen after it).
        op_peak_bytes: while op k runs = live after op k-1 + what op k allocates + its SCRATCH
            (Role.SCRATCH). The iteration's peak is ``max(op_peak_bytes)``.
        """
        ev = self.events
        rows = []
        for it, e in ev.groupby(Col.ITERATION, sort=True):
            start = int(e.loc[e[Col.ROLE] == Role.RESIDENT.value, Col.STORAGE_BYTES].sum())
            alloc = e[(e[Col.ROLE] == Role.OUTPUT.value) & e[Col.ALLOC].fillna(False).astype(bool)]
            free = e[e[Col.ROLE] == Role.FREE.value]
            scratch = e[e[Col.ROLE] == Role.SCRATCH.value]
            ops = sorted(set(e.loc[e[Col.OP] >= 0, Col.OP]))
            grow = alloc.groupby(Col.OP)[Col.STORAGE_BYTES].sum().reindex(ops, fill_value=0)
            shrink = free.groupby(Col.OP)[Col.STORAGE_BYTES].sum().reindex(ops, fill_value=0)
            extra = scratch.groupby(Col.OP)[Col.STORAGE_BYTES].sum().reindex(ops, fill_value=0)
            live = start + (grow - shrink).cumsum()
            before = live.shift(1, fill_value=start)
            # frees before the first op (op_index -1) lower what op 0 starts from
            early = int(free.loc[free[Col.OP] < 0, Col.STORAGE_BYTES].sum())
            live, before = live - early, before - early
            rows.append(
                pd.DataFrame(
                    {
                        Col.ITERATION: it,
                        Col.OP: ops,
                        "live_bytes": live.astype("int64").to_numpy(),
                        "op_peak_bytes": (before + grow + extra).astype("int64").to_numpy(),
                    }
                )
            )
        if not rows:
            return pd.DataFrame(
                {Col.ITERATION: [], Col.OP: [], "live_bytes": [], "op_peak_bytes": []}
            )
        return pd.concat(rows, ignore_index=True)

    def iteration(self, it: int) -> pd.DataFrame:
        """The event rows of one iteration."""
        return self.events[self.events[Col.ITERATION] == it].reset_index(drop=True)


def load_trace(path: str | os.PathLike) -> Trace:
    """Load and validate a trace file. Raises ``TraceFormatError`` naming the file on any problem."""
    path = Path(path)
    if not path.exists():
        raise TraceFormatError(f"{path}: no such file")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise TraceFormatError(f"{path}: not a readable Parquet file ({_short(exc)})") from None
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise TraceFormatError(
            f"{path}: Parquet file is not a capuchin trace (no '{META_KEY.decode()}' metadata)"
        )
    try:
        meta = TraceMeta.from_bytes(raw)
    except Exception as exc:
        raise TraceFormatError(f"{path}: trace metadata is corrupt ({_short(exc)})") from None
    if not _is_int(meta.schema_version):
        raise TraceFormatError(
            f"{path}: trace metadata: schema_version {meta.schema_version!r} is not an integer"
        )
    if meta.schema_version != SCHEMA_VERSION:
        raise TraceFormatError(
            f"{path}: trace schema version {meta.schema_version}, this capuchin reads version "
            f"{SCHEMA_VERSION}; re-record it with `capuchin trace`"
        )
    problem = meta_problem(meta)
    if problem:
        raise TraceFormatError(f"{path}: trace metadata: {problem}")
    missing = [c for c in SCHEMA.names if c not in table.column_names]
    if missing:
        raise TraceFormatError(f"{path}: trace lacks columns {', '.join(missing)}")
    for f in SCHEMA:
        got = table.schema.field(f.name).type
        if got != f.type:
            raise TraceFormatError(f"{path}: column '{f.name}' has type {got}, expected {f.type}")
    events = table.select(SCHEMA.names).to_pandas()
    bad_roles = set(events[Col.ROLE].unique()) - {r.value for r in Role}
    if bad_roles:
        raise TraceFormatError(f"{path}: unknown roles {sorted(bad_roles)}")
    in_table = sorted(int(i) for i in events[Col.ITERATION].unique())
    missing_its = [i for i in in_table if i not in meta.iterations]
    if missing_its:
        raise TraceFormatError(
            f"{path}: iterations {missing_its} are in the event table but not "
            f"in the metadata's iterations {meta.iterations}"
        )
    if meta.steady_iteration is not None and meta.steady_iteration not in in_table:
        raise TraceFormatError(
            f"{path}: trace metadata: steady_iteration "
            f"{meta.steady_iteration} has no events (iterations in the table: "
            f"{in_table})"
        )
    return Trace(path=path, events=events, meta=meta)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def meta_problem(meta: TraceMeta) -> str | None:
    """The first problem with ``meta``'s fields (types and ranges), or None. The one check of
    trace metadata, applied by ``load_trace``."""
    for name in ("capuchin_version", "torch_version", "device_name", "script", "date", "source"):
        if not isinstance(getattr(meta, name), str):
            return f"{name} {getattr(meta, name)!r} is not a string"
    if meta.device not in ("cpu", "cuda"):
        return f"device {meta.device!r} is not 'cpu' or 'cuda'"
    for name in ("bandwidth_d2h_bytes_per_s", "bandwidth_h2d_bytes_per_s"):
        v = getattr(meta, name)
        if not _is_number(v) or not math.isfinite(v) or v < 1:
            return f"{name} {v!r} is not a finite rate of at least 1 byte/s"
    its = meta.iterations
    if not isinstance(its, list) or not its or not all(_is_int(i) and i >= 0 for i in its):
        return f"iterations {its!r} is not a non-empty list of iteration numbers (integers >= 0)"
    if len(set(its)) != len(its):
        return f"iterations {its!r} lists an iteration twice"
    if not _is_int(meta.warmup) or meta.warmup < 0:
        return f"warmup {meta.warmup!r} is not an integer >= 0"
    if not isinstance(meta.argv, list) or not all(isinstance(a, str) for a in meta.argv):
        return f"argv {meta.argv!r} is not a list of strings"
    if not isinstance(meta.regular, bool):
        return f"regular {meta.regular!r} is not true or false"
    if meta.first_divergence is not None and not isinstance(meta.first_divergence, dict):
        return f"first_divergence {meta.first_divergence!r} is not an object"
    if meta.steady_iteration is not None and (
        not _is_int(meta.steady_iteration) or meta.steady_iteration not in its
    ):
        return (
            f"steady_iteration {meta.steady_iteration!r} is not one of the recorded "
            f"iterations {its}"
        )
    if meta.plain_iteration_ns is not None and (
        not _is_int(meta.plain_iteration_ns) or meta.plain_iteration_ns < 1
    ):
        return f"plain_iteration_ns {meta.plain_iteration_ns!r} is not null or an integer >= 1"
    if meta.host_costs is not None and not (
        isinstance(meta.host_costs, dict)
        and all(_is_int(v) and v >= 0 for v in meta.host_costs.values())
    ):
        return f"host_costs {meta.host_costs!r} is not null or an object of integers >= 0"
    if not isinstance(meta.extra, dict):
        return f"extra {meta.extra!r} is not an object"
    return None


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
