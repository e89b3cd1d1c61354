"""The planning problem: one steady-state iteration of a trace, as ops and storages. No torch.

``Problem.from_trace(trace)`` is the one step from a ``Trace`` to what every policy and the
simulator read; ``Problem.from_lists(ops, sizes)`` builds one from a hand-written op list (through
a synthetic trace, so both go through the same code).

Units: sizes in bytes, times in ns on the device's compute stream. Memory is counted per
*storage* (views and in-place ops share one; see Note [Tensor and storage ids] in
tracer/schema.py), which is also what the runtime evicts.

# Note: [Baseline timeline]
# The baseline compute stream runs the ops back to back: op k starts at
# ``start_ns[k] = sum(duration_ns[:k])`` (gaps between kernels are not counted, which only makes
# swap hiding look harder). ``live_bytes[k]`` is the memory in use *while op k runs*: storages
# resident at iteration start, plus those allocated by ops 0..k, minus those freed after ops
# 0..k-1, plus op k's scratch memory (Role.SCRATCH: workspace its kernels use and release before
# it returns). The peak is ``max(live_bytes)``.

# Note: [Plain baseline]
# A traced op's duration is taken under the profiler and the tracer's dispatch mode. On CPU these
# are host times that the profiler's per-op and memory accounting inflate (1.5-6x the plain step
# on real scripts), while what a plan adds (copies at the measured bandwidth, the runtime's host
# costs, costs.py) is measured without them; an overhead stated against the traced sum reads
# small where the user's slowdown is large. A trace that timed the plain step (Note [Plain step]
# in tracer/record.py, ``TraceMeta.plain_iteration_ns``) corrects this:
# - CPU, plain step shorter than the iteration's summed op times: every op duration is multiplied
#   by one factor ``plain / sum`` (rounded to ns), so the baseline iteration is the plain step
#   (``duration_scale``; ``time_basis`` "plain-scaled"). Replays then cost their scaled time. The
#   factor is uniform: it assumes the profiler inflates every op alike, which is not so (short ops
#   are inflated more than long ones, so a replay of long ops is charged somewhat too little), and
#   the plain step includes the script's own work between ops (data loading, Python), which the
#   scaled ops now stand for. Each planned iteration is scaled to the one plain step, so with
#   several kinds of iteration (planner/api.py) every kind's baseline is that median.
# - CUDA (device times from CUPTI, not inflated), or a plain step at least the summed op times:
#   durations are kept; the overhead is stated against the plain step (``time_basis`` "plain").
# - No plain step (older traces, synthetic and imported ones): durations kept, overhead against
#   their sum (``time_basis`` "traced").
# ``overhead_base_ns`` is what an overhead is a fraction of; plan.Predictions records the basis.

# Note: [Wrap-around gaps]
# Parameters, gradient buffers kept between steps and optimizer state are resident when the
# iteration starts and still alive when it ends; the next iteration uses them again. Such a
# storage (persistent kind, no producing op in the iteration, not freed in it) has a gap that
# wraps around the iteration boundary: from its last access ``l`` in iteration i to its first
# access ``f`` in iteration i+1 (``StorageInfo.wrap = (l, f)``; for optimizer state that is one
# optimizer step to the next, the whole forward and backward pass). A swap over it is a
# ``Decision`` with ``wraps`` (docs/plan-format.md): the storage is out on ops l+1..n-1 and
# 0..f-1, so in the steady state it is absent from the start of each iteration until it is
# swapped back in. Persistent storages are also swap candidates over their gaps within the
# iteration (a parameter between its forward and its backward use). They are never recomputed:
# no op of the iteration produces them from scratch. ``Problem.persistent_candidates`` switches
# all of this off (``restricted()``), which is how planning was before, for comparison.
"""

from __future__ import annotations

