"""Residency: which storages are out, and bringing them back.

``StorageResidency`` owns the evicted storages (``entries``, by storage key; ``by_sid``, by the
plan's storage id), whoever evicted them (the plan, or the plan-less guard through the
executor's ``adopt``), and the plan's names for this iteration's live storages (``live``). It
carries out the plan's evictions and the actions before an op (prefetch, restore, replay),
restores on demand and at the step end, regenerates dropped storages before a write to their
sources (copy-on-write, R3 in recompute.py), moves late prefetches earlier (Note [Late prefetch
feedback] in swap.py) and binds wrap-around storages (Note [Wrap-around storages before the first
planned iteration], Note [Shape kinds at run time], in tracker.py). Which plan applies (the
current kind's ``table``, ``guided``) is the cursor's (matching.py).
"""

from __future__ import annotations

import collections
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import RecomputeError
from ..planner.plan import Decision, Step, window_key
from ..tracer.hooks import flatten_outputs, written_inputs
from ..tracer.schema import IdKind, TensorId, id_kind, shape_signature
from .device import caught_oom
from .state import (
    Entry,
    Reason,
    Residency,
    bump_writes,
    evictable,
    resize,
    storage_key,
)
from .threads import LOCK


class StorageResidency:
    """The evicted storages and the plan's residency actions. ``rt`` is the owning ``Runtime``
    (options), ``table`` the main kind's compiled plan (or None), ``swap`` and ``recompute`` the
    engines that move and regenerate bytes, ``update_fast`` the executor's switch of the hot
    path (called when what is evicted changes). ``cursor`` (the plan's position) and ``guard``
    are set by the executor."""

    def __init__(self, rt, table, swap, recompute, backend, update_fast):
        self.rt = rt
        self.swap = swap
        self.recompute = recompute
        self.backend = backend
        self._update_fast = update_fast
        self.cursor = None
        self.guard = None
        self.stats = None
        self.entries: dict[int, Entry] = {}  # storage key -> evicted storage
        self.by_sid: dict[str, Entry] = {}
        self.live: dict[str, weakref.ref] = {}  # plan storage id -> storage (this iteration)
        self.dependents: dict[int, set[str]] = {}  # source key -> dropped storage ids (R3)
        # recompute decisions still to come back this iteration, by storage (one at most each:
        # Note [Several windows per storage] in planner/plan.py)
        self.pending: dict[str, Decision] = {}
        self.op_refs: dict[int, int] = {}  # op index -> pending decisions that replay it
        self.op_time: dict[int, float] = {}
        self.trigger_now: dict = {}  # late-prefetch feedback (Note [Late prefetch ...])
        # bytes that moved in-triggers keep resident at each op, beyond the plan's simulation
        self.moved_bytes = [0] * (table.n_ops if table is not None else 0)
        self._moved_by_kind: dict[str, list[int]] = {}  # the same for the plan's other kinds
        # Note [Shape kinds at run time]: the storages the last iteration named as what other
        # shape kinds keep out across the boundary
        self._kind_wraps: dict[str, weakref.ref] = {}
        self._kind_wraps_from = None  # the table of the iteration that named them
        # Note [Wrap-around storages before the first planned iteration]
        wraps = [d.back_op for d in (table.decisions() if table is not None else ()) if d.wraps]
        self._tail = collections.deque(maxlen=table.n_ops - min(wraps)) if wraps else None

    # the plan that applies, the cursor's (matching.py)
    @property
    def table(self):
        return self.cursor.table

    @property
    def guided(self) -> bool:
        return self.cursor.guided

    @property
    def kind_tables(self) -> list:
        return self.cursor.kind_tables

    # ---- iteration lifecycle ---------------------------------------------------------------------
    def new_iteration(self, stats) -> None:
        self.stats = stats
        self.live.clear()
        self.op_time.clear()
        self.recompute.reset()
        self.dependents.clear()

    def switched_kind(self) -> None:
        """The cursor took another kind's plan (Note [Iteration kinds]): its names and replays
        start over."""
        self.live.clear()
        self.dependents.clear()
        self.recompute.reset()
        self._count_pending()

    def _count_pending(self) -> None:
        self.pending.clear()
        self.op_refs.clear()
        if self.table is not None:
            for d in self.table.decisions():
                if d.method.value == "recompute":
                    self.pending[d.storage_id] = d
                    for k in d.replay_ops:
                        self.op_refs[k] = self.op_refs.get(k, 0) + 1

    def end_iteration(self) -> None:
        """Late prefetches move earlier; what other shape kinds keep out is named for the next
        iteration, and the plan's wrap-around storages are bound after an iteration that did
        not follow the plan."""
        for d, nbytes in self.swap.judged_late():  # Note [Lateness on the device's timeline]
            self._late_feedback(d, nbytes)
        self._kind_wraps = {  # Note [Shape kinds at run time]
            sid: ref
            for sid in (self.cursor._kind_wrap_sids if self.guided else ())
            if (ref := self.live.get(sid)) is not None
        }
        self._kind_wraps_from = self.table
        if self._tail:
            if not self.guided:  # Note [Wrap-around storages before the first planned ...]
                with _disable_current_modes(), torch.no_grad():
                    self._prebind_wraps()
                    self.guard.swap_out_persistent()  # Note [Persistent state under the guard]
            self._tail.clear()

    # ---- wrap-around binding ---------------------------------------------------------------------
    def _bind_kind_wraps(self) -> None:
        """Note [Shape kinds at run time]: after a switch, what the new kind keeps out across
        the iteration boundary and the last iteration's kind left resident is swapped out now,
        as that decision's entry (its prefetch and restore are the plan's)."""
        refs, self._kind_wraps = self._kind_wraps, {}
        if self._kind_wraps_from is None or self._kind_wraps_from.names != self.table.names:
            return  # ids name the same tensors only in kinds of the same ops
        with _disable_current_modes(), torch.no_grad():
            for d in self.table.decisions():
                sid = d.storage_id
                ref = refs.get(sid)
                st = ref() if ref is not None and d.wraps and sid not in self.by_sid else None
                if st is None or st.nbytes() != d.size_bytes or storage_key(st) in self.entries:
                    continue
                self.live[sid] = ref
                self._evict(Step.EVICT_SWAP, sid, d)
                self.live.pop(sid, None)
        self._update_fast()

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
        for d in tbl.decisions():
            sid = d.storage_id
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
            self._evict(Step.EVICT_SWAP, sid, d)
        self.live.clear()

    # ---- an op's steps (in the order ``Executor.slow_op`` calls them) ----------------------------
    def before_op(self, k: int, func, flat: list, acts) -> None:
        """Before op ``k`` runs: wrap-around binding, swap-outs polled, the plan's actions before
        the op (``acts``: None when none or the plan is not followed)."""
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

    def restore_inputs(self, keys: list) -> None:
        """On demand: nothing may read an evicted storage."""
        for key in keys:
            e = self.entries.get(key)
            if e is not None:
                self.restore(e)

    def copy_on_write(self, info, args, kwargs, flat: list) -> list:
        """The op's written inputs (returned): what depends on them is regenerated before they
        change (R3), and their writes are counted."""
        if not (info.write_args or info.unannotated_write_args or info.region_writes):
            return ()  # most ops write nothing
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
        return written

    def name_inputs(self, acts, flat: list) -> None:
        for a, sid in acts.name_inputs:
            if a < len(flat):
                self.live[sid] = weakref.ref(flat[a].untyped_storage())

    def after_op(self, k: int, name: str, flat: list, out, acts, rec, in_keys) -> None:
        """After op ``k`` ran with planned actions ``acts``: its outputs named, a replay's
        record completed, the plan's evictions (a storage of another size diverges: Note
        [Sizes are checked too])."""
        if acts.name_outputs:
            outs = flatten_outputs(out)
            for j, sid in acts.name_outputs:
                if j < len(outs):
                    self.live[sid] = weakref.ref(outs[j].untyped_storage())
        if rec is not None:
            self.recompute.recorded_outputs(rec, out, in_keys)
        for step, sid in acts.after:
            if self._other_size(sid):  # Note [Sizes are checked too]
                self.cursor._diverge(k, name, "sizes", flat)
                break
            # Note [Several windows per storage] in planner/plan.py: the window evicted here
            self._evict(step, sid, self.table.evicting(sid, k))

    # ---- room for runtime-internal allocations ---------------------------------------------------
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
        size = self.table.size_of(sid)
        ref = self.live.get(sid)
        st = ref() if ref is not None else None
        if size is None or st is None or st.nbytes() == 0:
            return False
        return st.nbytes() != size

    def _evict(self, step: Step, sid: str, d) -> None:
        """Evict storage ``sid`` (live, named this iteration) by ``step``, as decision ``d`` of
        the plan (None: the plan has none there, nothing happens)."""
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
    def restore_all(self, wrapping: bool = False) -> None:
        with LOCK:  # Note [Other threads] in threads.py
            self._restore_all(wrapping)

    def _restore_all(self, wrapping: bool) -> None:
        """Iteration end (or step end): every evicted storage comes back, except those of
        wrap-around decisions (``Decision.wraps``: they stay out across the iteration boundary
        until their back-access in the next iteration or any access) unless ``wrapping``
        (the end of the run)."""
        restored = False
        if not wrapping:  # Note [Persistent state under the guard] in guards/lru.py
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

    def ensure_resident(self, st) -> None:
        e = self.entries.get(storage_key(st))
        if e is not None:
            self.restore(e)

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
            self.guard.replay(e)  # dynamic mode (runtime/guards/dtr.py)
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

    # ---- late-prefetch feedback (Note [Late prefetch feedback] in swap.py) -----------------------
    def _late_feedback(self, d, nbytes: int) -> None:
        """Move a late prefetch's in-trigger (decision ``d``, ``nbytes``) earlier for the next
        iteration (Note [Late prefetch feedback] in swap.py), never to where it would take the
        plan over its budget."""
        # by window (Note [Several windows per storage] in planner/plan.py) in the main kind's
        # plan, by (kind, window) in the others'
        tkey = (
            window_key(d)
            if self.table is self.kind_tables[0]
            else (self.table.kind, *window_key(d))
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
