"""Op matching: where the running script is in the plan.

``PlanCursor`` matches each slow-path op against the plan: the expected op (compiled regions by
name), its shapes, the plan's kinds (Note [Iteration kinds], Note [Shape kinds at run time]),
resync after an unexpected op (Note [Resync after an unexpected op]) and divergence (Note
[Watched iterations], Note [End of run]); the Notes are in tracker.py. It owns the current
kind's compiled plan (``table``) and whether the plan is followed (``guided``); what is evicted
is the residency's (residency.py), which it tells about a kind switch and a divergence.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..distributed import say
from ..errors import PlanFormatError
from ..tracer.hooks import flatten_outputs
from ..tracer.schema import IdKind, TensorId, shape_signature
from .state import Residency, storage_key

# Note [Resync after an unexpected op]
RESYNC_LOOKAHEAD = 4  # ops after a skipped one that must match the plan by name and shapes
RESYNC_MAX_OPS = 8  # unexpected ops skipped per iteration; the next one is a divergence

_ALIASING: dict = {}


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


class PlanCursor:
    """The plan's position and kind for the running iteration. ``rt`` is the owning ``Runtime``
    (options), ``ix`` the op indexer, ``table`` the main kind's compiled plan (or None: no plan),
    ``res`` the residency, ``guard`` the plan-less guard (started at a divergence), ``backend``
    the device (its meta-tensor prediction of a skipped op's bytes)."""

    def __init__(self, rt, indexer, table, res, guard, backend):
        self.rt = rt
        self.ix = indexer
        self.table = table
        self.res = res
        self.guard = guard
        self.backend = backend
        self.stats = None
        self.guided = False
        self.watching = False  # Note [Watched iterations]
        # Note [Resync after an unexpected op]: ops skipped in this iteration, the bytes they
        # left allocated, and how many of the next ops must still match by name and shapes
        self.skipped = self.resync_left = 0
        self.skipped_outs: list[weakref.ref] = []  # their new outputs, counted at a divergence
        self.skipped_sizes: list[int] = []  # and the bytes of each
        self.last_diverged = False
        self.warned = False
        self.warning: str | None = None  # Note [End of run]: printed when a step ends the iteration
        self.foreign: PlanFormatError | None = None  # likewise raised at that step
        # Note [Iteration kinds]: the plan of each kind, the first one the plan's main kind
        self.kind_tables: list = [table] if table is not None else []
        self._prefix: dict[tuple[int, int], int] = {}  # common (name, shapes) prefix of 2 kinds
        # Note [Shape kinds at run time]: what other shape kinds keep out across the boundary,
        # named in every iteration
        self._kind_wrap_sids: set[str] = set()

    # ---- iteration lifecycle ---------------------------------------------------------------------
    def new_iteration(self, stats) -> None:
        self.stats = stats
        if self.kind_tables:  # Note [Iteration kinds]: every iteration starts as the main kind
            self.table = self.kind_tables[0]
            stats.kind = self.table.kind
        self.guided = self.table is not None
        self.skipped = self.resync_left = 0  # Note [Resync after an unexpected op]
        self.skipped_outs.clear()
        self.skipped_sizes.clear()
        # Note [Watched iterations]
        self.watching = self.guided and self.last_diverged and self.rt.passive_enabled

    def end_iteration(self) -> None:
        st = self.stats  # iteration 0 builds the model: its divergence predicts nothing
        self.last_diverged = (
            st is not None and st.diverged and st.iteration >= self.rt.first_checked_iteration
        )

    def step_ended(self) -> None:
        """A step ended the current iteration: a divergence in it was real (Note [End of run])."""
        if self.foreign is not None:
            err, self.foreign = self.foreign, None
            raise err
        if self.warning is not None:
            say(self.warning)
            self.warned = True
            self.warning = None

    # ---- the op against the plan -----------------------------------------------------------------
    def match(self, k: int, func, args, kwargs, info, flat: list):
        """Op ``k`` against the plan: its planned actions (or None: none, or the plan is not
        followed), and whether it is an unexpected op skipped without taking an op index of
        the plan (Note [Resync after an unexpected op]). A mismatch switches the kind, skips
        the op or diverges."""
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
                elif self._may_skip(k, func, args, kwargs):
                    extra = True
                    self.ix.op_index = k - 1  # it takes no op index of the plan
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
                    self._check_skipped(k, flat)
        return acts, extra

    # ---- kinds (Note [Iteration kinds], Note [Shape kinds at run time]) --------------------------
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
                for d in u.decisions():  # name what u keeps out across the boundary
                    if not d.wraps or d.storage_id in t.windows:
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
                self.res.restore_all()
            self.table = t
            self.res.switched_kind()
            self.stats.kind = t.kind
            self.res._bind_kind_wraps()
            return True
        return False

    # ---- resync after an unexpected op (Note [Resync after an unexpected op]) -------------------
    def _may_skip(self, k: int, func, args, kwargs) -> bool:
        """An op the plan does not expect at op ``k`` may be skipped: in a checked iteration,
        fewer than ``RESYNC_MAX_OPS`` skipped in it, and its predicted new outputs, with what
        earlier skipped ops left alive, fit the plan's headroom at ``k``."""
        if self.skipped >= RESYNC_MAX_OPS or self.ix.iteration < self.rt.first_checked_iteration:
            return False  # iteration 0 builds the model: it follows no plan (Note [Watched ...])
        _key, n = self.backend.memory.predict(func, args, kwargs)
        return self._live_skipped() + n <= self._headroom(k)

    def _live_skipped(self) -> int:
        """Bytes of the skipped ops' new outputs still alive."""
        pairs = zip(self.skipped_outs, self.skipped_sizes, strict=True)
        return sum(n for r, n in pairs if r() is not None)

    def _check_skipped(self, k: int, flat: list) -> None:
        """At a lookahead op ``k``: what skipped ops left alive must fit the headroom at ``k``;
        at the last one, the headroom of the rest of the iteration (the ops after it take the hot
        path, unchecked). A divergence otherwise (Note [Resync after an unexpected op])."""
        if not self.skipped_outs or not self.guided:
            return
        live = self._live_skipped()
        room = self._headroom(k if self.resync_left else None)
        if live and live > room:
            why = (
                f"unexpected ops' outputs still alive, {live} B, over the plan's headroom {room} B"
            )
            self._diverge(k, why, "headroom", flat)

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
                self.skipped_outs.append(weakref.ref(o))
                self.skipped_sizes.append(st.nbytes())
        if self._live_skipped() > self._headroom(k):  # more than its meta prediction
            self.ix.op_index = k
            self._diverge(k, name, "op", flat)
            return
        self.skipped += 1
        self.stats.resynced_ops += 1
        self.resync_left = RESYNC_LOOKAHEAD

    def _headroom(self, k: int | None = None) -> int:
        """Bytes the plan's simulated curve (plus what moved in-triggers added) leaves under the
        budget at op ``k``, or (None) at its highest op from the current one on; 0 without a
        curve."""
        peak = self.table.op_peak_bytes
        budget = self.rt.budget_bytes
        if not peak or budget is None:
            return 0
        moved = self.res._moved()
        if k is not None:
            k = min(max(k, 0), len(peak) - 1)
            return budget - peak[k] - (moved[k] if k < len(moved) else 0)
        start = min(max(self.ix.op_index, 0), len(peak) - 1)
        return budget - max(
            p + (moved[i] if i < len(moved) else 0) for i, p in enumerate(peak) if i >= start
        )

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
            detail = name if what == "headroom" else f"{what}: got {name}, expected {exp_name}"
            self.warning = (
                f"capuchin: warning: iteration {self.ix.iteration} diverges from the plan at op "
                f"{k} ({detail}); planned actions stop for the "
                "rest of the iteration, evicted storages come back on demand"
                + (", passive mode keeps the budget" if self.rt.passive_enabled else "")
            )
            if "_foreach_" in name and "_foreach_" in exp_name:
                # Note [Multi-tensor optimizers per chunk] in tracer/optimizer_chunks.py
                self.warning += (
                    " (if the trace was recorded before foreach optimizer steps ran per chunk "
                    "of parameters, trace the script again)"
                )
        res = self.res
        for sid in list(res.pending):  # decisions not dropped yet will not be
            e = res.by_sid.get(sid)
            if e is None or e.state is not Residency.OUT:
                res._done_with(res.pending[sid])
        if self.rt.passive_enabled and not self.guard.active:
            # what skipped ops left (Note [Resync after an unexpected op]) is counted too: a
            # failed resync leaves passive mode no more than a plain divergence would
            extra = [t for t in (r() for r in self.skipped_outs) if t is not None]
            if not self.watching and (k > 0 or extra):
                self.guard.discover([*flat, *extra])  # CPU only: the CUDA allocator counts all
            self.guard.start()
        self.skipped_outs.clear()
        self.skipped_sizes.clear()