import hashlib
import weakref
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from ..errors import CapuchinError
from ..tracer.reader import Trace
from ..tracer.schema import (  # noqa: F401 (is_collective: planner modules import it from here)
    COLLECTIVE_NAMESPACES,
    PERSISTENT_KINDS,
    Col,
    Kind,
    Phase,
    Role,
    communicates,
    is_collective,
    never_replayed,
    shape_signature,
)
from .collector import gc_paused
from .costs import NO_HOST_COST, HostCost, host_cost, on_cuda


class IrregularTraceError(CapuchinError):
    """The trace's steady iterations differ, so no single iteration stands for all of them."""


# Note: [Collectives]
# A collective (all-reduce, all-gather, reduce-scatter, broadcast: the ``c10d`` ops that
# torch.distributed, DDP's gradient buckets and FSDP2 dispatch, and the functional collectives)
# exchanges data with the other ranks, often asynchronously: the buffer is read or written by the
# communication backend until the matching wait, outside any op this rank records. So a storage a
# collective touches is never evicted (not ``evictable``: no eviction through it), and a
# collective is never replayed (``is_collective`` ops end every replay chain, planner/lineage.py):
# replaying one would run a communication the other ranks do not join. FSDP2's own ops
# (``fsdp.all_gather_copy_in``, ``fsdp.split_with_sizes_copy``, ``fsdp.chunk_cat``) fill and
# drain those buffers, and FSDP frees and re-allocates its unsharded parameters' storages itself
# (``UntypedStorage.resize_``, no op), so what they touch (``StorageInfo.communicated``) is neither
# evicted nor read by a replay: a replay whose source is such a storage is refused (a layer's
# weight under FSDP2; measured: a replayed ``addmm`` read a resharded, 0-byte weight and the
# process crashed), which leaves swapping for the activations of FSDP2 layers.
@dataclass(frozen=True)
class OpInfo:
    """One op of the planned iteration. Storage ids, never tensor ids (see module docstring)."""

    index: int
    name: str
    phase: Phase
    duration_ns: int
    inputs: tuple[str, ...]  # storages read (INPUT and WRITE rows), first-argument order
    outputs: tuple[str, ...]  # storages returned (fresh, or views/aliases of inputs)
    writes: tuple[str, ...]  # storages written in place (also in ``inputs``)
    allocs: tuple[str, ...]  # storages this op allocated
    frees: tuple[str, ...]  # storages freed right after this op
    seeded: bool = False  # draws random numbers: a replay must restore the RNG state
    signature: str = ""  # tracer.schema.shape_signature of its tensor inputs
    scratch_bytes: int = 0  # temporary memory inside the op beyond its outputs (Role.SCRATCH)

    @property
    def accessed(self) -> tuple[str, ...]:
        """Every storage the op touches, each once."""
        return tuple(dict.fromkeys((*self.inputs, *self.outputs)))


