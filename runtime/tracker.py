"""The tensor access tracker: a ``TorchDispatchMode`` that indexes every op the way the tracer does
(tracer/hooks.py) and carries out the plan's actions at their ops.

# Note: [Hot path]
# An op with no action while nothing is evicted, in flight or recorded costs one dict lookup (is it
# a multi-tensor op to run in groups: Note [Multi-tensor op split] in tracer/hooks.py), one
# attribute test, one list index and one identity comparison: ``func is fast[k]`` where ``fast`` is
# the compiled table of expected OpOverloads (runtime/actions.py). Everything else (iteration
# boundaries, profiler ops, a mismatching op, actions, on-demand restores, passive mode, watched
# iterations) takes ``Executor.slow_op``. While storages are evicted, in flight or recorded for a
# replay, the hot path is *guarded*: ``fast`` is the ``guarded`` table (no op that writes an
# argument in place: those bump write counters and trigger copy-on-write on the slow path, rules
# R2/R3), and an op passes only if none of its tensor arguments lives in an evicted storage (one
# storage-key lookup per tensor argument): a kernel never reads an evicted storage (Note
# [Storage-level eviction] in state.py), whatever the script does. By the trace, an evicted storage
# is touched by no op before its back-access (an action op), so in a run that follows the trace only
# the plan's action ops and the in-place ops inside eviction windows take the slow path. The shape
# check (the ``shape_signature`` of the trace) runs on ops with actions, so a run that diverges only
# in shapes (another batch size) is caught before any of its planned actions runs.

# Note: [Wrap-around storages before the first planned iteration]
# A wrap-around decision (``Decision.wraps``) keeps a storage out from its last access in one
# iteration to its first access ``f`` in the next; its id ``x{f}:{a}`` binds it to a live
# storage only at op ``f``. The first planned iteration would so start with all of them resident
# (optimizer state above all: iteration 0 creates it and follows no plan), over the budget by
# their bytes (BERT-MLM: 1.18x). So an iteration that ends without following the plan (iteration
# 0, and a checked iteration that diverged: the next planned iteration after it started over the
# budget by the same bytes) keeps the ops of its tail (OpOverload, shapes, weak
# references to the arguments' storages) from where it stopped following the plan, and at its
# end, when that tail matches the end of the plan's op list (same ops, same shapes: the
# optimizer step), each wrap-around storage whose ``f`` lies in the matched part is named from
# it and swapped out as if the plan's evicted-access had just run. A wrong binding (same ops and
# shapes, other tensors), or a next iteration that diverges too, costs an extra swap, never a
# wrong value: any access restores it, and op ``f`` names the right storage.

# Note: [Watched iterations]
# Passive mode can only count and evict storages it saw allocated (Note [Passive budget on CPU] in
# passive.py). An iteration that diverges midway switches to passive mode with the outputs of its
# guided ops unseen: their bytes are missing from the estimate and they cannot be evicted. A run
# that diverged once usually diverges again (another batch size diverges every iteration), so
# the iteration after a diverged one is *watched*: every op takes the slow path, is checked by
# name and shapes (so a shape divergence is caught at its first op, not at the first op with an
# action), and its new storages are tracked while the plan is followed. An iteration that ends
# without diverging turns watching off again (the hot path returns). Iteration 0 always diverges
# (it builds the model) and predicts nothing, so it does not start watching. Other shapes at an
# op with no planned action whose outputs all alias its arguments by its schema (a view, a
# ``copy_`` into a slice: a collate function padding samples of other lengths into a batch of
# the planned shape) are no divergence: such an op allocates nothing, and an unwatched
# iteration would not have checked it either; the plan's actions still check their own ops'
# shapes, so a batch of another shape still diverges at its first op that allocates. In the first
# diverged iteration, unwatched, ``BudgetGuard.discover`` (passive.py) counts what the ops
# before the divergence left resident through the autograd graph (the tensors of a live graph
# and what they saved): at a divergence at op 100 of the transformer the measured peak went
# 1.24x -> 0.98x the budget. It misses resident tensors outside any graph (data made under
# no_grad, detached results).

# Note: [Iteration kinds]
# A plan may cover several kinds of iteration (training steps, steps that also evaluate, the
# first step of an epoch: docs/plan-format.md ``kinds``). Every iteration starts under the plan's
# main kind; at the first op that does not match it, the runtime looks for another kind whose
# plan has the same ops (names and shapes) up to there and this op next, and continues under that
# kind's plan (``Executor._switch_kind``); only when none matches is it a divergence. The kinds of
# a trace usually part at their first ops (an evaluation pass before the training step), so
# little of the new kind's plan is lost. Each iteration's kind is in the report (``kind``).

# Note: [Shape kinds at run time]
# Kinds of the same op names and other shapes (planner/api.py Note [Shape kinds]: dynamic padding
# with buckets) part at the first op that allocates with other input shapes. Two such kinds'
# common prefix (``Executor._prefix``) compares names, and shapes only where the op allocates:
# other shapes at an op that allocates nothing (a sample copied into a slice of the padded batch)
# tell no kind apart. The ops up to the last op where such kinds part take the slow path in
# every iteration and are checked by shapes (``ActionTable.check_until``, set by
# ``Executor.check_shape_kinds``), so the iteration switches to its kind there, before the
# forward pass has left anything of the main kind's plan to undo. A switch on other shapes needs
# the new kind's shapes at that op (with three buckets, a switch on names alone took the wrong
# kind and diverged at its first action). Other shapes at an op with no action that allocates
# nothing are let pass before any switch is tried: a sample copy of a length that happens to be
# the other kind's would switch there and back, and the iteration lost one planned eviction. A
# switch restores what the current kind evicted but
# what is out across the iteration boundary (``restore_all`` keeps wrap-around entries out; the
# new kind's decision of the same id takes it back). What only the new kind keeps out is named
# in every kind's iterations (``check_shape_kinds`` adds the naming to the other kinds' tables)
# and swapped out at the switch (``Executor._bind_kind_wraps``; under the main kind, which every
# iteration starts as, at the last op where the kinds part), before the forward pass: left
# resident it measured 1.12x the budget in a 28-long batch after a 20-long
# one of tests/frameworks/dynamic_pad.py --buckets 3.

# Note: [Resync after an unexpected op]
# A script may run an op the plan does not know where the traced iteration had none: a data
# loader's ``randperm`` when an epoch starts, a logging op, a framework's epoch-boundary op.
# Such an op (its name is not the plan's op here, and no other kind's plan takes it) is
# *skipped*, not a divergence, when both hold: fewer than ``RESYNC_MAX_OPS`` ops were skipped in
# this iteration, and the new output bytes of the skipped ops (predicted on meta tensors before
# it runs, counted after) fit the plan's headroom, the budget less the plan's simulated peak
# (``Plan.op_peak_bytes``, plus what moved in-triggers added): the plan's curve then stays
# within the budget with them resident. A skipped op takes no op index of the plan (the next op
# is matched against the same planned op), carries out no planned action, and runs on the slow
# path like any other (evicted inputs come back first, in-place writes are counted). The next
# ``RESYNC_LOOKAHEAD`` ops then take the slow path and must match the plan by name *and*
# shapes: a shape mismatch there is a divergence at once, a name mismatch is one more unexpected
# op under the same limits. So an inserted op or a short run of them resynchronizes; a
# different op sequence or other shapes still diverges, at most ``RESYNC_MAX_OPS`` ops later
# and reported at the plan's op index where it started; passive mode then counts what the
# skipped ops left allocated with what the iteration left before (``BudgetGuard.discover``: on
# the GPT-2 Trainer's epoch boundary, 8 ops skipped before a real divergence left the measured
# peak at 0.998x the budget, 1.012x without counting them). Skipped ops are counted in the
# report (``resynced_ops``, also when the iteration diverged after them). Iteration 0 builds
# the model and skips nothing.

# Note: [End of run]
# Only a step ends an iteration, so the ops a script runs after its last step (a final evaluation,
# saving, printing a metric) form an incomplete last iteration that usually matches no plan. That
# is not a divergence: the warning of a divergence, and the refusal of a plan made for another
# script, are held until a step ends the iteration (``Executor.step_ended``); when the run ends
# first, the incomplete iteration is reported with ``complete: false`` and not as diverged. While
# held, the iteration runs as after any divergence: planned actions stop, passive mode keeps the
# budget.
"""

