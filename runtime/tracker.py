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
# guards/lru.py). An iteration that diverges midway switches to passive mode with the outputs of its
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
# diverged iteration, unwatched, ``BudgetGuard.discover`` (guards/lru.py) counts what the ops
# before the divergence left resident through the autograd graph (the tensors of a live graph
# and what they saved): at a divergence at op 100 of the transformer the measured peak went
# 1.24x -> 0.98x the budget. It misses resident tensors outside any graph (data made under
# no_grad, detached results).

# Note: [Iteration kinds]
# A plan may cover several kinds of iteration (training steps, steps that also evaluate, the
# first step of an epoch: docs/plan-format.md ``kinds``). Every iteration starts under the plan's
# main kind; at the first op that does not match it, the runtime looks for another kind whose
# plan has the same ops (names and shapes) up to there and this op next, and continues under that
# kind's plan (``PlanCursor._switch_kind`` in matching.py); only when none matches is it a
# divergence. The kinds of a trace usually part at their first ops (an evaluation pass before the
# training step), so little of the new kind's plan is lost. Each iteration's kind is in the
# report (``kind``).

# Note: [Shape kinds at run time]
# Kinds of the same op names and other shapes (planner/api.py Note [Shape kinds]: dynamic padding
# with buckets) part at the first op that allocates with other input shapes. Two such kinds'
# common prefix (``PlanCursor._prefix``) compares names, and shapes only where the op allocates:
# other shapes at an op that allocates nothing (a sample copied into a slice of the padded batch)
# tell no kind apart. The ops up to the last op where such kinds part take the slow path in
# every iteration and are checked by shapes (``ActionTable.check_until``, set by
# ``PlanCursor.check_shape_kinds``), so the iteration switches to its kind there, before the
# forward pass has left anything of the main kind's plan to undo. A switch on other shapes needs
# the new kind's shapes at that op (with three buckets, a switch on names alone took the wrong
# kind and diverged at its first action). Other shapes at an op with no action that allocates
# nothing are let pass before any switch is tried: a sample copy of a length that happens to be
# the other kind's would switch there and back, and the iteration lost one planned eviction. A
# switch restores what the current kind evicted but
# what is out across the iteration boundary (``restore_all`` keeps wrap-around entries out; the
# new kind's decision of the same id takes it back). What only the new kind keeps out is named
# in every kind's iterations (``check_shape_kinds`` adds the naming to the other kinds' tables)
# and swapped out at the switch (``StorageResidency._bind_kind_wraps`` in residency.py; under
# the main kind, which every iteration starts as, at the last op where the kinds part), before
# the forward pass: left
# resident it measured 1.12x the budget in a 28-long batch after a 20-long
# one of tests/frameworks/dynamic_pad.py --buckets 3.

# Note: [Resync after an unexpected op]
# A script may run an op the plan does not know where the traced iteration had none: a data
# loader's ``randperm`` when an epoch starts, a logging op, a framework's epoch-boundary op.
# Such an op (its name is not the plan's op here, and no other kind's plan takes it) is
# *skipped*, not a divergence, when both hold: fewer than ``RESYNC_MAX_OPS`` ops were skipped in
# this iteration, and the new output bytes of the skipped ops still alive (predicted on meta
# tensors before it runs, counted after) fit the plan's headroom at the op where it runs, the
# budget less the plan's simulated curve there (``Plan.op_peak_bytes``, plus what moved
# in-triggers added). What they leave alive must fit the headroom at each lookahead op below,
# and, after the last, the headroom of the rest of the iteration (its highest op on), whose ops
# take the hot path unchecked: the plan's curve then stays within the budget with them
# resident. So a transient (a sampler's permutation read into a list and freed) is skipped even
# where the plan's curve meets the budget later on, as under load, when late prefetches move
# in-triggers earlier until it does; one the script keeps needs room for the rest of the
# iteration. A skipped op takes no op index of the plan (the next op
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
# script, are held until a step ends the iteration (``PlanCursor.step_ended``); when the run ends
# first, the incomplete iteration is reported with ``complete: false`` and not as diverged. While
# held, the iteration runs as after any divergence: planned actions stop, passive mode keeps the
# budget.
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
from ..tracer.schema import communicates
from .device import caught_oom
from .matching import PlanCursor, _keys
from .residency import StorageResidency
from .state import Entry, Residency, bump_writes, expose, storage_key, storages
from .threads import LOCK

_EMPTY: list = []
_NONE: dict = {}
_ANY = {None: None}  # non-empty: guarded with nothing evicted (swap-outs in flight, records)