@dataclass(frozen=True)
class StorageInfo:
    """One storage of the planned iteration.

    ``accesses``: sorted op indices touching it. ``alloc_op``: the op whose output allocated it
    (also its producer for recomputation); None when it exists at iteration start. ``free_op``:
    freed right after that op; None when still live at iteration end. ``writers``: ops writing it
    in place, sorted. ``persistent``: parameter, gradient or optimizer state (the paper keeps
    them resident); everything else is transient, including data resident at iteration start
    and activations that outlive it. ``evictable``: transient, non-empty, accessed at least twice,
    and every access is an op; only storages with an access gap (``gaps()``) can actually be
    evicted.
    """

    storage_id: str
    size_bytes: int
    kind: Kind
    alloc_op: int | None
    free_op: int | None
    accesses: tuple[int, ...]
    writers: tuple[int, ...]
    persistent: bool
    evictable: bool
    has_views: bool = False  # some access goes through a view of it (eviction is per storage)
    communicated: bool = False  # a collective or FSDP touches it (Note [Collectives])
    wrap: tuple[int, int] | None = None  # Note [Wrap-around gaps]: (last access, first access)

    @property
    def swappable(self) -> bool:
        """A swap candidate: evictable, or persistent and non-empty with an access gap within
        the iteration or across its boundary (Note [Wrap-around gaps]). Persistent storages are
        never recomputed (no op of the iteration produces them from scratch)."""
        if self.evictable:
            return True
        return (
            self.persistent
            and not self.communicated
            and self.size_bytes > 0
            and bool(self.accesses)
            and self.accesses[0] >= 0
            and (self.wrap is not None or bool(self.gaps()))
        )

    @property
    def producer_op(self) -> int | None:
        return self.alloc_op

    @property
    def transient(self) -> bool:
        return not self.persistent

    def alive_at(self, op: int) -> bool:
        """Allocated and not yet freed while op ``op`` runs (baseline)."""
        born = self.alloc_op is None or self.alloc_op <= op
        return born and (self.free_op is None or self.free_op >= op)

    def next_access(self, op: int) -> int | None:
        """The first access strictly after op ``op``, or None."""
        i = bisect_right(self.accesses, op)
        return self.accesses[i] if i < len(self.accesses) else None

    def source_at(self, j: int, b: int) -> bool:
        """Whether what op ``j`` read of this storage is still here at op ``b``: alive at ``b``
        and not written in place between them (lineage's source rule, paper §4.3: a replay
        before op ``b`` of op ``j`` reads it as a source instead of regenerating it)."""
        return self.alive_at(b) and not self.written_between(j, b)

    def written_between(self, lo: int, hi: int) -> bool:
        """Whether an op with index in the open interval (lo, hi) writes this storage in place."""
        i = bisect_right(self.writers, lo)
        return i < len(self.writers) and self.writers[i] < hi

    @property
    def dead_gap(self) -> tuple[int, int] | None:
        """(last access, free op) when the storage outlives its last access within the
        iteration: a transient storage the script frees some ops after its last read (Note
        [Dead storages] in dead.py); None otherwise."""
        a = self.accesses
        if (
            self.persistent
            or self.communicated
            or self.size_bytes <= 0
            or not a
            or a[0] < 0
            or self.free_op is None
            or self.free_op <= a[-1]
        ):
            return None
        return a[-1], self.free_op

    def gaps(self) -> list[tuple[int, int]]:
        """Consecutive access pairs (evicted-access, back-access) with at least one op between."""
        a = self.accesses
        return [(a[i], a[i + 1]) for i in range(len(a) - 1) if a[i + 1] - a[i] >= 2]


