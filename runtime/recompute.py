"""Recompute engine: record the ops a plan may replay, drop their outputs, replay them on demand.

Rules from the prototype (reference/runtime-prototype.md §3), each needed for bitwise results:
- R1 in-place chains: a decision's ``replay_ops`` are the producer *and* the in-place ops that wrote
  the storage after it (relu_, add_, dropout's bernoulli_/div_); all are recorded and replayed in
  order, the in-place ones writing the replayed buffer.
- R2 source versions: each recorded argument keeps the runtime's own write counter of its storage
  (runtime/state.py); a replay whose source was written since raises ``RecomputeError``; never a
  silent wrong value.
- R3 copy-on-write: before an op writes a storage that is a source of a dropped storage, the tracker
  regenerates the dependent first (``dependents_of``), so R2 never has to fire in a correct plan.
- R4 RNG: ops tagged ``nondeterministic_seeded`` record the generator state they ran with (CPU or
  CUDA default generator, or an explicit ``generator=``) and replay under ``fork_rng``, so the
  global random stream is not disturbed.
- R5 side-effect sandbox: arguments a replayed op writes that are not part of the replayed chain
  (batch norm's running statistics) are cloned for the replay.
- R6 unannotated writes: "writes" come from ``tracer.hooks.written_inputs``, which adds the table of
  ops that mutate arguments their schema does not mark (native/cudnn batch norm).
- R7 complete chains: a plan file is input (stale, edited, from another version), so before a
  storage is dropped its chain must produce it and redo every write it received since: the
  storage's own write counter, less its value when the producer allocated it, must equal the
  writes the chain's recorded ops make to it. Otherwise it is swapped (``check_replayable``).
- R8 grad mode: each op replays under the grad mode it ran in (Note [Replay grad mode]).
- R9 compiled regions: a recorded region is replayed only where its replay is exact: no random
  numbers drawn inside, no input written, on CPU (Note [Region replay] in tracer/compiled.py,
  ``region_refusal``); the plan's word is not taken for it.
# Note: [Replay grad mode]
# Some ops return other outputs with grad mode off: ``aten.mkldnn_rnn_layer`` (nn.LSTM on CPU)
# returns no training workspace (its fourth output) under ``no_grad``, so a replay under
# ``no_grad`` could not regenerate a dropped workspace ("the replayed ops do not produce it",
# after the bytes were gone). A record keeps the grad mode its op ran in and the replay runs the
# op under it. The replayed arguments are fresh views of the storages (``_Slot.view``), which
# require no grad, so no autograd graph is built either way.

Collective recomputation (paper §5.3): a replay also refills the decision's ``keep`` storages that
are dropped, while memory allows; other intermediates are freed after their last use.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import RecomputeError
from ..planner.plan import Decision
from ..tracer.compiled import is_hop, is_region, region_facts, replay_refusal
from ..tracer.hooks import flatten_outputs, flatten_tensors, op_info, written_inputs
from ..tracer.schema import is_collective
from .device import replays_exactly
from .state import fill_from, storage_key, writes

_NAME_ATTR = "_capuchin_replay_name"
SANDBOX_WRITES = True  # rule R5; a test turns it off to show that training then differs


class _Slot:
    """A recorded tensor argument: where it lives and how it is viewed."""

    __slots__ = ("sid", "strong", "weak", "writes", "size", "stride", "offset", "dtype")

    def __init__(self, t: torch.Tensor, sid: str | None, pin: bool, st=None):
        """``st``: ``t``'s untyped storage when the caller looked it up already."""
        if st is None:
            st = t.untyped_storage()
        self.sid = sid
        self.strong = st if pin else None  # sources are pinned until the record is released
        self.weak = weakref.ref(st)
        self.writes = writes(st)
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()
        self.dtype = t.dtype

    def storage(self) -> torch.UntypedStorage | None:
        return self.strong if self.strong is not None else self.weak()

    def view(self, st: torch.UntypedStorage) -> torch.Tensor:
        t = torch.empty(0, dtype=self.dtype, device=st.device)
        return t.set_(st, self.offset, self.size, self.stride)