# Note: [Dynamo off in the dispatch]
# Dynamo must never compile the runtime's own frames: a frame the script's compiled code calls
# eagerly (after a graph break) dispatches its ops to this mode with Dynamo's frame callback
# set. ``TorchDispatchMode`` ensures that by wrapping every subclass's ``__torch_dispatch__`` in
# ``torch._disable_dynamo``: two Python frames, an attribute lookup and a stance check per op,
# about a third of what a trivial mode costs an op (docs/runtime.md, "Predictions on scripts
# of short ops"). The mode does the same itself: the code of ``__torch_dispatch__`` is marked for
# Dynamo to skip (``set_code_exec_strategy``, what ``torch._dynamo.skip`` does, here without
# importing Dynamo), and its first step clears the frame callback for every frame it calls
# (what ``torch._dynamo.disable(recursive=True)`` does), restoring it when the op returns.
# The hooks are private: where this torch lacks one of them, the mode keeps torch's wrapper
# (``_should_skip_dynamo``), which does the same at its cost.
try:
    _EVAL_FRAME = torch._C._dynamo.eval_frame
    _SKIP_FRAME = _EVAL_FRAME._FrameExecStrategy(
        _EVAL_FRAME._FrameAction.SKIP, _EVAL_FRAME._FrameAction.DEFAULT
    )
    _OWN_DYNAMO_SWITCH = callable(_EVAL_FRAME.set_eval_frame) and callable(
        _EVAL_FRAME.set_code_exec_strategy
    )
except AttributeError:
    _EVAL_FRAME = _SKIP_FRAME = None
    _OWN_DYNAMO_SWITCH = False


class TrackerMode(TorchDispatchMode):
    """The mode object; all logic lives in ``Executor`` (it outlives re-entries of the mode)."""

    supports_higher_order_operators = True  # compiled regions (Note [torch.compile])

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Dynamo compiles under the mode (Note [torch.compile] in tracer/compiled.py)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Note [Dynamo off in the dispatch]: done in __torch_dispatch__ itself where torch has
        # the hooks for it, else torch's own wrapper
        return not _OWN_DYNAMO_SWITCH

    def __init__(self, executor: Executor):
        super().__init__()
        self.ex = executor
        self.ix = executor.ix
        self.fast = _EMPTY
        self.evicted = _NONE  # the executor's entries while the hot path is guarded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _OWN_DYNAMO_SWITCH:  # torch's wrapper around this method turns Dynamo off
            return self._dispatch(func, args, kwargs)
        prior = _EVAL_FRAME.set_eval_frame(None)  # Note [Dynamo off in the dispatch]
        try:
            return self._dispatch(func, args, kwargs)
        finally:
            _EVAL_FRAME.set_eval_frame(prior)

    def _dispatch(self, func, args, kwargs):
        if SPLIT_SPECS.get(func, 0) is not None:  # Note [Multi-tensor op split] in hooks.py
            calls = split_calls(func, args, kwargs or {})
            if calls is not None:
                return join_outputs([self._dispatch(func, a, k) for a, k in calls])
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


if _OWN_DYNAMO_SWITCH:
    _EVAL_FRAME.set_code_exec_strategy(TrackerMode.__torch_dispatch__.__code__, _SKIP_FRAME)


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


