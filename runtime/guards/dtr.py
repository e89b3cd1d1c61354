"""Dynamic mode: DTR's eviction and rematerialization (Kirisame et al., ICLR'21) in the runtime,
where no plan applies (a run with only a budget, iteration 0, the rest of a diverged iteration).

While it is on, an op that allocates a storage in the iteration, or writes one that has a chain,
is recorded after it ran (function, arguments, the RNG state a seeded op ran with, its measured
time); views and reads are not. Each storage an op allocates keeps its *chain*: the producer and
the in-place ops that wrote it since (rule R1 of recompute.py).
When the next op would take resident bytes over the budget, the resident storage with the lowest

    h(s) = C(s) / (M(s) * L(s))

is evicted first (M: bytes, L: staleness in ops since its last access, C: the cheaper way back;
the score and its union-find are DTR's, shared with the planner's ``dtr`` policy: Note [DTR's
score] in dtr_score.py). C of a drop is the chain's measured time (plus a replay's measured
overhead per op, and the time of the freed sources it regenerates, Note [Ghosts]) plus e*, the
value of every distinct set of dropped storages next to ``s``. C of a swap is its way out and
back, each fitted to this run's own swaps as a fixed cost plus bytes over a bandwidth (Note [What
a swap costs]).
An evicted storage comes back when an op reads it: a swapped one by copy, a dropped one by
replaying its chain, after its dropped sources have come back first (ancestors first, each with
room made under the budget, so nothing recurses deeply).

# Note: [What may be dropped]
# Dropping is exact only where the replay computes the same bytes (recompute.py's rules): every op
# that wrote the storage since its producer is recorded (R1; a write by an unrecorded op, by a
# collective, or a chain longer than ``MAX_CHAIN`` makes it swap-only), no storage the chain reads
# was written since it read it (R2, checked at eviction time against the runtime's write
# counters), seeded ops replay under their recorded RNG state (R4), arguments a replayed op writes
# outside its chain are cloned (R5, R6). Once dropped, its sources are pinned (kept alive as
# objects, so they stay countable and evictable themselves) and registered for copy-on-write (R3):
# an op about to write one regenerates the dependent first. Everything else is swapped. Only
# storages allocated by an op of the current iteration are evicted at all (Note [Storage-level
# eviction] in state.py): parameters, optimizer state and data made outside ops stay resident.

# Note: [Ghosts]
# A chain's source may be freed by the script before the storage is evicted (autograd frees the
# addmm output behind a tanh, which saves only its result). A storage that dies with a chain
# leaves a ghost for the iteration (its records and final write counter); a replay that reads it
# regenerates it first, into a temporary freed after its last use, recursively. Sources alive at
# the drop are pinned instead. At the step end a dropped storage that only pins hold stays
# dropped (``DynamicGuard.stays_out``); copy-on-write brings back the dropped storages the script
# still holds that need the written one, through pinned sources (``DynamicGuard._live_roots``),
# one at a time, since bringing one back releases what only it pinned.

# Note: [What a swap costs]
# A swap's time is not its bytes over a bandwidth alone: each eviction makes an entry, takes a
# host buffer and frees the storage; each restore allocates it again and forgets the entry. With
# C counting bytes only, h = C/(M*L) is the same per byte for every storage and the ranking is
# staleness alone: many small victims where one larger one frees the same room. So each way
# (``DynamicGuard.copy_out``: the swap-out from the entry's creation on; ``copy_in``: the
# restore) is fitted as ``fixed + bytes / bandwidth`` by least squares to this run's swaps
# (``_CopyTime``), so that a storage's h counts what evicting it costs beyond its bytes, and one
# larger victim is preferred to several small ones that free the same room. The fitted values and
# the victims they save are measured by ``benchmarks/dynamic.py`` (docs/dynamic.md).

# Note: [Recording only while replay pays]
# Recording is most of dynamic mode's cost per op (measured: 10 ms per step of the bundled
# transformer's 640 ops with nothing evicted, against LRU's bookkeeping). With ``remat="auto"``
# a storage is dropped only where its replay is cheaper than its swap; where no eviction of an
# iteration was a drop (on the CPU host, the CNN and the MLP: a swap is a memcpy, cheaper than
# replaying a convolution or a matmul), the records bought nothing. So after the first two
# iterations (the one that builds the model, and a first step), an iteration records only if the
# one before it dropped and those drops saved more than recording cost (the swaps they replaced,
# less their replays, against ``RECORD_OP_S`` per op of that iteration: on the CPU host the
# transformer's few drops per step save well under a millisecond of memcpy and recording costs
# about 10 ms), and iteration ``PROBE_EVERY`` records again to look, then the next probe comes
# after twice the gap each time (8, 16, 32, ...: over a long run the probes' recording costs next
# to nothing), back to every ``PROBE_EVERY`` after an iteration whose drops paid;
# an iteration that does not record swaps DTR's victims (the h of a swap-only storage is its
# swap's cost per byte over its staleness). ``remat="recompute"`` always records, ``"swap"``
# never does (it never replays).

# Note: [Cycles of dropped storages]
# A dropped storage comes back after the dropped sources of its replay (``bring_back``), so the
# sources of dropped storages must never form a cycle. Allocation order alone would make them a
# DAG (an op reads older storages), but a chain's in-place ops read storages that are themselves
# written later: batch norm writes running_mean and running_var in one op, so each one's chain
# (zeros, zero_, native_batch_norm), built in the iteration that creates the model, reads the
# other. With both dropped, each replay needs the other first: the replays recursed until
# Python's stack ran out (the CNN at 25-30% with ``remat="recompute"``). A storage whose replay
# reads, directly or through the pinned sources of dropped storages, a dropped storage whose
# replay reads it is swapped instead (``DynamicGuard.drop_plan``); a replay that finds its own
# entry already being replayed raises ``RecomputeError`` rather than recurse.
"""