@dataclass(frozen=True, eq=False)
class Problem:
    """One iteration to plan. Build with ``from_trace`` or ``from_lists``; see Note [Baseline
    timeline] for ``start_ns`` and ``live_bytes`` (numpy arrays indexed by op)."""

    ops: tuple[OpInfo, ...]
    storages: Mapping[str, StorageInfo]
    resident_bytes: int  # bytes live when the iteration starts
    start_ns: np.ndarray = field(repr=False)
    live_bytes: np.ndarray = field(repr=False)
    bandwidth_d2h_bytes_per_s: float = 12e9
    bandwidth_h2d_bytes_per_s: float = 12e9
    iteration: int = 0
    trace_path: str = ""
    device: str = "cpu"
    persistent_candidates: bool = True  # Note [Wrap-around gaps]; False: activations etc. only
    dead_evictions: bool = True  # dead.py Note [Dead storages]; False: none planned
    # the runtime's host work the simulator charges on the compute stream (costs.py Note [Host
    # work on the compute stream]): from the trace's device and source
    host: HostCost = NO_HOST_COST
    # the runtime's host costs the trace measured on its host (``TraceMeta.host_costs``; Note
    # [Calibrated host costs] in planner/costs.py): ``host`` and ``runtime_cost_ns`` charge
    # them in place of costs.py's constants; None: not measured
    host_costs: Mapping[str, int] | None = None
    # device memory outside tensor storages the trace measured (the trace's extra
    # "cuda_non_tensor_bytes"); carried into the plan's provenance, never planned
    non_tensor_bytes: int = 0
    # Note [Plain baseline]: the trace's plain step (None: not timed) and the factor applied to
    # every op duration (1.0: as traced)
    plain_time_ns: int | None = None
    duration_scale: float = 1.0
    # the compiled regions a replay may run (the trace's ``replayable_regions``, Note [Region
    # replay] in tracer/compiled.py); every other region ends replay chains (``never_replayed``)
    replayable_regions: frozenset[str] = frozenset()

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    @gc_paused  # collector.py Note [Garbage collection while planning]
    def from_trace(cls, trace: Trace, iteration: int | None = None) -> Problem:
        """The planning problem of one iteration of ``trace``.

        ``iteration`` defaults to the trace's steady iteration (its metadata), else its last
        one. A trace whose steady iterations differ (``meta.regular`` false) is refused with
        ``IrregularTraceError`` unless ``iteration`` is given.
        """
        name = str(trace.path) if trace.path else "<trace>"
        its = sorted(int(i) for i in trace.events[Col.ITERATION].unique())
        if not its:
            raise IrregularTraceError(f"{name}: the trace holds no iteration")
        if iteration is None:
            if not trace.meta.regular:
                div = trace.meta.first_divergence or {}
                where = (
                    f" (first divergence: iteration {div.get('iteration')}, op "
                    f"{div.get('op_index')}: expected {div.get('expected')}, got "
                    f"{div.get('got')})"
                    if div
                    else ""
                )
                raise IrregularTraceError(
                    f"{name}: the recorded iterations differ{where}; no single iteration "
                    f"stands for the others. Choose one with --iteration N (recorded: {its})"
                )
            steady = trace.meta.steady_iteration
            iteration = steady if steady is not None and steady in its else its[-1]
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise IrregularTraceError(
                f"{name}: iteration {iteration!r} is not an integer (recorded: {its})"
            )
        if iteration not in its:
            raise IrregularTraceError(f"{name}: no iteration {iteration} (recorded: {its})")
        ev = trace.events[trace.events[Col.ITERATION] == iteration]
        ev = ev.sort_values(Col.EVENT, kind="stable")
        return _build(ev, trace, iteration, name)

    @classmethod
    def from_lists(cls, ops: Sequence, sizes: Mapping[str, int], **kwargs) -> Problem:
        """A problem from a hand-written op list; arguments as ``tracer.synthetic.trace_from_ops``.

        Example: a chain A -> B -> C whose backward reads A and B again::

            Problem.from_lists([("f1", 10, ["X"], ["A"]), ("f2", 10, ["A"], ["B"]),
                                ("b2", 10, ["B", "A"], ["C"])], {"X": 4, "A": 8, "B": 8, "C": 4})
        """
        from ..tracer.synthetic import trace_from_ops

        return cls.from_trace(trace_from_ops(ops, sizes, **kwargs))

    def with_bandwidth(
        self, d2h_bytes_per_s: float | None = None, h2d_bytes_per_s: float | None = None
    ) -> Problem:
        """The same problem with other copy bandwidths (None keeps the current one)."""
        return replace(
            self,
            bandwidth_d2h_bytes_per_s=float(d2h_bytes_per_s or self.bandwidth_d2h_bytes_per_s),
            bandwidth_h2d_bytes_per_s=float(h2d_bytes_per_s or self.bandwidth_h2d_bytes_per_s),
        )

    # -- views ----------------------------------------------------------------------------------
    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def end_ns(self) -> np.ndarray:
        """End of each op on the baseline compute stream."""
        return self.start_ns + self.durations_ns

    @property
    def durations_ns(self) -> np.ndarray:
        return np.fromiter((o.duration_ns for o in self.ops), dtype=np.int64, count=len(self.ops))

    @property
    def time_ns(self) -> int:
        """Baseline iteration time: the sum of op durations."""
        return int(self.durations_ns.sum()) if self.ops else 0

    @property
    def time_basis(self) -> str:
        """What overheads are relative to (Note [Plain baseline]): "traced", "plain-scaled"
        or "plain"."""
        if self.plain_time_ns is None:
            return "traced"
        return "plain-scaled" if self.duration_scale != 1.0 else "plain"

    @property
    def overhead_base_ns(self) -> int:
        """The iteration time an overhead is a fraction of: the plain step when the trace timed
        it, else the baseline (Note [Plain baseline])."""
        return self.plain_time_ns if self.plain_time_ns is not None else self.time_ns

    @property
    def peak_bytes(self) -> int:
        return int(self.live_bytes.max()) if len(self.live_bytes) else self.resident_bytes

    @property
    def peak_op(self) -> int:
        """The first op at which the baseline peak is reached (-1 for an empty iteration)."""
        return int(self.live_bytes.argmax()) if len(self.live_bytes) else -1

    @property
    def persistent_bytes(self) -> int:
        return sum(s.size_bytes for s in self.storages.values() if s.persistent)

    def peak_window(self, threshold_bytes: int | None = None) -> list[tuple[int, int]]:
        """Maximal op ranges ``(first, last)`` (inclusive) where ``live_bytes > threshold``.

        Default threshold: 90% of the peak (the paper's "peak memory period" is where the
        measured usage exceeds what fits; a policy passes its budget).
        """
        if threshold_bytes is None:
            threshold_bytes = int(self.peak_bytes * 0.9)
        return ranges_of(self.live_bytes > threshold_bytes)

    def swap_gaps(self, s: StorageInfo) -> list[tuple[int, int, bool]]:
        """The access gaps ``(evict_op, back_op, wraps)`` a plan may evict ``s`` over: its gaps
        within the iteration, and its wrap-around gap (Note [Wrap-around gaps]) when it has one.
        Persistent storages count only when ``persistent_candidates``."""
        if s.evictable:
            return [(a, b, False) for a, b in s.gaps()]
        if not (self.persistent_candidates and s.swappable):
            return []
        out = [(a, b, False) for a, b in s.gaps()]
        if s.wrap is not None:
            out.append((*s.wrap, True))
        return out

    def restricted(self) -> Problem:
        """This problem without the persistent candidates (what planning was before them):
        the same object when there are none. Cached."""
        if not self.persistent_candidates or not any(
            s.swappable and not s.evictable for s in self.storages.values()
        ):
            return self
        r = _RESTRICTED.get(self)
        if r is None:
            r = _RESTRICTED[self] = replace(self, persistent_candidates=False)
        return r

    def floor_bytes(self, dead: bool = False) -> int:
        """A lower bound on the peak of any plan: at each op, everything stays but evictable
        storages inside one of their access gaps (wrap-around gaps of persistent storages
        included, Note [Wrap-around gaps]). Budgets below it are infeasible. ``dead``: storages
        in their dead gaps count as out too (dead.py Note [Dead storages]; the bound of plans
        with dead decisions, when ``dead_evictions``); without, the policies' own view. Cached
        per problem: a pass over every storage's gaps, asked for by every search."""
        got = self.__dict__.get("_floor_bytes")
        if got is None:
            got = {}
            object.__setattr__(self, "_floor_bytes", got)
        if dead not in got:
            got[dead] = int(self.floor_curve(dead)[0].max()) if self.n_ops else self.resident_bytes
        return got[dead]

    def floor_curve(self, dead: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Per op: the bytes no plan can move off the device (``floor_bytes`` is their
        maximum), and of those the op's own working set (its inputs, outputs and scratch);
        ``dead`` as in ``floor_bytes``."""
        n = self.n_ops
        diff = np.zeros(n + 1, dtype=np.int64)
        for s in self.storages.values():
            for a, b, wraps in self.swap_gaps(s):
                if wraps:
                    diff[a + 1] += s.size_bytes
                    diff[0] += s.size_bytes
                    diff[b] -= s.size_bytes
                else:
                    diff[a + 1] += s.size_bytes
                    diff[b] -= s.size_bytes
            g = s.dead_gap if dead and self.dead_evictions else None
            if g is not None:  # out from its last access until it is freed
                diff[g[0] + 1] += s.size_bytes
                diff[g[1] + 1] -= s.size_bytes
        floor = self.live_bytes - np.cumsum(diff[:n])
        st = self.storages
        work = np.fromiter(
            (sum(st[x].size_bytes for x in o.accessed) + o.scratch_bytes for o in self.ops),
            dtype=np.int64,
            count=n,
        )
        return floor, np.minimum(work, floor)

    def floor_breakdown(self) -> dict[str, int]:
        """What the floor is made of, at the op where it is reached: ``floor_bytes``,
        ``floor_op``, ``working_set_bytes`` (that op's inputs, outputs and scratch: they must be
        resident while it runs) and ``fixed_bytes`` (the rest: storages with no access gap
        around that op, resident state that cannot move there)."""
        if self.n_ops == 0:
            return {
                "floor_bytes": self.resident_bytes,
                "floor_op": -1,
                "working_set_bytes": 0,
                "fixed_bytes": self.resident_bytes,
            }
        floor, work = self.floor_curve(dead=True)
        k = int(floor.argmax())
        return {
            "floor_bytes": int(floor[k]),
            "floor_op": k,
            "working_set_bytes": int(work[k]),
            "fixed_bytes": int(floor[k] - work[k]),
        }

    def memory(self) -> pd.DataFrame:
        """The baseline curve: op_index, name, phase, start_ns, duration_ns, live_bytes."""
        return pd.DataFrame(
            {
                "op_index": np.arange(self.n_ops),
                "name": [o.name for o in self.ops],
                "phase": [o.phase.value for o in self.ops],
                "start_ns": self.start_ns,
                "duration_ns": self.durations_ns,
                "live_bytes": self.live_bytes,
            }
        )

    def storage_table(self) -> pd.DataFrame:
        """One row per storage (a notebook view)."""
        return pd.DataFrame(
            [
                {
                    "storage_id": s.storage_id,
                    "size_bytes": s.size_bytes,
                    "kind": s.kind.value,
                    "alloc_op": s.alloc_op,
                    "free_op": s.free_op,
                    "accesses": len(s.accesses),
                    "persistent": s.persistent,
                    "evictable": s.evictable,
                }
                for s in self.storages.values()
            ]
        )

    def op_signatures(self) -> list[list[str]]:
        """``[[name, shape_signature], ...]`` by op index, as plans store them."""
        return [[o.name, o.signature] for o in self.ops]

    def fingerprint(self) -> str:
        """Hash of the op sequence (names and input shapes); see ``plan.op_fingerprint``."""
        return op_fingerprint(self.op_signatures())

    def op_at_time(self, t_ns: float) -> int:
        """The baseline op running at time ``t_ns`` (the last op starting at or before it)."""
        return max(0, int(np.searchsorted(self.start_ns, t_ns, side="right")) - 1)


_RESTRICTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def op_fingerprint(ops: Sequence[Sequence[str]]) -> str:
    """sha256 (first 16 hex digits) of ``name|shape_signature`` lines: ties a plan to a trace."""
    h = hashlib.sha256()
    for name, sig in ops:
        h.update(f"{name}|{sig}\n".encode())
    return h.hexdigest()[:16]


def ranges_of(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of True in ``mask`` as inclusive ``(first, last)`` index pairs."""
    if len(mask) == 0:
        return []
    m = np.concatenate([[False], np.asarray(mask, dtype=bool), [False]])
    d = np.diff(m.astype(np.int8))
    starts = np.flatnonzero(d == 1)
    ends = np.flatnonzero(d == -1) - 1
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]