class Executor:
    """The plan executor: the hot path's switch and the slow path, an op's steps in order. Its
    two pieces are the cursor (matching.py: the op against the plan, kinds, resync, divergence)
    and the residency (residency.py: evicted storages, planned actions, on-demand and step-end
    restores, late-prefetch feedback, wrap-around binding). ``rt`` is the owning ``Runtime``
    (options); ``table`` the compiled plan (or None: passive only). The plan-less guard
    (runtime/guards/) is ``self.guard``, built by ``make_guard(executor)``; it evicts through
    ``adopt`` into the residency's ``entries``, which the executor restores on demand."""

    def __init__(self, rt, indexer, table, swap, recompute, make_guard, backend):
        self.rt = rt
        self.ix = indexer
        self.swap = swap
        self.recompute = recompute
        self.backend = backend
        self._cuda = backend.device.type == "cuda"  # Executor._run: retry a real OOM
        res = self.res = StorageResidency(rt, table, swap, recompute, backend, self._update_fast)
        swap.make_room = res._make_room  # Note [Out of memory in the runtime] in swap.py
        self.guard = make_guard(self)
        self.cursor = PlanCursor(rt, indexer, table, res, self.guard, backend)
        res.cursor, res.guard = self.cursor, self.guard
        # the residency's containers (one object each, never rebound): the hot path reads
        # ``op_time`` (Note [Hot path]), the guards ``entries``, ``by_sid`` and ``dependents``
        self.entries = res.entries
        self.by_sid = res.by_sid
        self.dependents = res.dependents
        self.op_time = res.op_time
        self.kind_tables = self.cursor.kind_tables  # the Runtime adds the plan's other kinds
        self.stats = None
        self.mode = TrackerMode(self)

    # ---- iteration lifecycle (called by the Runtime) --------------------------------------------
    def begin_iteration(self, stats) -> None:
        self.stats = stats
        self.swap.stats = stats
        self.recompute.stats = stats
        self.res.new_iteration(stats)
        guard = self.guard
        guard.new_iteration()
        self.cursor.new_iteration(stats)
        self.res._count_pending()
        if self.cursor.guided:
            guard.stop()  # a plan applies again; divergence may restart it
        elif self.rt.passive_enabled and not guard.active:
            guard.start()
        self._update_fast()

    def check_shape_kinds(self) -> None:
        self.cursor.check_shape_kinds()  # Note [Shape kinds at run time]

    def step_ended(self) -> None:
        self.cursor.step_ended()  # Note [End of run]

    def end_iteration(self) -> None:
        self.cursor.end_iteration()
        self.res.end_iteration()

    def restore_all(self, wrapping: bool = False) -> None:
        self.res.restore_all(wrapping)

    # ---- what the guards and the Runtime's hooks call --------------------------------------------
    def adopt(self, key: int, e: Entry) -> None:
        self.res.adopt(key, e)

    def died(self, key: int):
        return self.res.died(key)

    def restore(self, e: Entry, planned: bool = False) -> None:
        self.res.restore(e, planned)

    def ensure_resident(self, st) -> None:
        self.res.ensure_resident(st)

    def coming_back(self, keys: list) -> int:
        return self.res.coming_back(keys)

    def restore_for_read(self, key: int) -> None:
        """A raw read of storage ``key`` (Note [Raw reads] in rawreads.py): back first, also
        from a swap-out still in flight (its end would free the bytes)."""
        with LOCK:
            e = self.entries.get(key)
            if e is not None:
                self.restore(e)
                self._update_fast()

    # ---- fast path switch ------------------------------------------------------------------------
    def _update_fast(self) -> None:
        mode, cur = self.mode, self.cursor
        if not cur.guided or self.guard.active or cur.watching or cur.resync_left:
            mode.fast, mode.evicted = _EMPTY, _NONE
        elif not self.entries and not self.swap.pending_out and not self.recompute.records:
            mode.fast, mode.evicted = cur.table.fast, _NONE
        else:  # Note [Hot path]: guarded while anything is evicted, in flight or recorded
            mode.fast = cur.table.guarded
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

    # ---- the slow path ---------------------------------------------------------------------------
    def slow_op(self, func, args, kwargs):
        """An op off the hot path, in steps: index it, match it against the plan (cursor), the
        residency's steps before it, the guard's room, on-demand restores, copy-on-write, names
        and a replay's record, the op, the residency's steps after it, the guard's count."""
        info = op_info(func)
        if info.ignored:
            return func(*args, **kwargs)
        if info.hop:  # a compiled region: matched by name (Note [torch.compile])
            info = call_info(info, func, args)
        k = self._next_op()
        flat = flatten_tensors(args, kwargs)
        if _COMMUNICATES.get(func, True) and _communicates(func):  # Note [Collectives] ...
            for _key, st in storages(flat):
                expose(st)
        cur, res, guard = self.cursor, self.res, self.guard
        acts, extra = cur.match(k, func, args, kwargs, info, flat)
        res.before_op(k, func, flat, acts)
        passive = guard.active
        watch = passive or (cur.watching and cur.guided)
        keys = _keys(flat) if (self.entries or watch or self.dependents) else None
        token = None
        if passive:  # room first for what the op allocates (Note [Passive budget on CPU])
            token = guard.before_op(func, args, kwargs, info.name, flat, keys)
        if self.entries:  # on demand: nothing may read an evicted storage
            res.restore_inputs(keys)
        written = res.copy_on_write(info, args, kwargs, flat)
        rec = None
        if acts is not None:
            res.name_inputs(acts, flat)
            if acts.record:
                rec = self.recompute.record(k, func, args, kwargs, flat, written, info.seeded)
        learn = passive and guard.memory.learns_scratch()  # Note [Scratch learned on CUDA]
        if learn:
            guard.memory.op_starts(info.name, flat)
        out = func(*args, **kwargs) if not self._cuda else self._run(func, args, kwargs)
        if learn:
            guard.memory.op_ends()
        if acts is not None or watch:
            in_keys = None
            if rec is not None or watch:
                in_keys = set(keys if keys is not None else _keys(flat))
            if acts is not None:
                res.after_op(k, info.name, flat, out, acts, rec, in_keys)
            if passive:
                guard.after_op(flatten_outputs(out), in_keys, token)
            elif watch:
                guard.watch(flatten_outputs(out), in_keys, token)
        if extra:
            cur._skipped(k, info.name, flat, out)
        self._update_fast()
        return out

    def _next_op(self) -> int:
        """The op's index (and time: late-prefetch feedback), starting an iteration first by
        the same boundary rule as OpIndexer.begin_op (tracer/hooks.py)."""
        ix = self.ix
        if ix.iteration < 0 or (ix.step_pending and not ix.in_optimizer):
            ix._start_iteration()
        ix.op_index += 1
        k = ix.op_index
        self.op_time[k] = time.perf_counter()
        return k

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
                    if not self.rt.lift_cap(need):  # Note [Lifting the cap] in engine.py
                        raise
        return func(*args, **kwargs)