from __future__ import annotations

import collections
import math
import operator
import random
import time
import weakref

import torch

from ...dtr_score import Node, neighbourhood, score, union
from ...errors import RecomputeError
from ...planner.plan import Decision, Method
from ...tracer.compiled import is_hop
from ...tracer.hooks import call_info, op_info, written_inputs
from ...tracer.schema import is_collective
from ..device import caught_oom, replays_exactly
from ..recompute import RecomputeEngine, Record, _capture_rng, _Marker, _Slot
from ..state import Entry, Reason, Residency, evictable, resize, storage_key, writes
from .lru import BudgetGuard, PassiveTracker

MAX_CHAIN = 64  # ops in one storage's chain (producer + in-place writes); longer: swap only
# candidates ranked per eviction: more are sampled (at random, DTR's sqrt(n) sampling, at least
# this many); below it all are ranked (the workloads measured here had 10-60)
SAMPLE = 64
PROBE_EVERY = 8  # Note [Recording only while replay pays]
RECORD_OP_S = 15e-6  # recording's cost per op (10 ms per step of the transformer's 640 ops)
_NAME_ATTR = "_capuchin_dtr_name"
REMAT = ("auto", "recompute", "swap")
_NO_KEYS: frozenset = frozenset()
# The clock behind every cost dynamic mode measures (op times, copy times, replays). A module
# name looked up at each call, so that a test can put a clock of its own in its place and make
# dynamic mode's choices independent of how busy the machine is.
seconds = time.perf_counter
_rank = operator.itemgetter(0, 1)  # h, then the least recently used first
_REPLAYABLE: dict = {}  # op -> not a collective (its namespace, looked up once)
_MARKERS = tuple(_Marker(i) for i in range(256))  # shared: a marker is never changed


def _template(value, counter: list):
    """``recompute._template`` of the positional arguments (tensors replaced by markers in flat
    order), without rebuilding the arguments that hold no tensor (sizes, scalars, dtypes)."""
    out = None
    for i, v in enumerate(value):
        if isinstance(v, torch.Tensor):
            n = counter[0]  # flat position (``i`` is the position in ``value``)
            counter[0] = n + 1
            v = _MARKERS[n] if n < len(_MARKERS) else _Marker(n)
        elif isinstance(v, (list, tuple)) and v and _has_tensor(v):
            v = _template(v, counter)
        elif isinstance(v, list):
            v = list(v)
        else:
            if out is not None:
                out.append(v)
            continue
        if out is None:
            out = list(value[:i])
        out.append(v)
    if out is None:
        return value if isinstance(value, tuple) else list(value)
    return type(value)(out)


def _has_tensor(v) -> bool:
    for x in v:
        if isinstance(x, torch.Tensor) or (isinstance(x, (list, tuple)) and _has_tensor(x)):
            return True
    return False


class _CopyTime:
    """One way of a swap (out or back) on this run: ``fixed_s + n * s_per_byte`` seconds for
    ``n`` bytes, fitted by least squares to the measured swaps, each older one weighted down by
    ``DECAY`` per swap (Note [What a swap costs]). The fit starts from two pseudo-swaps at the
    given bandwidth and no fixed cost (64 KiB and 4 MiB), which fade the same way; a measured
    swap counts at most ``CAP`` times what the fit predicts for it (the first swaps of a run
    include cold allocations, and on a loaded host a swap can be preempted: one such swap must
    not make every swap look dear)."""

    __slots__ = ("fixed_s", "s_per_byte", "_w", "_n", "_nn", "_t", "_nt")
    DECAY = 0.95
    CAP = 4.0

    def __init__(self, bandwidth_bytes_per_s: float):
        self.fixed_s = 0.0
        self.s_per_byte = 1.0 / float(bandwidth_bytes_per_s)
        self._w = self._n = self._nn = self._t = self._nt = 0.0
        for n in (1 << 16, 1 << 22):
            self._add(n, n * self.s_per_byte, 1.0)

    def predict(self, n: int) -> float:
        return self.fixed_s + n * self.s_per_byte

    def add(self, n: int, dt: float) -> None:
        if n > 0 and dt > 0:
            self._add(n, min(dt, self.CAP * self.predict(n)), self.DECAY)

    def _add(self, n: int, dt: float, d: float) -> None:
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._nn = d * self._nn + float(n) * n
        self._t = d * self._t + dt
        self._nt = d * self._nt + n * dt
        w, sn, snn, st, snt = self._w, self._n, self._nn, self._t, self._nt
        det = w * snn - sn * sn
        if det <= 0:
            return
        b = (w * snt - sn * st) / det
        a = (st - b * sn) / w
        if a < 0:  # a line through the origin
            a, b = 0.0, snt / snn
        elif b <= 0:  # the sizes explain nothing: all of it fixed
            a, b = st / w, 0.0
        self.fixed_s, self.s_per_byte = a, b