from __future__ import annotations

import collections
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..distributed import say
from ..errors import PlanFormatError, RecomputeError
from ..planner.plan import Step
from ..tracer.hooks import (
    SPLIT_SPECS,
    call_info,
    flatten_outputs,
    flatten_tensors,
    join_outputs,
    op_info,
    split_calls,
    written_inputs,
)
from ..tracer.schema import (
    IdKind,
    TensorId,
    communicates,
    id_kind,
    shape_signature,
)
from .device import caught_oom
from .state import (
    Entry,
    Reason,
    Residency,
    bump_writes,
    evictable,
    expose,
    resize,
    storage_key,
    storages,
)
from .threads import LOCK

# Note [Resync after an unexpected op]
RESYNC_LOOKAHEAD = 4  # ops after a skipped one that must match the plan by name and shapes
RESYNC_MAX_OPS = 8  # unexpected ops skipped per iteration; the next one is a divergence

_EMPTY: list = []
_NONE: dict = {}
_ANY = {None: None}  # non-empty: guarded with nothing evicted (swap-outs in flight, records)


class TrackerMode(TorchDispatchMode):
    """The mode object; all logic lives in ``Executor`` (it outlives re-entries of the mode)."""

    supports_higher_order_operators = True  # compiled regions (Note [torch.compile])

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Dynamo compiles under the mode (Note [torch.compile] in tracer/compiled.py)

    def __init__(self, executor: Executor):
        super().__init__()
        self.ex = executor
        self.ix = executor.ix
        self.fast = _EMPTY
        self.evicted = _NONE  # the executor's entries while the hot path is guarded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if SPLIT_SPECS.get(func, 0) is not None:  # Note [Multi-tensor op split] in hooks.py
            calls = split_calls(func, args, kwargs or {})
            if calls is not None:
                return join_outputs([self.__torch_dispatch__(func, types, a, k) for a, k in calls])
        ix = self.ix
        if not ix.step_pending:
            k = ix.op_index + 1
            try:
                if func is self.fast[k] and not (
                    self.evicted and _reads(args, kwargs, self.evicted)
                ):
                    ix.op_index = k
                    if self.evicted:
                        self.ex.op_time[k] = time.perf_counter()  # late-prefetch feedback
                    try:
                        return func(*args, **kwargs) if kwargs else func(*args)
                    except torch.cuda.OutOfMemoryError:  # Note [Out of memory in the runtime]
                        caught_oom()
                        return self.ex._run(func, args, kwargs or {})
            except IndexError:
                pass
        with LOCK:  # Note [Other threads] in threads.py
            return self.ex.slow_op(func, args, kwargs or {})