class _Marker:
    """Stands for flat tensor argument ``i`` in a recorded call's (args, kwargs) template."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _template(value, counter: list):
    if isinstance(value, torch.Tensor):
        counter[0] += 1
        return _Marker(counter[0] - 1)
    if isinstance(value, (list, tuple)):
        return type(value)(_template(v, counter) for v in value)
    return value


def _fill(value, tensors: list):
    if isinstance(value, _Marker):
        return tensors[value.i]
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value


@dataclass(eq=False)
class Record:
    """One recorded op call of the current iteration."""

    op_index: int
    func: object
    args: tuple  # template: tensors replaced by _Marker (flatten_tensors order == slot order)
    kwargs: dict
    slots: list[_Slot]
    written: tuple[int, ...]  # flat slots the op writes (schema + unannotated table)
    out_sids: list[str | None]  # storage id of each flat output it allocated, else None
    rng: tuple | None  # (kind, device/generator, state) for seeded ops (R4)
    grad: bool = False  # the grad mode it ran in (R8)
    out_writes: dict = field(default_factory=dict)  # sid -> its write counter once allocated (R7)


def _capture_rng(func, args, kwargs, flat) -> tuple | None:
    gen = kwargs.get("generator") if kwargs else None
    if gen is not None:
        return ("gen", gen, gen.get_state())
    dev = flat[0].device if flat else torch.device(kwargs.get("device") or "cpu")
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return ("cuda", idx, torch.cuda.get_rng_state(idx))
    return ("cpu", None, torch.get_rng_state())


def _run_with_rng(rec: Record, args, kwargs):
    kind, where, state = rec.rng
    if kind == "gen":
        saved = where.get_state()
        where.set_state(state)
        try:
            return rec.func(*args, **kwargs)
        finally:
            where.set_state(saved)
    devices = [where] if kind == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda" if kind == "cuda" else "cpu"):
        if kind == "cuda":
            torch.cuda.set_rng_state(state, where)
        else:
            torch.set_rng_state(state)
        return rec.func(*args, **kwargs)


class RecomputeEngine:
    """Holds this iteration's records and replays decisions.

    Storages that recorded ops allocated are named on the storage object itself (attribute
    ``_NAME_ATTR`` = (epoch, id)): a dict keyed by address would hand a dead storage's name to the
    next storage the allocator puts at the same place (a wrong replay, seen on the transformer); ``ensure_resident(storage)`` is the tracker's on-demand restore, used
    for sources that are themselves evicted; ``may_keep(nbytes)`` says whether memory allows
    keeping an extra regenerated storage (collective recomputation).
    """

    def __init__(self, ensure_resident: Callable, may_keep: Callable[[int], bool]):
        self.records: dict[int, Record] = {}
        self.epoch = 0
        self.ensure_resident = ensure_resident
        self.may_keep = may_keep
        self.stats = None
        self.depth = 0
        self.device_type = "cpu"  # the managed device (Note [Determinism precondition])

    def reset(self) -> None:
        self.records.clear()
        self.epoch += 1

    # ---- recording ----------------------------------------------------------------------------
    def record(
        self, k: int, func, args: tuple, kwargs: dict, flat: list, written: tuple, seeded: bool
    ) -> Record:
        """Record op ``k`` before it runs (RNG state is captured now)."""
        slots = []
        for t in flat:
            st = t.untyped_storage()
            tag = getattr(st, _NAME_ATTR, None)
            sid = tag[1] if tag is not None and tag[0] == self.epoch else None
            slots.append(_Slot(t, sid, pin=sid is None))
        counter = [0]
        rec = Record(
            k,
            func,
            _template(tuple(args), counter),
            _template(dict(kwargs), counter),
            slots,
            written,
            [],
            _capture_rng(func, args, kwargs, flat) if seeded else None,
            torch.is_grad_enabled(),
        )
        self.records[k] = rec
        return rec

    def recorded_outputs(self, rec: Record, out, input_keys: set[int]) -> None:
        """Name the storages op ``rec.op_index`` allocated (``"k:j"``, Note [Tensor and storage
        ids]); outputs sharing an input's storage (in-place, views) get None."""
        for j, t in enumerate(flatten_outputs(out)):
            try:
                key = storage_key(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                rec.out_sids.append(None)
                continue
            if key in input_keys:
                rec.out_sids.append(None)
            else:
                sid = f"{rec.op_index}:{j}"
                setattr(t.untyped_storage(), _NAME_ATTR, (self.epoch, sid))
                rec.out_sids.append(sid)
                rec.out_writes[sid] = writes(t.untyped_storage())

    def source_keys(self, d: Decision) -> set[int]:
        """Keys of the pinned (source) storages the replay of ``d`` reads."""
        keys = set()
        for k in d.replay_ops:
            rec = self.records.get(k)
            if rec is not None:
                for s in rec.slots:
                    if s.strong is not None:
                        keys.add(storage_key(s.strong))
        return keys

    def check_replayable(
        self, d: Decision, target: torch.UntypedStorage | None = None
    ) -> str | None:
        """Why ``d`` cannot be replayed right now (a missing record, a written source, or, given
        the ``target`` storage about to be dropped, a chain that does not produce it or misses a
        write it received: rule R7), or None. Checked before dropping: a plan that cannot be
        replayed is swapped instead."""
        produced = set()
        base = None  # target's write counter when its producer allocated it
        chain_writes = 0  # writes the chain's ops make to the target after that
        for k in d.replay_ops:
            rec = self.records.get(k)
            if rec is None:
                return f"op {k} was not recorded"
            # the name from op_info's per-op cache: this runs at every drop, for every op of the
            # replay (Note [Recompute decisions on the host] in planner/costs.py)
            if is_collective(op_info(rec.func).name):  # Note [Collectives] in planner/problem.py
                return f"op {k} is a collective"
            if is_hop(rec.func):  # Note [Region replay] in tracer/compiled.py
                why = region_refusal(rec, self.device_type)
                if why is not None:
                    return f"op {k} is a compiled region that is not replayed exactly: {why}"
            if not replays_exactly(rec.func, self.device_type):
                return f"op {k} ({rec.func}) is nondeterministic on {self.device_type}"
            for s in rec.slots:
                if s.sid in produced:
                    continue
                st = s.storage()
                if st is None:
                    return f"a source of op {k} was freed"
                if s.strong is not None and writes(st) != s.writes:
                    return f"a source of op {k} was written since"
            if base is not None:
                chain_writes += sum(1 for a in rec.written if rec.slots[a].sid == d.storage_id)
            produced.update(x for x in rec.out_sids if x)
            if base is None and d.storage_id in rec.out_writes:
                base = rec.out_writes[d.storage_id]
        if d.storage_id not in produced:  # never drop what no recorded op made (no bytes back)
            return "the recorded ops did not produce it"
        if target is not None:
            if base is None:
                return f"its replay ops {list(d.replay_ops)} do not produce it"
            if writes(target) - base != chain_writes:
                return (
                    f"it was written {writes(target) - base} time(s) after its producer and its "
                    f"replay ops redo {chain_writes}"
                )
        return None

    def release(self, d: Decision, still_needed: set[int]) -> None:
        """Drop the records of ``d`` not needed by other pending decisions (unpins sources)."""
        for k in d.replay_ops:
            if k not in still_needed:
                self.records.pop(k, None)

    # ---- replay -------------------------------------------------------------------------------
    def replay(
        self,
        d: Decision,
        target: torch.UntypedStorage,
        nbytes: int,
        dropped: dict[str, tuple[torch.UntypedStorage, int]],
    ) -> list[str]:
        """Regenerate ``target`` (storage ``d.storage_id``, currently 0 bytes) by replaying
        ``d.replay_ops``. ``dropped``: other dropped storages by id (storage, nbytes) that the
        replay may refill on the way (``d.keep``). Returns the ids refilled besides the target."""
        if self.depth > 16:
            raise RecomputeError(f"recompute of {d.storage_id}: sources nest deeper than 16 levels")
        self.depth += 1
        try:
            with _disable_current_modes(), torch.no_grad():
                return self._replay(d, target, nbytes, dropped)
        finally:
            self.depth -= 1

    def _replay(self, d, target, nbytes, dropped) -> list[str]:
        recs = []
        for k in d.replay_ops:
            rec = self.records.get(k)
            if rec is None:
                raise RecomputeError(
                    f"recompute of {d.storage_id}: op {k} was not recorded "
                    "(the run diverged from the plan)"
                )
            recs.append(rec)
        last_use: dict[str, int] = {}
        for i, rec in enumerate(recs):
            for s in rec.slots:
                if s.sid is not None:
                    last_use[s.sid] = i
        keep = set(d.keep) | {d.storage_id}
        env: dict[str, torch.UntypedStorage] = {}
        refilled = []
        for i, rec in enumerate(recs):
            tensors = []
            for a, s in enumerate(rec.slots):
                st = env.get(s.sid) if s.sid is not None else None
                if st is None:
                    st = self._source(d, rec, s)
                    if a in rec.written and SANDBOX_WRITES:  # R5: no write outside the chain
                        tensors.append(s.view(st).clone())
                        continue
                tensors.append(s.view(st))
            args = _fill(rec.args, tensors)
            kwargs = _fill(rec.kwargs, tensors)
            with torch.set_grad_enabled(rec.grad):  # R8
                out = (
                    _run_with_rng(rec, args, kwargs)
                    if rec.rng is not None
                    else rec.func(*args, **kwargs)
                )
            for sid, t in zip(rec.out_sids, flatten_outputs(out), strict=False):
                if sid is not None:
                    env[sid] = t.untyped_storage()
            del out, args, kwargs, tensors
            self.stats.recomputed_ops += 1
            for sid in [s for s in env if last_use.get(s, -1) <= i and s not in keep]:
                env.pop(sid)  # an intermediate: free after its last use in the replay (or now)
        got = env.get(d.storage_id)
        if got is None:
            raise RecomputeError(f"recompute of {d.storage_id}: the replayed ops do not produce it")
        fill_from(target, got, nbytes)
        for sid in d.keep:
            if sid in dropped and sid in env and self.may_keep(dropped[sid][1]):
                st, n = dropped[sid]
                fill_from(st, env[sid], n)
                refilled.append(sid)
        return refilled

    def _source(self, d: Decision, rec: Record, s: _Slot) -> torch.UntypedStorage:
        st = s.storage()
        if st is None:
            raise RecomputeError(
                f"recompute of {d.storage_id}: a source of op {rec.op_index} was freed"
            )
        self.ensure_resident(st)  # a swapped or dropped source comes back first
        if writes(st) != s.writes:  # R2
            raise RecomputeError(
                f"recompute of {d.storage_id}: source {s.sid or f'of op {rec.op_index}'} was "
                f"written after op {rec.op_index} read it; replaying would give a wrong value"
            )
        return st


def region_refusal(rec: Record, device_type: str) -> str | None:
    """Why the recorded call of a compiled region cannot be replayed exactly (Note [Region
    replay] in tracer/compiled.py), or None; any other higher-order op is never replayed."""
    if not is_region(rec.func) or not rec.args:
        return "it is not a compiled region"
    _name, seeded, region_writes = region_facts(rec.args[0])
    return replay_refusal(seeded, region_writes, device_type)


def record_inputs(func, args, kwargs):
    """(flat inputs, written flat indices, seeded) of a call, per tracer/hooks.py."""
    info = op_info(func)
    flat = flatten_tensors(args, kwargs)
    return flat, written_inputs(info, args, kwargs, flat), info.seeded