class DynamicTracker(PassiveTracker):
    """Passive mode's counting of storages, plus what DTR needs per storage: its chain (the
    recorded producer and in-place writers), measured cost, neighbours and last access."""

    def __init__(self, budget_bytes: int | None, device: torch.device, memory=None):
        super().__init__(budget_bytes, device, memory)
        self.engine = RecomputeEngine(None, lambda n: False)
        self.engine.device_type = torch.device(device).type
        self.engine.records = weakref.WeakValueDictionary()  # alive while a chain holds them
        self.serial = 0
        self.clock = 0
        self.chain: dict[int, list[Record]] = {}  # storage key -> producer + in-place writers
        self.cost_s: dict[int, float] = {}  # storage key -> measured seconds of its chain
        self.sid: dict[int, str] = {}  # storage key -> its name in its producer's record
        self.wcount: dict[int, int] = {}  # storage key -> write counter after its chain's last op
        self.parents: dict[int, set[int]] = {}
        self.children: dict[int, set[int]] = {}
        self.node: dict[int, Node] = {}  # dropped storages' union-find nodes
        self.last_access: dict[int, int] = {}
        self.new_out: dict[int, int] = {}  # serial -> bytes of the new storages the op allocated
        # name -> (chain, write counter, seconds) of storages that died with a chain: a
        # dependent's replay regenerates them on the way (DTR keeps freed tensors as thunks)
        self.ghost: dict[str, tuple[list[Record], int, float]] = {}

    def new_iteration(self) -> None:
        super().new_iteration()
        for d in (
            self.chain,
            self.cost_s,
            self.sid,
            self.wcount,
            self.parents,
            self.children,
            self.node,
            self.new_out,
            self.ghost,
        ):
            d.clear()
        self.engine.reset()

    def _died(self, key: int):
        base = super()._died(key)

        def cb(ref, self=self, key=key, base=base):
            base(ref)
            self.last_access.pop(key, None)
            if self.children:
                self.children.pop(key, None)  # a source need not be recorded itself
            sid = self.sid.pop(key, None)
            if sid is None:
                return  # never recorded: nothing else is kept for it
            ch = self.chain.pop(key, None)
            cost = self.cost_s.pop(key, 0.0)
            n = self.wcount.pop(key, None)
            if ch is not None and n is not None:
                self.ghost[sid] = (ch, n, cost)
            self.parents.pop(key, None)
            self.node.pop(key, None)

        return cb

    def _track(self, k: int, st) -> int:
        """PassiveTracker's, and the storage's first access: without it, an output of an
        iteration that does not record would look older than every other candidate, and go
        first (it did: the transformer at 80% evicted 25 storages per step where LRU evicts 19,
        the ones just made, read again at once)."""
        n = super()._track(k, st)
        self.last_access[k] = self.clock
        return n

    def touch(self, keys) -> None:
        """Staleness is ``last_access`` (an op clock); the LRU order is not used here."""
        self.clock += 1
        clock = self.clock
        la = self.last_access
        for key in keys:
            la[key] = clock

    # ---- recording (every op while dynamic mode is on) ----------------------------------------
    def prepare(
        self, func, args: tuple, kwargs: dict, flat: list, keys: list, written: tuple, seeded: bool
    ) -> tuple:
        """Before the op runs: what a record needs then (the RNG state of a seeded op, the views
        of the arguments it writes). The record itself is made after it ran, and only if it
        allocated or extended a storage's chain (views and reads are never recorded)."""
        chain = self.chain
        try:  # the view before the op of a storage whose chain it extends (an in-place op may
            # change it: transpose_); the other arguments' slots are taken after it, if at all
            wslots = (
                {a: self._slot(flat[a]) for a in written if keys[a] in chain} if written else {}
            )
        except (RuntimeError, NotImplementedError):
            wslots = None
        rng = _capture_rng(func, args, kwargs, flat) if seeded else None
        if rng is not None:  # kept in host memory the allocator does not count (5 KiB on CPU)
            kind, where, state = rng
            rng = (
                kind,
                where,
                torch.frombuffer(bytearray(state.numpy().tobytes()), dtype=torch.uint8),
            )
        return func, args, kwargs, flat, keys, written, rng, wslots

    def _slot(self, t) -> _Slot:
        """``_Slot(t, its name in this epoch or None, pin=False)``, built with one storage lookup
        (it is made for every tensor argument of every recorded op)."""
        st = t.untyped_storage()
        tag = getattr(st, _NAME_ATTR, None)
        sid = tag[1] if tag is not None and tag[0] == self.engine.epoch else None
        return _Slot(t, sid, False, st)

    def recorded(self, pending: tuple, dt: float, outs: list, in_keys: set):
        """The op ran (``dt`` seconds): name the storages it allocated, give them (or the
        storages it wrote) their chain, cost and neighbours. Most ops of a step allocate, so
        this runs for most ops: it keeps to one pass over the outputs and reuses the argument
        keys that the op's preparation computed. Returns ``(record, keys charged dt)``, or None
        where nothing was recorded."""
        func, args, kwargs, flat, keys, written, rng, wslots = pending
        if wslots is None:
            return None
        chain = self.chain
        in_it = self.in_iteration
        fresh = []  # (output position, storage, key) of the storages the op allocated
        for j, t in enumerate(outs):
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = st._cdata
            if key not in in_keys and key in in_it and key not in chain:
                fresh.append((j, st, key))
        extended = [a for a in wslots if keys[a] in chain] if wslots else ()
        if not fresh and not extended:
            return None  # a view, a read, or a write to storages nobody replays
        slot = self._slot
        try:
            if wslots:
                slots = [wslots[a] if a in wslots else slot(t) for a, t in enumerate(flat)]
            else:
                slots = [slot(t) for t in flat]
        except (RuntimeError, NotImplementedError):
            return None
        self.serial += 1
        op = self.serial
        counter = [0]
        rec = Record(
            op,
            func,
            _template(args, counter),
            dict(kwargs) if kwargs else {},  # as recompute.py records them (its _fill)
            slots,
            written,
            [None] * len(outs),
            rng,
            torch.is_grad_enabled(),  # R8 in recompute.py
        )
        replayable = _REPLAYABLE.get(func)
        if replayable is None:
            replayable = _REPLAYABLE[func] = not (
                is_hop(func) or is_collective(func.namespace + ".")
            )
        for a in written:  # the write counts the op left (the executor bumped them)
            st = slots[a].weak()
            if st is not None:
                slots[a].writes = writes(st)
        src = [k for k in keys if k is not None]
        new_bytes = 0
        made = []
        charged = []
        epoch = self.engine.epoch
        for j, st, key in fresh:
            if key in chain or key in self.sid:
                continue  # a second output in the same storage
            sid = f"{op}:{j}"
            setattr(st, _NAME_ATTR, (epoch, sid))
            rec.out_sids[j] = sid
            new_bytes += st.nbytes()
            made.append(key)
            self.sid[key] = sid
            if replayable:
                chain[key] = [rec]
                self.cost_s[key] = dt
                self.wcount[key] = writes(st)
                charged.append(key)
        self.new_out[op] = new_bytes
        for a in extended:  # R1: an in-place write extends the written storage's chain
            key = keys[a]
            ch = chain[key]
            if replayable and len(ch) < MAX_CHAIN and ch[-1] is not rec:
                ch.append(rec)
                self.cost_s[key] += dt
                self.wcount[key] = slots[a].writes
                made.append(key)
                charged.append(key)
            elif ch[-1] is not rec:
                del chain[key]  # a write that cannot be replayed: swap only from now on
        parents, children = self.parents, self.children
        for key in made:
            ps = parents.get(key)
            if ps is None:
                ps = parents[key] = set()
            for k in src:
                if k != key:
                    ps.add(k)
                    cs = children.get(k)
                    if cs is None:
                        children[k] = {key}
                    else:
                        cs.add(key)
        return rec, charged

    def settle(self, rec, keys, dt: float) -> None:
        """Add ``dt`` seconds to the cost of ``keys`` whose chain still holds ``rec`` (its
        device time, read after the op ran: Note [Costs on the device's timeline] in
        backend.py); a storage that died since keeps the cost it had."""
        chain, cost = self.chain, self.cost_s
        for key in keys:
            ch = chain.get(key)
            if ch is not None and any(r is rec for r in ch):
                cost[key] += dt

    # ---- what a drop would take -----------------------------------------------------------------
    def replay_plan(self, key: int):
        """How to replay ``key``'s chain now: ``(records in order, live sources by key, seconds,
        bytes of regenerated dead sources)``, or None if it cannot be replayed exactly (a source
        freed without a chain, or written since it was read: R2). A source that died with a chain
        (a ghost) is regenerated on the way, recursively."""
        ch = self.chain.get(key)
        if not ch:
            return None
        recs = {}
        live = {}
        cost = self.cost_s[key]
        extra = 0
        todo = [(ch, self.sid.get(key))]
        seen_ghosts = set()
        live_sids = set()
        while todo:
            chain, own = todo.pop()
            for rec in chain:
                if not replays_exactly(rec.func, self.engine.device_type):
                    return None  # Note [Determinism precondition] in device.py
                recs[rec.op_index] = rec
            for rec in chain:
                for s in rec.slots:
                    if s.sid is not None and s.sid == own:
                        continue
                    st = s.weak()
                    if st is not None:
                        if writes(st) != s.writes:
                            return None
                        live[storage_key(st)] = st
                        if s.sid is not None:
                            live_sids.add(s.sid)
                        continue
                    g = self.ghost.get(s.sid) if s.sid is not None else None
                    if g is None or g[1] != s.writes:
                        return None
                    if s.sid not in seen_ghosts:
                        seen_ghosts.add(s.sid)
                        if len(seen_ghosts) > MAX_CHAIN:
                            return None
                        todo.append((g[0], s.sid))
                        cost += g[2]
                        extra += self.new_out.get(g[0][0].op_index, 0)
        live.pop(key, None)
        if any(x in live_sids for r in recs.values() for x in r.out_sids if x):
            # a regenerated producer would also remake a live storage that a later op changed
            # (a ghost's sibling output, written in place since): the replay would read the
            # regenerated copy, not the live one
            return None
        return [recs[k] for k in sorted(recs)], live, cost, extra

    def neighbourhood_s(self, key: int) -> float:
        """Value of the distinct dropped sets next to ``key`` (DTR's e*)."""
        node = self.node.get
        return neighbourhood(
            node(k) for k in (*self.parents.get(key, ()), *self.children.get(key, ()))
        )