def _reads(args, kwargs, evicted: dict) -> bool:
    """Whether a tensor argument (or a tensor in a list argument) lives in an ``evicted``
    storage (or has no storage to check: then the slow path decides)."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            try:
                if a.untyped_storage()._cdata in evicted:
                    return True
            except (RuntimeError, NotImplementedError):
                return True
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    try:
                        if x.untyped_storage()._cdata in evicted:
                            return True
                    except (RuntimeError, NotImplementedError):
                        return True
    return False


_ALIASING: dict = {}
_COMMUNICATES: dict = {}


def _communicates(func) -> bool:
    """Whether ``func`` is a collective or an FSDP op (Note [Collectives] in planner/problem.py):
    the communication backend may read or write its buffers after it returns (an async
    all-reduce of DDP's gradient bucket), outside any op, so passive and dynamic mode never
    evict them either (``expose``: the planner already never plans them)."""
    got = _COMMUNICATES.get(func)
    if got is None:
        got = _COMMUNICATES[func] = communicates(str(func))
    return got


def _allocates_nothing(func) -> bool:
    """Whether every output of ``func`` aliases an argument by its schema (a view, an in-place
    write such as ``copy_`` into a slice): it allocates no storage whatever its shapes."""
    got = _ALIASING.get(func)
    if got is None:
        rets = getattr(getattr(func, "_schema", None), "returns", None)
        got = _ALIASING[func] = bool(rets) and all(r.alias_info is not None for r in rets)
    return got


def _keys(flat: list) -> list:
    keys = []
    for t in flat:
        try:
            keys.append(storage_key(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            keys.append(None)
    return keys


class Executor:
    """The plan executor: the hot and slow paths, planned actions, on-demand and step-end
    restores, late-prefetch feedback, divergence. ``rt`` is the owning ``Runtime`` (options);
    ``table`` the compiled plan (or None: passive only). The passive budget guard (passive.py)
    is ``self.guard``, built by ``make_guard(executor)``; the executor calls its hooks and owns
    the evicted storages (``entries``) that either of them evicted."""

    def __init__(self, rt, indexer, table, swap, recompute, make_guard, backend):
        self.rt = rt
        self.ix = indexer
        self.table = table
        self.swap = swap
        swap.make_room = self._make_room  # Note [Out of memory in the runtime] in swap.py
        self.recompute = recompute
        self.backend = backend
        self._cuda = backend.device.type == "cuda"  # Executor._run: retry a real OOM
        self.guard = make_guard(self)
        self.mode = TrackerMode(self)
        self.entries: dict[int, Entry] = {}  # storage key -> evicted storage
        self.by_sid: dict[str, Entry] = {}
        self.live: dict[str, weakref.ref] = {}  # plan storage id -> storage (this iteration)
        self.dependents: dict[int, set[str]] = {}  # source key -> dropped storage ids (R3)
        self.pending: dict[str, int] = {}  # recompute decisions still to come back this iteration
        self.op_refs: dict[int, int] = {}  # op index -> pending decisions that replay it
        self.op_time: dict[int, float] = {}
        self.trigger_now: dict = {}  # late-prefetch feedback (Note [Late prefetch ...])
        # bytes that moved in-triggers keep resident at each op, beyond the plan's simulation
        self.moved_bytes = [0] * (table.n_ops if table is not None else 0)
        self._moved_by_kind: dict[str, list[int]] = {}  # the same for the plan's other kinds
        self.guided = False
        self.watching = False  # Note [Watched iterations]
        # Note [Resync after an unexpected op]: ops skipped in this iteration, the bytes they
        # left allocated, and how many of the next ops must still match by name and shapes
        self.skipped = self.skipped_bytes = self.resync_left = 0
        self.skipped_outs: list[weakref.ref] = []  # their new outputs, counted at a divergence
        self.last_diverged = False
        self.warned = False
        self.warning: str | None = None  # Note [End of run]: printed when a step ends the iteration
        self.foreign: PlanFormatError | None = None  # likewise raised at that step
        self.stats = None
        # Note [Iteration kinds]: the plan of each kind, the first one the plan's main kind
        self.kind_tables: list = [table] if table is not None else []
        self._prefix: dict[tuple[int, int], int] = {}  # common (name, shapes) prefix of 2 kinds
        # Note [Shape kinds at run time]: what other shape kinds keep out across the boundary,
        # named in every iteration, and the storages the last iteration named so
        self._kind_wrap_sids: set[str] = set()
        self._kind_wraps: dict[str, weakref.ref] = {}
        self._kind_wraps_from = None  # the table of the iteration that named them
        # Note [Wrap-around storages before the first planned iteration]
        wraps = [
            d.back_op for d in (table.decisions.values() if table is not None else ()) if d.wraps
        ]
        self._tail = collections.deque(maxlen=table.n_ops - min(wraps)) if wraps else None

    # ---- iteration lifecycle (called by the Runtime) --------------------------------------------
    def begin_iteration(self, stats) -> None:
        self.stats = stats
        self.swap.stats = stats
        self.recompute.stats = stats
        self.live.clear()
        self.op_time.clear()
        self.recompute.reset()
        self.dependents.clear()
        guard = self.guard
        guard.new_iteration()
        if self.kind_tables:  # Note [Iteration kinds]: every iteration starts as the main kind
            self.table = self.kind_tables[0]
            stats.kind = self.table.kind
        self.guided = self.table is not None
        self.skipped = self.skipped_bytes = self.resync_left = 0  # Note [Resync after ...]
        self.skipped_outs.clear()
        # Note [Watched iterations]
        self.watching = self.guided and self.last_diverged and self.rt.passive_enabled
        self._count_pending()
        if self.guided:
            guard.stop()  # a plan applies again; divergence may restart it
        elif self.rt.passive_enabled and not guard.active:
            guard.start()
        self._update_fast()

    def _count_pending(self) -> None:
        self.pending.clear()
        self.op_refs.clear()
        if self.table is not None:
            for sid, d in self.table.decisions.items():
                if d.method.value == "recompute":
                    self.pending[sid] = 1
                    for k in d.replay_ops:
                        self.op_refs[k] = self.op_refs.get(k, 0) + 1

    def check_shape_kinds(self) -> None:
        """Note [Shape kinds at run time]: for each kind with the op names of another, the ops
        up to where their allocating ops' shapes part take the slow path and are checked."""
        for t in self.kind_tables:
            for u in self.kind_tables:
                if u is t or u.names != t.names:
                    continue
                n = self._common_prefix(t, u)
                if n < t.n_ops:
                    t.check_until = max(t.check_until, n + 1)
                for d in u.decisions.values():  # name what u keeps out across the boundary
                    if not d.wraps or d.storage_id in t.decisions:
                        continue
                    try:
                        tid = TensorId.parse(d.storage_id)
                    except ValueError:
                        continue
                    if tid.kind is IdKind.INPUT and tid.op_index < t.n_ops:
                        names = t.actions(tid.op_index).name_inputs
                        if (tid.position, d.storage_id) not in names:
                            names.append((tid.position, d.storage_id))
                        self._kind_wrap_sids.add(d.storage_id)
            for k in range(t.check_until):
                t.fast[k] = None
                if k < len(t.guarded):
                    t.guarded[k] = None

    @staticmethod
    def _common_prefix(a, b) -> int:
        """How many first ops of kinds ``a`` and ``b`` agree: by name, and by shapes where the
        op allocates (Note [Shape kinds at run time])."""
        n = 0
        for k in range(min(a.n_ops, b.n_ops)):
            if a.names[k] != b.names[k]:
                break
            if a.signatures[k] != b.signatures[k] and not (
                a.expected[k] is not None and _allocates_nothing(a.expected[k])
            ):
                break
            n += 1
        return n

    def _bind_kind_wraps(self) -> None:
        """Note [Shape kinds at run time]: after a switch, what the new kind keeps out across
        the iteration boundary and the last iteration's kind left resident is swapped out now,
        as that decision's entry (its prefetch and restore are the plan's)."""
        refs, self._kind_wraps = self._kind_wraps, {}
        if self._kind_wraps_from is None or self._kind_wraps_from.names != self.table.names:
            return  # ids name the same tensors only in kinds of the same ops
        with _disable_current_modes(), torch.no_grad():
            for sid, d in self.table.decisions.items():
                ref = refs.get(sid)
                st = ref() if ref is not None and d.wraps and sid not in self.by_sid else None
                if st is None or st.nbytes() != d.size_bytes or storage_key(st) in self.entries:
                    continue
                self.live[sid] = ref
                self._evict(Step.EVICT_SWAP, sid)
                self.live.pop(sid, None)
        self._update_fast()

    def _switch_kind(self, k: int, func, flat: list, info=None, shapes: bool = False) -> bool:
        """Note [Iteration kinds]: op ``k`` does not match the current kind's plan; take the
        plan of another kind whose ops ``0..k-1`` are those of the current one and whose op
        ``k`` is this op (name, and shapes where it has actions). Everything evicted comes back
        first and the new kind's plan applies from op ``k`` on (its actions on earlier ops are
        not carried out: their storages simply stay resident)."""
        cur = self.table
        sig = None
        for t in self.kind_tables:
            if t is cur or k >= t.n_ops:
                continue
            key = (id(cur), id(t))
            if key not in self._prefix:
                self._prefix[key] = self._common_prefix(cur, t)
            if self._prefix[key] < k:
                continue
            if func is not t.expected[k] and not t.late_match(k, func, info):
                continue
            if t.ops.get(k) is not None or shapes:  # Note [Shape kinds at run time]
                sig = sig if sig is not None else shape_signature(x.shape for x in flat)
                if sig != t.signatures[k]:
                    continue
            with _disable_current_modes(), torch.no_grad():
                self.restore_all()
            self.table = t
            self.live.clear()
            self.dependents.clear()
            self.recompute.reset()
            self._count_pending()
            self.stats.kind = t.kind
            self._bind_kind_wraps()
            return True
        return False

    def step_ended(self) -> None:
        """A step ended the current iteration: a divergence in it was real (Note [End of run])."""
        if self.foreign is not None:
            err, self.foreign = self.foreign, None
            raise err
        if self.warning is not None:
            say(self.warning)
            self.warned = True
            self.warning = None

    def end_iteration(self) -> None:
        for d, nbytes in self.swap.judged_late():  # Note [Lateness on the device's timeline]
            self._late_feedback(d, nbytes)
        st = self.stats  # iteration 0 builds the model: its divergence predicts nothing
        self.last_diverged = (
            st is not None and st.diverged and st.iteration >= self.rt.first_checked_iteration
        )
        self._kind_wraps = {  # Note [Shape kinds at run time]
            sid: ref
            for sid in (self._kind_wrap_sids if self.guided else ())
            if (ref := self.live.get(sid)) is not None
        }
        self._kind_wraps_from = self.table
        if self._tail:
            if not self.guided:  # Note [Wrap-around storages before the first planned ...]
                with _disable_current_modes(), torch.no_grad():
                    self._prebind_wraps()
                    self.guard.swap_out_persistent()  # Note [Persistent state under the guard]
            self._tail.clear()

    def _prebind_wraps(self) -> None:
        """Note [Wrap-around storages before the first planned iteration]."""
        tbl = self.table
        tail = self._tail
        n = tbl.n_ops
        m = 0  # length of the common suffix of this iteration's ops and the plan's
        while (
            m < len(tail)
            and tail[-1 - m][0] is tbl.expected[n - 1 - m]
            and tail[-1 - m][1] == tbl.signatures[n - 1 - m]
        ):
            m += 1
        for sid, d in tbl.decisions.items():
            if not d.wraps or n - d.back_op > m:
                continue
            a = TensorId.parse(sid).position  # an "x{k}:{a}" id: the a-th argument
            refs = tail[len(tail) - (n - d.back_op)][2]
            st = refs[a]() if a < len(refs) and refs[a] is not None else None
            if st is None:
                continue
            e = self.entries.get(storage_key(st))
            if e is not None:  # the guard swapped it: the plan's decision takes the entry over
                if e.swap and e.decision is None and sid not in self.by_sid:
                    self.by_sid.pop(e.sid, None)  # Note [Persistent state under the guard]
                    e.sid, e.reason, e.decision = sid, Reason.PLANNED, d
                    self.by_sid[sid] = e
                continue
            self.live[sid] = weakref.ref(st)
            self._evict(Step.EVICT_SWAP, sid)
        self.live.clear()

    def restore_all(self, wrapping: bool = False) -> None:
        with LOCK:  # Note [Other threads] in threads.py
            self._restore_all(wrapping)

    def _restore_all(self, wrapping: bool) -> None:
        """Iteration end (or step end): every evicted storage comes back, except those of
        wrap-around decisions (``Decision.wraps``: they stay out across the iteration boundary
        until their back-access in the next iteration or any access) unless ``wrapping``
        (the end of the run)."""
        restored = False
        if not wrapping:  # Note [Persistent state under the guard] in passive.py
            self.guard.adopt_persistent()
        for e in list(self.entries.values()):
            if not wrapping and e.decision is not None and e.decision.wraps and self.guided:
                continue
            if not wrapping and self.guard.keeps_out(e):
                continue
            if e.storage is not None and not self.guard.stays_out(e):
                self.restore(e)
                restored = True
        self.swap.poll()
        if restored:  # all of it resident at once: over the budget, that is a shortfall too
            self.guard.check_all_resident()
        self._update_fast()

    # ---- fast path switch -------------------------------------------------------------------------
    def _update_fast(self) -> None:
        mode = self.mode
        if not self.guided or self.guard.active or self.watching or self.resync_left:
            mode.fast, mode.evicted = _EMPTY, _NONE
        elif not self.entries and not self.swap.pending_out and not self.recompute.records:
            mode.fast, mode.evicted = self.table.fast, _NONE
        else:  # Note [Hot path]: guarded while anything is evicted, in flight or recorded
            mode.fast = self.table.guarded
            mode.evicted = self.entries if self.entries else _ANY

    # ---- ops of other threads (Note [Other threads] in threads.py) -------------------------------
    def foreign_op(self, func, args, kwargs) -> None:
        """Before an op of a thread that does not train runs (``LOCK`` held): its evicted inputs
        come back, and the storages it writes count the write (copy-on-write first, R3)."""
        info = op_info(func)
        if info.ignored:
            return
        flat = flatten_tensors(args, kwargs)
        if self.entries:
            for key in _keys(flat):
                e = self.entries.get(key)
                if e is not None:
                    self.restore(e)
            self._update_fast()
        for a in written_inputs(info, args, kwargs, flat):
            try:
                st = flat[a].untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            for sid in list(self.dependents.get(storage_key(st), ())):
                e = self.by_sid.get(sid)
                if e is not None and e.state is Residency.OUT and not e.swap:
                    self.restore(e)
                    self.stats.cow_restores += 1
            bump_writes(st)

    # ---- the slow path ------------------------------------------------------------------------------
    def slow_op(self, func, args, kwargs):
        info = op_info(func)
        if info.ignored:
            return func(*args, **kwargs)
        if info.hop:  # a compiled region: matched by name (Note [torch.compile])
            info = call_info(info, func, args)
        ix = self.ix
        if ix.iteration < 0 or (ix.step_pending and not ix.in_optimizer):
            ix._start_iteration()  # same boundary rule as OpIndexer.begin_op (tracer/hooks.py)
        ix.op_index += 1
        k = ix.op_index
        self.op_time[k] = time.perf_counter()
        flat = flatten_tensors(args, kwargs)
        if _communicates(func):  # Note [Collectives] in planner/problem.py
            for _key, st in storages(flat):
                expose(st)
        acts = None
        extra = False  # Note [Resync after an unexpected op]
        if self.guided:
            tbl = self.table
            if k >= tbl.n_ops or (
                func is not tbl.expected[k] and not tbl.late_match(k, func, info)
            ):
                if self._switch_kind(k, func, flat, info):
                    tbl = self.table
                    acts = tbl.ops.get(k)
                elif self._may_skip(func, args, kwargs):
                    extra = True
                    ix.op_index = k - 1  # it takes no op index of the plan
                else:
                    self._diverge(k, info.name, "op", flat)
            else:
                acts = tbl.ops.get(k)
                check = acts is not None or self.watching or self.resync_left
                if (check or k < tbl.check_until) and not tbl.shapes_match(k, flat):
                    if acts is None and not self.resync_left and _allocates_nothing(func):
                        pass  # Note [Watched iterations]: other shapes that allocate nothing
                    elif self._switch_kind(k, func, flat, info, shapes=True):
                        acts = self.table.ops.get(k)
                    else:
                        self._diverge(k, info.name, "shapes", flat)
                        acts = None
                elif self.resync_left:
                    self.resync_left -= 1
            if (  # Note [Shape kinds at run time]: still the main kind where the kinds part
                self._kind_wraps
                and self.guided
                and k + 1 >= self.table.check_until
                and self.table is self.kind_tables[0]
            ):
                self._bind_kind_wraps()
        if not self.guided and self._tail is not None:  # Note [Wrap-around storages ...]
            refs = []
            for t in flat:
                try:
                    refs.append(weakref.ref(t.untyped_storage()))
                except (RuntimeError, NotImplementedError, TypeError):
                    refs.append(None)
            self._tail.append((func, shape_signature(t.shape for t in flat), refs))
        if self.swap.pending_out:
            self.swap.poll()
            if self.swap.pending_out:
                self.swap.sync_overdue()
        if acts is not None:  # planned first, so a back-access is seen as planned (late check)
            for sid in acts.sync_out:  # Note [Decoupled swap-out] in swap.py
                e = self.by_sid.get(sid)
                if e is not None and e.state is Residency.SWAPPING_OUT:
                    self.swap.finish_out(e)
            for step, sid in acts.before:
                self._before(step, sid, k)
        guard = self.guard
        passive = guard.active
        watch = passive or (self.watching and self.guided)
        keys = _keys(flat) if (self.entries or watch or self.dependents) else None
        token = None
        if passive:  # room first for what the op allocates (Note [Passive budget on CPU])
            token = guard.before_op(func, args, kwargs, info.name, flat, keys)
        if self.entries:  # on demand: nothing may read an evicted storage
            for key in keys:
                e = self.entries.get(key)
                if e is not None:
                    self.restore(e)
        written = written_inputs(info, args, kwargs, flat)
        for a in written:
            try:
                st = flat[a].untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            deps = self.dependents.get(storage_key(st))
            if deps:  # R3: regenerate what depends on this storage before it changes
                for sid in list(deps):
                    e = self.by_sid.get(sid)
                    if e is not None and e.state is Residency.OUT and not e.swap:
                        self.restore(e)
                        self.stats.cow_restores += 1
            bump_writes(st)
        rec = None
        if acts is not None:
            for a, sid in acts.name_inputs:
                if a < len(flat):
                    self.live[sid] = weakref.ref(flat[a].untyped_storage())
            if acts.record:
                rec = self.recompute.record(k, func, args, kwargs, flat, written, info.seeded)
        out = func(*args, **kwargs) if not self._cuda else self._run(func, args, kwargs)
        if acts is not None or watch:
            in_keys = None
            if rec is not None or watch:
                in_keys = set(keys if keys is not None else _keys(flat))
            if acts is not None:
                if acts.name_outputs:
                    outs = flatten_outputs(out)
                    for j, sid in acts.name_outputs:
                        if j < len(outs):
                            self.live[sid] = weakref.ref(outs[j].untyped_storage())
                if rec is not None:
                    self.recompute.recorded_outputs(rec, out, in_keys)
                for step, sid in acts.after:
                    if self._other_size(sid):  # Note [Sizes are checked too]
                        self._diverge(k, info.name, "sizes", flat)
                        break
                    self._evict(step, sid)
            if passive:
                guard.after_op(flatten_outputs(out), in_keys, token)
            elif watch:
                guard.watch(flatten_outputs(out), in_keys, token)
        if extra:
            self._skipped(k, info.name, flat, out)
        self._update_fast()
        return out

    # ---- resync after an unexpected op (Note [Resync after an unexpected op]) -------------------
    def _may_skip(self, func, args, kwargs) -> bool:
        """An op the plan does not expect here may be skipped: in a checked iteration, fewer than
        ``RESYNC_MAX_OPS`` skipped in it, and its predicted new outputs fit the plan's headroom."""
        if self.skipped >= RESYNC_MAX_OPS or self.ix.iteration < self.rt.first_checked_iteration:
            return False  # iteration 0 builds the model: it follows no plan (Note [Watched ...])
        _key, n = self.backend.memory.predict(func, args, kwargs)
        return self.skipped_bytes + n <= self._headroom()

    def _skipped(self, k: int, name: str, flat: list, out) -> None:
        """An unexpected op ran without taking op index ``k`` of the plan: count what it left
        allocated against the headroom (a divergence if over) and check the next ops."""
        in_keys = set(_keys(flat))
        seen = set()
        for o in flatten_outputs(out):
            try:
                st = o.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = storage_key(st)
            if key not in in_keys and key not in seen:
                seen.add(key)
                self.skipped_bytes += st.nbytes()
                self.skipped_outs.append(weakref.ref(o))
        if self.skipped_bytes > self._headroom():  # more than its meta prediction
            self.ix.op_index = k
            self._diverge(k, name, "op", flat)
            return
        self.skipped += 1
        self.stats.resynced_ops += 1
        self.resync_left = RESYNC_LOOKAHEAD

    def _headroom(self) -> int:
        """Bytes the plan's simulated curve (plus what moved in-triggers added) leaves under the
        budget at its highest op; 0 without a curve."""
        peak = self.table.op_peak_bytes
        budget = self.rt.budget_bytes
        if not peak or budget is None:
            return 0
        moved = self._moved()
        return budget - max(p + (moved[i] if i < len(moved) else 0) for i, p in enumerate(peak))

    def _run(self, func, args, kwargs):
        for _ in range(64):
            try:
                return func(*args, **kwargs)
            except torch.cuda.OutOfMemoryError:
                caught_oom()  # Note [Out-of-memory errors caught inside an op] in device.py
                # a real OOM under set_per_process_memory_fraction: finish the earliest swap-out,
                # else evict what the op needs, and retry (paper §4.2, §5.3)
                if self.swap.sync_earliest() > 0:
                    continue
                _, need = self.guard.memory.predict(func, args, kwargs)
                if not self.guard.on_oom(set(_keys(flatten_tensors(args, kwargs))), need):
                    raise
        return func(*args, **kwargs)

    def _with_room(self, alloc, need: int, st):
        """``alloc()``, retried after making room on an out-of-memory error (a replay reads its
        sources and writes only its own outputs: running it again gives the same bytes)."""
        for _ in range(64):
            try:
                return alloc()
            except torch.cuda.OutOfMemoryError:
                caught_oom()
                if self.swap.sync_earliest() > 0:
                    continue
                if self._make_room(need, st) <= 0:
                    raise
        return alloc()

    def _make_room(self, need: int, st) -> int:
        """Free ``need`` bytes for a runtime-internal allocation of ``st`` (a restore, a
        replay); returns the bytes freed (Note [Out of memory in the runtime] in swap.py)."""
        keys = {storage_key(st)} if st is not None else set()
        if self.guard.on_oom(keys, need):
            return need
        return self.swap.unprefetch(need, keys)

    # ---- planned actions ------------------------------------------------------------------------
    def _before(self, step: Step, sid: str, k: int) -> None:
        e = self.by_sid.get(sid)
        if e is None:
            return
        if step is Step.PREFETCH:
            if e.swap:
                self.swap.prefetch(e)
        else:  # RESTORE / RECOMPUTE at the back-access
            self.restore(e, planned=step is Step.RESTORE)

    def _other_size(self, sid: str) -> bool:
        """The live storage planned as ``sid`` has another size than the plan's decision.

        # Note: [Sizes are checked too]
        # Ops are checked by name and input shapes, which a run with another dtype (a float64 run
        # of a float32 plan) or another element layout passes: every storage would then be larger
        # than the plan's sizes, and the plan's peak, scratch and headroom all wrong. Before a
        # planned eviction the storage's bytes are compared with the decision's ``size_bytes``
        # (the traced storage's): another size is a divergence, and passive mode keeps the budget.
        """
        d = self.table.decisions.get(sid)
        ref = self.live.get(sid)
        st = ref() if ref is not None else None
        if d is None or st is None or st.nbytes() == 0:
            return False
        return st.nbytes() != d.size_bytes

    def _evict(self, step: Step, sid: str) -> None:
        d = self.table.decisions.get(sid)
        ref = self.live.get(sid)
        st = ref() if ref is not None else None
        if d is None or st is None:
            return
        kind = id_kind(sid)
        if (
            not (kind is IdKind.OUTPUT or (kind is IdKind.INPUT and d.method.value == "swap"))
            or not evictable(st)
            or st.nbytes() == 0
            or st.device.type != self.backend.device.type
        ):
            # Storages are evicted only as the plan names them (Note [Storage-level eviction]):
            # an op's output, or a tensor that existed before the iteration (parameter,
            # gradient buffer, optimizer state, input) by swap, never by drop.
            self.stats.refused += 1
            return
        key = storage_key(st)
        if key in self.entries:
            return
        swap = step is Step.EVICT_SWAP
        if not swap:
            why = self.recompute.check_replayable(d, st)
            if why is not None:  # never drop what cannot be replayed exactly: swap it instead
                swap = True
                self.stats.fallback_swaps += 1
                self._done_with(d)
        e = Entry(sid, weakref.ref(st, self.died(key)), st.nbytes(), swap, Reason.PLANNED, d)
        if self.rt.verify:
            e.extra["copy"] = self.backend.snapshot(st)  # Note [Snapshots on the host]
        self.adopt(key, e)
        self.guard.evicted(key)  # a tracked storage (watched iteration) leaves the estimate
        if swap:
            self.swap.evict(e)
        else:
            for src in self.recompute.source_keys(d):
                self.dependents.setdefault(src, set()).add(sid)
            resize(st, 0)
            e.state = Residency.OUT
        self.stats.evictions += 1

    def adopt(self, key: int, e: Entry) -> None:
        """Storage ``key`` is being evicted (by the plan or by the guard): the executor restores
        it on demand and at the step end."""
        self.entries[key] = e
        self.by_sid[e.sid] = e

    def died(self, key: int):
        def cb(_ref, self=self, key=key):
            e = self.entries.pop(key, None)
            if e is not None:
                self.by_sid.pop(e.sid, None)
                if e.swap:
                    self.swap.discard(e)
                elif e.decision is not None:  # never needed again: unpin its replay's sources
                    self._done_with(e.decision)

        return cb

    # ---- restore ------------------------------------------------------------------------------
    def ensure_resident(self, st) -> None:
        e = self.entries.get(storage_key(st))
        if e is not None:
            self.restore(e)

    def restore_for_read(self, key: int) -> None:
        """A raw read of storage ``key`` (Note [Raw reads] in rawreads.py): back first, also
        from a swap-out still in flight (its end would free the bytes)."""
        with LOCK:
            e = self.entries.get(key)
            if e is not None:
                self.restore(e)
                self._update_fast()

    def restore(self, e: Entry, planned: bool = False) -> None:
        if e.swap:  # copies of plain storages (Note [Runtime-internal ops] in state.py)
            with torch._C._DisableTorchDispatch():
                self._restore(e, planned)
            return
        with _disable_current_modes(), torch.no_grad():  # replays of the script's ops
            self._restore(e, planned)

    def _restore(self, e: Entry, planned: bool) -> None:
        st = e.storage
        key = storage_key(st) if st is not None else None
        if e.state is Residency.RESIDENT and self.entries.get(key) is not e:
            return  # back already (evicted again since, its storage has another entry: leave it)
        if e.swap:
            self.swap.restore(e, planned and e.decision is not None and self.guided)
        elif e.reason is Reason.DYNAMIC:
            self.guard.replay(e)  # dynamic mode (runtime/dynamic.py)
            e.state = Residency.RESIDENT
        elif st is not None:
            dropped = {
                x.sid: (x.storage, x.nbytes)
                for x in self.by_sid.values()
                if not x.swap and x.state is Residency.OUT and x is not e and x.storage is not None
            }
            refilled = self._with_room(
                lambda: self.recompute.replay(e.decision, st, e.nbytes, dropped), e.nbytes, st
            )
            e.state = Residency.RESIDENT
            for sid in refilled:
                x = self.by_sid.get(sid)
                if x is not None:
                    self._forget(x)
        if (
            self.rt.verify
            and "copy" in e.extra
            and st is not None
            and not self.backend.snapshot(st).equal(e.extra["copy"])
        ):
            raise RecomputeError(
                f"verify: storage {e.sid} came back with other bytes "
                f"({'swap' if e.swap else 'recompute'})"
            )
        self._forget(e)

    def _forget(self, e: Entry) -> None:
        st = e.storage
        if st is not None:
            key = storage_key(st)
            self.entries.pop(key, None)
            self.guard.restored(key, st.nbytes())
        else:
            for key, x in list(self.entries.items()):
                if x is e:
                    del self.entries[key]
        if self.by_sid.get(e.sid) is e:
            del self.by_sid[e.sid]
        e.state = Residency.RESIDENT
        if e.decision is not None and not e.swap:
            for deps in self.dependents.values():
                deps.discard(e.sid)
            self._done_with(e.decision)

    def _done_with(self, d) -> None:
        """Decision ``d`` needs no more replays this iteration: unpin records nobody needs."""
        if self.pending.pop(d.storage_id, None) is None:
            return
        for k in d.replay_ops:
            n = self.op_refs.get(k, 0) - 1
            self.op_refs[k] = n
            if n <= 0:
                self.recompute.records.pop(k, None)

    def _late_feedback(self, d, nbytes: int) -> None:
        """Move a late prefetch's in-trigger (decision ``d``, ``nbytes``) earlier for the next
        iteration (Note [Late prefetch feedback] in swap.py), never to where it would take the
        plan over its budget."""
        # by storage id in the main kind's plan, by (kind, storage id) in the others'
        tkey = (
            d.storage_id if self.table is self.kind_tables[0] else (self.table.kind, d.storage_id)
        )
        trig = self.trigger_now.get(tkey, d.trigger_op)
        if trig is None:
            return
        bw = self.rt.bandwidth_h2d_bytes_per_s
        shift_s = 0.05 * nbytes / bw if bw > 0 else 0.0
        t_trig = self.op_time.get(trig)
        lo = d.evict_op + 1
        new = trig - 1
        if t_trig is not None:
            j = trig - 1
            while j > lo and (self.op_time.get(j) is None or self.op_time[j] > t_trig - shift_s):
                j -= 1
            new = j
        new = self._fits_from(max(lo, min(new, trig - 1)), trig, nbytes)
        if new < trig:
            self.table.move_before(Step.PREFETCH, d.storage_id, trig, new)
            self.trigger_now[tkey] = new
            self.stats.trigger_moves += 1
            moved = self._moved()
            for i in range(new, trig):
                moved[i] += nbytes
        else:
            self.stats.trigger_moves_refused += 1

    def _moved(self) -> list[int]:
        """``moved_bytes`` of the current kind's plan (Note [Iteration kinds])."""
        if self.table is self.kind_tables[0]:
            return self.moved_bytes
        moved = self._moved_by_kind.get(self.table.kind)
        if moved is None:
            moved = self._moved_by_kind[self.table.kind] = [0] * self.table.n_ops
        return moved

    def _fits_from(self, new: int, trig: int, nbytes: int) -> int:
        """The earliest op in ``[new, trig)`` from which ``nbytes`` more stay resident up to
        ``trig`` within the budget (Note [Late prefetch feedback] in swap.py): the plan's
        simulated peak per op plus what earlier moves added; ``trig`` when none fits, or when
        the plan carries no simulated curve."""
        peak = self.table.op_peak_bytes
        budget = self.rt.budget_bytes
        if len(peak) < trig or budget is None:
            return trig
        moved = self._moved()
        j = trig
        while j > new and peak[j - 1] + moved[j - 1] + nbytes <= budget:
            j -= 1
        return j

    # ---- divergence and passive mode ------------------------------------------------------------
    def _diverge(self, k: int, name: str, what: str, flat: list = ()) -> None:
        self.guided = False
        st = self.stats
        st.diverged = True
        st.diverged_at = k
        tbl = self.table
        exp_name = tbl.names[k] if k < tbl.n_ops else "the end of the iteration"
        # Note [End of run]: both the refusal and the warning wait for the step that ends the
        # iteration; code after the last step (evaluation, saving, printing) is no iteration.
        if (
            what == "op"
            and self.ix.iteration == self.rt.first_checked_iteration
            and k < max(4, tbl.n_ops // 50)
        ):
            self.foreign = PlanFormatError(
                f"{self.rt.plan_source}: plan was made for another script or trace: op {k} of "
                f"iteration {self.ix.iteration} is {name}, the plan expects {exp_name}"
            )
        if not self.warned and self.ix.iteration >= self.rt.first_checked_iteration:
            if what == "shapes" and k < tbl.n_ops:  # the shapes themselves, input by input
                got = shape_signature(x.shape for x in flat) or "-"
                name = f"{name} [{got}]"
                exp_name = f"{exp_name} [{tbl.signatures[k] or '-'}]"
            self.warning = (
                f"capuchin: warning: iteration {self.ix.iteration} diverges from the plan at op "
                f"{k} ({what}: got {name}, expected {exp_name}); planned actions stop for the "
                "rest of the iteration, evicted storages come back on demand"
                + (", passive mode keeps the budget" if self.rt.passive_enabled else "")
            )
        for sid in list(self.pending):  # decisions not dropped yet will not be
            e = self.by_sid.get(sid)
            if e is None or e.state is not Residency.OUT:
                self._done_with(tbl.decisions[sid])
        if self.rt.passive_enabled and not self.guard.active:
            # what skipped ops left (Note [Resync after an unexpected op]) is counted too: a
            # failed resync leaves passive mode no more than a plain divergence would
            extra = [t for t in (r() for r in self.skipped_outs) if t is not None]
            if not self.watching and (k > 0 or extra):
                self.guard.discover([*flat, *extra])  # CPU only: the CUDA allocator counts all
            self.guard.start()
        self.skipped_outs.clear()

    def coming_back(self, keys: list) -> int:
        """Bytes the on-demand restore of this op's evicted inputs will allocate."""
        if not self.entries:
            return 0
        total = 0
        for key in set(keys):
            e = self.entries.get(key)
            if e is not None and e.state is Residency.OUT:
                total += e.nbytes
        return total