def _build(ev: pd.DataFrame, trace: Trace, iteration: int, name: str) -> Problem:
    # plain lists: indexing numpy arrays element by element is several times slower
    role = ev[Col.ROLE].tolist()
    opi = ev[Col.OP].tolist()
    sid = ev[Col.STORAGE].tolist()
    sbytes = ev[Col.STORAGE_BYTES].tolist()
    alloc = ev[Col.ALLOC].tolist()
    kind = ev[Col.KIND].tolist()
    argi = ev[Col.ARG].tolist()
    shapes = ev[Col.SHAPE].tolist()
    view_of = ev[Col.VIEW_OF].tolist()

    op_rows = ev[ev[Col.OP] >= 0].drop_duplicates(Col.OP).sort_values(Col.OP)
    n = int(op_rows[Col.OP].max()) + 1 if len(op_rows) else 0
    if len(op_rows) != n:
        raise IrregularTraceError(f"{name}: iteration {iteration} has gaps in its op indices")
    names = op_rows[Col.OP_NAME].fillna("").to_list()
    phases = [
        Phase(p) if isinstance(p, str) and p else Phase.FORWARD
        for p in op_rows[Col.PHASE].to_list()
    ]
    durs = op_rows[Col.DURATION_NS].fillna(0).astype("int64").clip(lower=0).to_list()
    plain, scale = _plain_baseline(trace, durs)
    if scale != 1.0:
        durs = [int(round(d * scale)) for d in durs]
    seeded = op_rows[Col.SEEDED].fillna(False).astype(bool).to_list()

    inputs: list[dict[str, None]] = [{} for _ in range(n)]
    outputs: list[dict[str, None]] = [{} for _ in range(n)]
    writes: list[dict[str, None]] = [{} for _ in range(n)]
    allocs: list[list[str]] = [[] for _ in range(n)]
    frees: list[list[str]] = [[] for _ in range(n)]
    sig_shapes: list[list[tuple[int, object]]] = [[] for _ in range(n)]
    size: dict[str, int] = {}
    kinds: dict[str, str] = {}
    acc: dict[str, list[int]] = {}
    wr: dict[str, list[int]] = {}
    alloc_op: dict[str, int] = {}
    free_op: dict[str, int] = {}
    resident: dict[str, None] = {}
    views: dict[str, str] = {}
    r_in, r_wr, r_out, r_free, r_res = (
        Role.INPUT.value,
        Role.WRITE.value,
        Role.OUTPUT.value,
        Role.FREE.value,
        Role.RESIDENT.value,
    )
    r_scratch = Role.SCRATCH.value
    scratch = [0] * n
    freed_early: set[str] = set()
    for r, k, s, b, al, kd, ai, shp, v in zip(
        role, opi, sid, sbytes, alloc, kind, argi, shapes, view_of, strict=True
    ):
        if r == r_scratch:  # op-internal temporary memory, not a storage (schema Role.SCRATCH)
            if 0 <= k < n:
                scratch[k] = max(scratch[k], int(b))
            continue
        if b > size.get(s, -1):
            size[s] = b
        if s not in kinds and isinstance(kd, str):
            kinds[s] = kd
        if v.__class__ is str and v:  # nulls arrive as None or NaN depending on the source
            views[s] = v
        if r == r_res:
            resident[s] = None
            continue
        if r == r_free:
            if k < 0:  # released before the first op: not live during the iteration
                freed_early.add(s)
            elif k < n and s not in free_op:
                free_op[s] = k
                frees[k].append(s)
            continue
        acc.setdefault(s, []).append(k)
        if r == r_in or r == r_wr:
            inputs[k][s] = None
            sig_shapes[k].append((ai, shp))
            if r == r_wr:
                writes[k][s] = None
                wr.setdefault(s, []).append(k)
        elif r == r_out:
            outputs[k][s] = None
            if al is True and s not in alloc_op:
                alloc_op[s] = k
                allocs[k].append(s)
    ops = []
    for k in range(n):
        sig = sig_shapes[k]
        if len(sig) > 1:
            sig.sort(key=lambda x: -1 if x[0] is None else x[0])
        shp = [sh if sh is not None else () for _, sh in sig]
        ops.append(
            OpInfo(
                k,
                names[k],
                phases[k],
                int(durs[k]),
                tuple(inputs[k]),
                tuple(outputs[k]),
                tuple(writes[k]),
                tuple(allocs[k]),
                tuple(frees[k]),
                bool(seeded[k]),
                shape_signature(shp),
                scratch[k],
            )
        )
    # Note [Collectives]: what a collective reads or writes stays resident
    collective_storages = {x for o in ops if communicates(o.name) for x in o.accessed}
    storages: dict[str, StorageInfo] = {}
    for s in dict.fromkeys([*resident, *acc]):
        a = sorted(set(acc.get(s, ())))
        kd = Kind(kinds[s]) if s in kinds and kinds[s] in Kind._value2member_map_ else Kind.OTHER
        al = alloc_op.get(s)
        fr = free_op.get(s)
        persistent = kd in PERSISTENT_KINDS
        # views share their base's storage; eviction is per storage, so views do not matter
        evictable = (
            not persistent
            and len(a) >= 2
            and size.get(s, 0) > 0
            and all(k >= 0 for k in a)
            and s not in collective_storages
        )
        # Note [Wrap-around gaps]: resident at the start, alive at the end
        wrap = None
        if (
            persistent
            and al is None
            and fr is None
            and s in resident
            and s not in freed_early
            and a
            and a[0] >= 0
            and size.get(s, 0) > 0
            and (n - 1 - a[-1]) + a[0] >= 1
            and s not in collective_storages
        ):
            wrap = (a[-1], a[0])
        storages[s] = StorageInfo(
            s,
            size.get(s, 0),
            kd,
            al,
            fr,
            tuple(a),
            tuple(sorted(set(wr.get(s, ())))),
            persistent,
            evictable,
            s in views,
            s in collective_storages,
            wrap,
        )
    res_bytes = sum(size[s] for s in resident if s not in freed_early)
    delta = np.zeros(n + 1, dtype=np.int64)
    for s, k in alloc_op.items():
        delta[k] += size[s]
    for s, k in free_op.items():
        if k + 1 <= n:
            delta[k + 1] -= size[s]
    live = res_bytes + np.cumsum(delta[:n]) + np.asarray(scratch, dtype=np.int64)
    d = np.asarray(durs, dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(d)[:-1]]) if n else np.zeros(0, dtype=np.int64)
    meta = trace.meta
    return Problem(
        ops=tuple(ops),
        storages=storages,
        resident_bytes=int(res_bytes),
        start_ns=start.astype(np.int64),
        live_bytes=live.astype(np.int64),
        bandwidth_d2h_bytes_per_s=float(meta.bandwidth_d2h_bytes_per_s),
        bandwidth_h2d_bytes_per_s=float(meta.bandwidth_h2d_bytes_per_s),
        iteration=int(iteration),
        trace_path=str(trace.path) if trace.path else "",
        device=meta.device,
        host=host_cost(meta.device, meta.source, getattr(meta, "host_costs", None)),
        host_costs=getattr(meta, "host_costs", None),
        non_tensor_bytes=int((meta.extra or {}).get("cuda_non_tensor_bytes") or 0),
        plain_time_ns=plain,
        duration_scale=scale,
        replayable_regions=frozenset(getattr(meta, "replayable_regions", None) or ()),
    )


def _plain_baseline(trace: Trace, durs: Sequence[int]) -> tuple[int | None, float]:
    """The trace's plain step (None: not timed) and the factor for the op durations ``durs`` of
    the planned iteration (Note [Plain baseline])."""
    plain = getattr(trace.meta, "plain_iteration_ns", None)
    if (
        isinstance(plain, bool)
        or not isinstance(plain, int | float)
        or not 0 < plain < float("inf")
    ):
        return None, 1.0
    plain = int(plain)
    traced = int(sum(durs))
    if on_cuda(trace.meta.device) or traced <= plain:
        return plain, 1.0
    return plain, plain / traced


__all__ = ["IrregularTraceError", "OpInfo", "Problem", "StorageInfo", "op_fingerprint", "ranges_of"]