class DynamicGuard(BudgetGuard):
    """The budget guard with DTR's choice of what to evict and how (module docstring).
    ``remat``: "auto" (drop or swap, whichever the measured costs make cheaper), "recompute"
    (drop whatever can be replayed exactly), "swap" (never drop: DTR's victims, swapped)."""

    def __init__(
        self,
        budget_bytes: int | None,
        device: torch.device,
        memory,
        swap,
        executor,
        bandwidth_bytes_per_s: float = 12e9,
        remat: str = "auto",
    ):
        super().__init__(budget_bytes, device, memory, swap, executor)
        if remat not in REMAT:
            raise ValueError(f"remat must be one of {', '.join(REMAT)}, not {remat!r}")
        self.tracker = DynamicTracker(budget_bytes, device, memory)
        self.remat = remat
        # the time of a swap's way out and way back, fitted to this run's swaps
        self.copy_out = _CopyTime(bandwidth_bytes_per_s)
        self.copy_in = _CopyTime(bandwidth_bytes_per_s)
        self.writing: frozenset[int] | set[int] = _NO_KEYS  # storages the op being prepared writes
        self.replay_op_s = 0.0  # measured cost of a replay beyond its ops' own times, per op
        self._replaying: list[Entry] = []  # the entries being replayed, outermost first
        self._rng = random.Random(0)  # candidate sampling; never the script's random streams
        self.recording = remat != "swap"  # Note [Recording only while replay pays]
        self.iteration = -1
        self._next_probe, self._probe_gap = PROBE_EVERY, PROBE_EVERY  # iteration; iterations
        self.drops = 0  # drops in this iteration
        self.gain_s = 0.0  # what this iteration's drops saved against swapping, estimated
        self._clock0 = 0  # the op clock at this iteration's start
        self.n_entries = 0
        # the device's timeline where the host runs ahead of it (Note [Costs on the device's
        # timeline] in backend.py): op times and replays are read from it once the device has
        # reached them, copies from their own streams
        self.dclock = getattr(getattr(swap, "backend", None), "clock", None)
        self._timed: collections.deque = collections.deque()  # (mark, mark, host s, what)

    def new_iteration(self) -> None:
        """A dropped storage can outlive its iteration (dropped while the step end made room for
        the storages it restores, or one that ``stays_out``): its replay keeps its own records
        (``extra["recs"]``), and its sources stay registered for copy-on-write (R3), which the
        executor forgets at each iteration start."""
        super().new_iteration()
        # Note [Recording only while replay pays]
        self.iteration += 1
        clock = self.tracker.clock
        paid = self.drops > 0 and self.gain_s > RECORD_OP_S * (clock - self._clock0)
        if paid:
            self._probe_gap = PROBE_EVERY
            self._next_probe = min(self._next_probe, self.iteration + PROBE_EVERY)
        probe = self.iteration >= self._next_probe
        if probe:  # the next one after twice the gap, unless an iteration pays meanwhile
            self._next_probe = self.iteration + self._probe_gap
            self._probe_gap *= 2
        self.recording = self.remat == "recompute" or (
            self.remat == "auto" and (self.iteration < 2 or paid or probe)
        )
        self.drops, self.gain_s, self._clock0 = 0, 0.0, clock
        if self._timed:
            self.settle_times()
        ex = self.ex
        for e in ex.entries.values():
            if e.reason is Reason.DYNAMIC and not e.swap and e.state is Residency.OUT:
                for st in e.extra.get("pins", ()):
                    ex.dependents.setdefault(storage_key(st), set()).add(e.sid)

    # ---- per op -----------------------------------------------------------------------------------
    def before_op(self, func, args, kwargs, name: str, flat: list, keys: list):
        tr = self.tracker
        tr.touch(keys)
        ex = self.ex
        recording = self.recording
        written = ()
        if recording or ex.dependents:
            info = op_info(func)
            if info.hop:
                info = call_info(info, func, args)
            written = tuple(written_inputs(info, args, kwargs, flat))
            if written:
                self.writing = {keys[a] for a in written if keys[a] is not None}
        entries = ex.entries
        if entries:
            if written and ex.dependents:
                deps = []
                for wk in self.writing:  # R3 with room made first (the executor's would not)
                    for sid in ex.dependents.get(wk, ()):
                        e = ex.by_sid.get(sid)
                        if e is not None and e.state is Residency.OUT and e.storage is not None:
                            deps.append(storage_key(e.storage))
                for root in self._live_roots(deps) if deps else ():
                    self.bring_back([*keys, root])  # one at a time: each frees what only it pins
                    ex.stats.cow_restores += 1
            if not entries.keys().isdisjoint(keys):
                self.bring_back(keys)
        pkey, out_bytes = self.memory.predict(func, args, kwargs)
        out_bytes += self.memory.scratch(name, flat, out_bytes)
        # the op's evicted arguments are back already (bring_back): nothing more comes back
        self.enforce(set(keys), out_bytes)
        if written:
            self.writing = _NO_KEYS
        if not recording:
            return pkey, None, 0.0, None
        pending = tr.prepare(func, args, kwargs, flat, keys, written, info.seeded)
        return pkey, pending, seconds(), self.dclock.mark() if self.dclock is not None else None

    def after_op(self, outs: list, in_keys: set, token) -> None:
        pkey, pending, t0, m0 = token
        dt = seconds() - t0 if pending is not None else 0.0
        self.tracker.track_outputs(outs, in_keys, pkey)
        if pending is not None:
            got = self.tracker.recorded(pending, dt, outs, in_keys)
            if m0 is not None and got is not None:  # the host's dt until the device's is read
                self._timed.append((m0, self.dclock.mark(), dt, ("op", *got)))
        self.enforce(in_keys, outs=outs)

    def settle_times(self) -> None:
        """Read the device times the device has reached, in order (Note [Costs on the
        device's timeline] in backend.py): an op's replaces its host time in its storages'
        costs; a replay's updates what a replay costs beyond its ops."""
        q, clock = self._timed, self.dclock
        while q:
            a, b, host_s, what = q[0]
            dt = clock.span_s(a, b)
            if dt is None:
                return  # the device has not got there yet (later marks are later still)
            q.popleft()
            if what[0] == "op":
                self.tracker.settle(what[1], what[2], dt - host_s)
            else:
                self._replay_cost(dt, what[1], what[2])

    def _replay_cost(self, dt: float, cost: float, ops: int) -> None:
        """What a replay costs beyond its ops' measured times, per op (smoothed)."""
        extra = (dt - cost) / ops
        self.replay_op_s = max(0.0, 0.8 * self.replay_op_s + 0.2 * extra)

    def stays_out(self, e: Entry) -> bool:
        """A dropped storage nothing but dynamic mode holds (the source of a dropped storage's
        replay, freed by the script) stays dropped at step end: a replay that reads it brings
        it back first, and it is freed with the last entry that pins it."""
        st = e.storage
        return (
            e.reason is Reason.DYNAMIC
            and st is not None
            and not e.swap
            and e.state is Residency.OUT
            and torch._C._storage_Use_Count(st._cdata) <= 1
        )

    def _live_roots(self, keys: list) -> list:
        """The dropped storages the script still holds that need ``keys`` (themselves, or
        through the pinned sources of their replays). Bringing those back is what copy-on-write
        needs: a dropped source only replays read is freed once they are back."""
        ex = self.ex
        pinned_by: dict[int, list[int]] = {}
        for k, e in ex.entries.items():
            if e.reason is Reason.DYNAMIC and not e.swap:
                for st in e.extra.get("pins", ()):
                    pinned_by.setdefault(storage_key(st), []).append(k)
        roots = []
        seen = set()
        stack = list(keys)
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            e = ex.entries.get(k)
            if e is not None and not self.stays_out(e):
                roots.append(k)
            else:
                stack.extend(pinned_by.get(k, ()))
        return roots

    # ---- eviction -------------------------------------------------------------------------------
    def evict(self, need: int, protect: set, sample: bool = True) -> int:
        """Evict resident storages of this iteration, lowest h first, until ``need`` bytes are
        freed. Returns the bytes freed. A sample (``sample``) that frees too little is followed
        by a pass over every candidate: the sample may miss the few storages that would do."""
        tr = self.tracker
        dev = self.device_type
        if self._timed:  # Note [Costs on the device's timeline] in backend.py
            if self.recording:
                self.dclock.wait(self._timed[-1][1])
            self.settle_times()
        swap_fixed_s = self.copy_out.fixed_s + self.copy_in.fixed_s  # Note [What a swap costs]
        swap_s_per_byte = self.copy_out.s_per_byte + self.copy_in.s_per_byte
        lru, entries, last, clock = tr.lru, self.ex.entries, tr.last_access, tr.clock
        chain = tr.chain if self.remat != "swap" else {}
        auto = self.remat == "auto"
        persistent = tr.persistent  # swap only (Note [Persistent state under the guard])
        keys = [
            k
            for k in (tr.in_iteration | persistent if persistent else tr.in_iteration)
            if k not in protect and k not in entries
        ]
        sampled = sample and len(keys) > SAMPLE
        if sampled:  # DTR's approximation: rank a random sample, not all
            keys = self._rng.sample(keys, max(SAMPLE, math.isqrt(len(keys))))
        # ranked on what the tracker knows (bytes, staleness, the chain's own cost: a lower
        # bound, regenerated dead sources add to it); the storage itself, and whether and at
        # what cost it replays, is looked at for the chosen ones only
        cands = []
        for key in keys:
            item = lru.get(key)
            if item is None or not item[1]:
                continue
            n = item[1]
            c_swap = swap_fixed_s + n * swap_s_per_byte
            cost = c_swap
            drop = key in chain and key not in persistent
            if drop:
                c_drop = (
                    tr.cost_s[key] + self.replay_op_s * len(chain[key]) + tr.neighbourhood_s(key)
                )
                if auto and c_drop >= c_swap:
                    drop = False
                else:
                    cost = c_drop
            stale = clock - last.get(key, 0)
            if stale < 1:
                stale = 1
            cands.append((score(cost, n, stale), -stale, key, item[0], n, drop, c_swap))
        cands.sort(key=_rank)  # equal h: the least recently used first
        got = 0
        for _, _, key, ref, n, drop, c_swap in cands:
            if got >= need:
                break
            st = ref()
            if (
                st is None
                or key in entries
                or st.nbytes() == 0
                or not evictable(st)
                or st.device.type != dev
            ):
                continue
            plan = self.drop_plan(key) if drop else None
            c_drop = (
                plan[2] + tr.neighbourhood_s(key) + self.replay_op_s * len(plan[0])
                if plan is not None
                else 0.0
            )
            if plan is not None and auto and c_drop >= c_swap:
                plan = None  # the dead sources it regenerates make it dearer than a swap
            if plan is not None:
                self.gain_s += c_swap - c_drop
                self._drop(key, st, n, plan)
            else:
                self._swap(key, st, n)
            got += n
        if got < need and sampled:
            got += self.evict(need - got, protect, sample=False)
        return got

    def drop_plan(self, key: int):
        """``tr.replay_plan(key)`` where dropping ``key`` now is safe, else None (it is swapped):
        none of its replay's sources is about to be written (R3 would bring it back at once),
        and none of them is a dropped storage whose own replay needs ``key`` (Note [Cycles of
        dropped storages])."""
        plan = self.tracker.replay_plan(key)
        if plan is None:
            return None
        srcs = plan[1]
        if self.writing and not self.writing.isdisjoint(srcs):
            return None
        if self._needed_by(srcs, key):
            return None
        return plan

    def _needed_by(self, keys, target: int) -> bool:
        """Whether bringing back ``keys`` replays something that reads ``target``: ``target`` is
        one of them, or a pinned source of a dropped one among them, transitively."""
        entries = self.ex.entries
        stack = list(keys)
        seen = set()
        while stack:
            k = stack.pop()
            if k == target:
                return True
            if k in seen:
                continue
            seen.add(k)
            e = entries.get(k)
            if e is not None and not e.swap and e.state is Residency.OUT:
                stack.extend(storage_key(st) for st in e.extra.get("pins", ()))
        return False

    def _entry(self, key: int, st, n: int, swap: bool, d: Decision | None) -> Entry:
        self.n_entries += 1
        ex = self.ex
        e = Entry(
            f"dtr:{self.n_entries}", weakref.ref(st, ex.died(key)), n, swap, Reason.DYNAMIC, d
        )
        if ex.rt.verify:
            e.extra["copy"] = self.swap.backend.snapshot(st)  # Note [Snapshots on the host]
        ex.adopt(key, e)
        return e

    def _drop(self, key: int, st, n: int, plan) -> None:
        tr = self.tracker
        ex = self.ex
        recs, srcs, cost, extra = plan
        for r in recs:
            tr.engine.records[r.op_index] = r
        d = Decision(
            tr.sid[key], Method.RECOMPUTE, n, 0, 0, replay_ops=tuple(r.op_index for r in recs)
        )
        e = self._entry(key, st, n, False, d)
        e.extra["pins"] = list(srcs.values())  # the replay's sources stay alive (countable)
        e.extra["recs"] = recs  # and so do the ghosts' records
        e.extra["transient"] = extra
        e.extra["cost_s"] = cost
        e.extra["own_out"] = tr.new_out.get(tr.chain[key][0].op_index, n)
        for k in srcs:
            ex.dependents.setdefault(k, set()).add(e.sid)  # R3
        resize(st, 0)
        e.state = Residency.OUT
        node = tr.node[key] = Node(cost)
        for k in (*tr.parents.get(key, ()), *tr.children.get(key, ())):
            other = tr.node.get(k)
            if other is not None:
                union(node, other)
        tr.evicted(key)
        ex.stats.passive_evictions += 1
        ex.stats.dynamic_drops += 1
        self.drops += 1

    def _swap(self, key: int, st, n: int) -> None:
        ex = self.ex
        t0 = seconds()
        e = self._entry(key, st, n, True, None)
        waited = self.swap.evict_now(e)
        ex.stats.stall_s += waited
        self.tracker.evicted(key)
        self.copy_out.add(n, self._copy_time(seconds() - t0, waited, e.out_copy))
        ex.stats.passive_evictions += 1
        ex.stats.dynamic_swaps += 1

    # ---- rematerialization ------------------------------------------------------------------------
    def bring_back(self, keys) -> None:
        """Evicted storages ``keys`` come back, each dropped one after the evicted sources of its
        replay (ancestors first), each with room made under the budget first."""
        ex = self.ex
        if ex.entries.keys().isdisjoint(keys):
            return  # nothing evicted among them
        order = []
        seen = set()
        stack = [(k, False) for k in set(keys) if k is not None]
        while stack:
            key, done = stack.pop()
            e = ex.entries.get(key)
            if e is None or e.state is not Residency.OUT:
                continue
            if done:
                order.append((key, e))
                continue
            if key in seen:
                continue
            seen.add(key)
            stack.append((key, True))
            if not e.swap:
                for st in e.extra.get("pins", ()):
                    stack.append((storage_key(st), False))
        base = {k for k in keys if k is not None}
        for i, (key, e) in enumerate(order):
            if e.state is not Residency.OUT or ex.entries.get(key) is not e:
                continue
            # what this and the later replays read stays; what came back earlier for them only
            # may go again (DTR: an ancestor is not kept once its children are back)
            protect = set(base)
            for _, later in order[i:]:
                protect.update(storage_key(st) for st in later.extra.get("pins", ()))
            protect.add(key)
            need = e.nbytes
            if not e.swap:
                need = max(need, e.extra.get("own_out", 0)) + e.extra.get("transient", 0)
            self.enforce(protect, need)
            t0, stall0 = seconds(), ex.stats.stall_s
            self.swap.last_restore = None
            ex.restore(e)
            if e.swap:
                dt = self._copy_time(
                    seconds() - t0, ex.stats.stall_s - stall0, self.swap.last_restore
                )
                self.copy_in.add(e.nbytes, dt)

    def _copy_time(self, host_s: float, waited_s: float, copy) -> float:
        """A swap's way out or back: its host time, where the host is the device; else the
        host's own part (without the wait, which drained whatever compute was queued before the
        copy) plus the copy's time on its stream (Note [Costs on the device's timeline])."""
        if self.dclock is None or copy is None:
            return host_s
        dev = self.dclock.copy_s(copy)
        return host_s if dev is None else max(0.0, host_s - waited_s) + dev

    def replayed_bytes(self, nbytes: int) -> int:
        """Resident bytes right after a replay refilled ``nbytes``: an allocator that counts
        (CUDA) has counted them already; the CPU estimate has not yet (``restored`` comes
        later), so they are added there."""
        alloc = self.memory.allocated_bytes()
        return alloc if alloc is not None else self.tracker.estimate_bytes() + nbytes

    def replay(self, e: Entry) -> None:
        """Regenerate dropped ``e`` (the executor's restore of a DYNAMIC entry)."""
        st = e.storage
        if st is None:
            return
        if e in self._replaying:  # Note [Cycles of dropped storages]
            raise RecomputeError(
                f"dynamic mode: the replay of {e.decision.storage_id} needs its own storage back "
                "first (a cycle of dropped storages); its bytes cannot be regenerated"
            )
        self._replaying.append(e)
        try:
            self._replay(e, st)
        finally:
            self._replaying.pop()

    def _replay(self, e: Entry, st) -> None:
        ex = self.ex
        pinned = [storage_key(src) for src in e.extra.get("pins", ())]
        if any(k in ex.entries for k in pinned):  # paths other than bring_back (step end):
            self.bring_back(pinned)  # ancestors first
        tr = self.tracker
        for r in e.extra.get("recs", ()):  # those of an earlier iteration too (new_iteration)
            tr.engine.records[r.op_index] = r
        tr.engine.stats = ex.stats
        tr.engine.ensure_resident = ex.ensure_resident
        t0 = seconds()
        m0 = self.dclock.mark() if self.dclock is not None else None
        protect = set(pinned) | {storage_key(st)}
        for _ in range(64):  # Note [Out of memory in the runtime] in swap.py
            try:
                tr.engine.replay(e.decision, st, e.nbytes, {})
                break
            except torch.cuda.OutOfMemoryError:
                caught_oom()  # Note [Out-of-memory errors caught inside an op] in device.py
                if ex.swap.sync_earliest() <= 0 and self.evict(e.nbytes, protect) <= 0:
                    raise
        else:
            tr.engine.replay(e.decision, st, e.nbytes, {})
        ops = e.extra.get("recs", ())
        if ops and m0 is not None:  # read on the device's timeline, later
            info = ("replay", e.extra.get("cost_s", 0.0), len(ops))
            self._timed.append((m0, self.dclock.mark(), 0.0, info))
        elif ops:
            self._replay_cost(seconds() - t0, e.extra.get("cost_s", 0.0), len(ops))
        if self.budget_bytes is not None:  # unbudgeted paths (step end) count what they cost
            self.short(self.replayed_bytes(e.nbytes) - self.budget_bytes)
        key = storage_key(st)
        node = tr.node.pop(key, None)
        if node is not None:
            node.root().value -= tr.cost_s.get(key, 0.0)
        tr.last_access[key] = tr.clock
