"""The budget guard (paper §4.2 passive mode): when the run is not following a plan and resident
bytes would exceed the budget, evict on demand and continue. Separate from the plan executor
(tracker.py), which calls it through the hooks of the ``Guard`` protocol (guards/__init__.py).

It runs where no plan applies: a run without a plan (``Runtime(budget_bytes=...)``), the rest of an
iteration that diverged from its plan, and iterations the plan does not cover. It tracks the
storages that ops allocate while it is on (``PassiveTracker``: an LRU order of last access) and
only ever evicts those (Note [Storage-level eviction] in state.py). Which of them to evict is
``BudgetGuard.choose_victims`` (least recently used); the device-specific accounting (what an op
will allocate, what is resident) is the backend's ``memory`` (runtime/memory.py).

# Note: [Passive budget on CPU]
# Memory: on CUDA the allocator's own count (``memory_allocated``) decides; on a real out-of-memory
# error (the runtime caps the process with ``set_per_process_memory_fraction``) the tracker evicts
# and retries the op. The CPU allocator keeps no count outside the profiler, so on CPU resident
# bytes are ``base_bytes`` (what was resident and untracked when tracking began: the storages
# reachable from the optimizers) plus the tracked storages. Measured against the profiler's
# allocator events this is exact at op boundaries (the examples: within 0.2 KiB); what it missed
# was *inside* an op: the op's outputs are allocated before the tracker sees them, so evicting
# after the op let the measured peak overshoot by the largest output (2 MiB of a 19.6 MiB budget
# on the transformer, an addmm; +10%). So room is made *before* each op for what it will allocate:
# the bytes of its evicted inputs that come back, plus its new outputs, predicted by running the
# op on meta tensors (shapes only, no data, no RNG) the first time a (op, argument shapes) pair
# is seen, and learned from the real outputs after each run. Scratch memory a kernel uses and
# frees before returning (a convolution's: about its output's size again) is invisible to both;
# the trace measured it (Role.SCRATCH rows) and the planner writes it into the plan
# (``Plan.op_scratch_bytes``), so under a plan it is budgeted too: exactly for an op name and input
# shapes seen in the trace, else at that op name's largest scratch per input element. Without a
# plan (``Runtime(budget_bytes=...)``) on CPU, the few ops whose kernels were measured to need
# workspace get a default (``_CPU_SCRATCH`` in memory.py, from the bundled CNN's trace: a
# convolution about its output again, its backward about its inputs, batch norm's backward its
# output); without it the CNN in passive mode alone measured 1.09x its budget.
# The storages tracked while a plan is followed (``PlanCursor.watching``) make the estimate complete
# when a diverged iteration switches to passive mode; at a first divergence in an unwatched
# iteration the tensors autograd saved so far are found through the graph and counted
# (``BudgetGuard.discover``, Note [Watched iterations] in tracker.py).
# What passive eviction cannot reach (the op's own inputs and outputs, storages neither made in
# this iteration nor the optimizers') is counted: ``short_bytes`` is the most the estimate stayed
# over the budget with nothing left to evict, reported per iteration.

# Note: [Step end within the budget]
# At the step end and the iteration end the executor brings back what was evicted (the script
# may hold tensors it reads between steps). A storage the guard swapped that the script still
# holds there (a batch, a temporary kept until the loop's next turn) comes back only while the
# resident bytes stay within the budget (``keeps_out``); the rest stay out, and come back on
# demand at their next read by an op, a raw read (runtime/rawreads.py) or the run's end, or are
# dropped with their host copy when the script lets them go. Restoring them all measured 1.33x
# the budget at every step end of a loop holding a 2 MiB temporary after its last read
# (tests/data/held_after_last_read.py), with nothing left to evict.

# Note: [Persistent state under the guard]
# Where no plan applies (iteration 0, which builds the model and the optimizer state; a run with
# a budget and no plan; a diverged iteration) the guard may evict the optimizers' storages
# (parameters, gradients, optimizer state: ``BudgetGuard.adopt_persistent`` tracks them, also
# when an earlier iteration made them), by swap only, never by drop: no op of the iteration makes
# them from scratch, so a replay could not be exact. Such a storage stays out across the step end
# and the iteration end (``BudgetGuard.keeps_out``; restoring them all at the step end measured
# 1.78x the budget in iteration 0 of the mlp with fused AdamW): any op that reads it restores it
# on demand, ``torch.save`` and the end of the run restore everything. When a plan takes over
# (iteration 1), one that the plan swaps across the iteration boundary becomes that decision's entry
# (``StorageResidency._prebind_wraps``: its prefetch and restore are the plan's); the others come
# back when first read, which only lowers the plan's curve. So at the end of iteration 0 under a
# plan with wrap-around decisions every other resident storage of the optimizers is swapped out too
# (``swap_out_persistent``): a parameter the plan swaps over the boundary is named only at its first
# access in the next iteration (``x{f}:{a}``), and left resident it started the first planned
# iteration over the plan's curve (Hugging Face ResNet-34 at batch 23: 1.13x the budget). Each comes
# back at its first read, where the plan has it resident; the cost is one swap-out and one on-demand
# swap-in of each, once. A read of such a storage through no op (``.numpy()``, ``data_ptr()``)
# between steps is not seen, as for the plan's own wrap-around decisions (docs/persistent-state.md).
"""

from __future__ import annotations

import collections
import weakref

import torch

from ...errors import RecomputeError
from ..memory import DeviceMemory, memory_for
from ..state import Entry, Reason, evictable, storage_key, storages


class PassiveTracker:
    """The storages the guard counts: an LRU order of last access, bytes resident per storage."""

    def __init__(
        self, budget_bytes: int | None, device: torch.device, memory: DeviceMemory | None = None
    ):
        self.budget_bytes = budget_bytes
        self.device_type = device.type
        self.memory = memory if memory is not None else memory_for(device)
        self.lru: collections.OrderedDict[int, tuple[weakref.ref, int]] = collections.OrderedDict()
        self.in_iteration: set[int] = set()  # keys allocated in the current iteration
        # the optimizers' storages (Note [Persistent state under the guard]): swap-only victims
        self.persistent: set[int] = set()
        self.tracked_bytes = 0  # tracked and resident
        self.base_bytes = 0
        self.active = False

    def predict(self, func, args: tuple, kwargs: dict) -> tuple[tuple | None, int]:
        """What op ``func`` will allocate for new outputs (``DeviceMemory.predict``)."""
        return self.memory.predict(func, args, kwargs)

    def start(self, base_bytes: int) -> None:
        self.active = True
        self.base_bytes = base_bytes

    def new_iteration(self) -> None:
        self.in_iteration.clear()

    def estimate_bytes(self) -> int:
        return self.base_bytes + self.tracked_bytes

    def track_outputs(self, outs: list, input_keys: set[int], key: tuple | None = None) -> int:
        """Track the storages ``outs`` allocated (not inputs, not tracked yet). Returns their bytes
        and teaches the memory model what op ``key`` (from ``predict``) allocates."""
        new = 0
        for t in outs:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if st.device.type != self.device_type:
                continue
            k = storage_key(st)
            if k in input_keys:
                continue
            if k in self.lru:
                self.lru.move_to_end(k)
                continue
            self.in_iteration.add(k)
            new += self._track(k, st)
        self.memory.learn(key, new)
        return new

    def count(self, st) -> None:
        """Count a resident storage passive mode did not see allocated (never evicted by it)."""
        k = storage_key(st)
        if k not in self.lru:
            self._track(k, st)

    def _track(self, k: int, st) -> int:
        """Start counting storage ``st`` (key ``k``) until it dies; returns its bytes."""
        n = st.nbytes()
        self.lru[k] = (weakref.ref(st, self._died(k)), n)
        self.tracked_bytes += n
        return n

    def touch(self, keys) -> None:
        lru = self.lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)

    def _died(self, key: int):
        def cb(_ref, self=self, key=key):
            item = self.lru.pop(key, None)
            self.in_iteration.discard(key)
            self.persistent.discard(key)
            if item is not None:
                self.tracked_bytes -= item[1]

        return cb

    def evicted(self, key: int) -> None:
        item = self.lru.get(key)
        if item is not None:
            self.tracked_bytes -= item[1]
            self.lru[key] = (item[0], 0)

    def restored(self, key: int, nbytes: int) -> None:
        item = self.lru.get(key)
        if item is not None:
            self.tracked_bytes += nbytes - item[1]
            self.lru[key] = (item[0], nbytes)
            self.lru.move_to_end(key)

    def victims(self, need_bytes: int, protect: set[int]):
        """Least recently used resident storages allocated in this iteration or of the
        optimizers, until ``need_bytes`` are covered. Yields (key, storage, nbytes)."""
        got = 0
        for key, (ref, n) in list(self.lru.items()):
            if got >= need_bytes:
                return
            if n == 0 or key in protect:
                continue
            if key not in self.in_iteration and key not in self.persistent:
                continue
            st = ref()
            if st is None or st.nbytes() == 0 or not evictable(st):
                continue
            got += n
            yield key, st, n


class BudgetGuard:
    """Passive budget enforcement, device-neutral: the ``Guard`` protocol (guards/__init__.py)
    with least-recently-used victims, swapped synchronously. ``DynamicGuard`` (dtr.py) keeps its
    accounting and chooses and evicts its own way. The plan executor owns the evicted storages
    (``ex.entries``: on-demand restores, step-end restores)."""

    def __init__(
        self, budget_bytes: int | None, device: torch.device, memory: DeviceMemory, swap, executor
    ):
        self.tracker = PassiveTracker(budget_bytes, device, memory)
        self.memory = memory
        self.device_type = device.type
        self.swap = swap
        self.ex = executor

    @property
    def active(self) -> bool:
        return self.tracker.active

    @property
    def budget_bytes(self) -> int | None:
        return self.tracker.budget_bytes

    # ---- lifecycle -------------------------------------------------------------------------------
    def new_iteration(self) -> None:
        self.tracker.new_iteration()
        self.adopt_persistent()

    def start(self) -> None:
        self.tracker.start(self._base_bytes())
        self.adopt_persistent()

    def adopt_persistent(self) -> None:
        """Track the optimizers' storages as swap-only victims (Note [Persistent state under the
        guard]); the bytes of those newly tracked leave ``base_bytes`` (CPU accounting)."""
        tr = self.tracker
        if not tr.active:
            return
        for key, st in self._optimizer_storages():
            if key not in tr.lru:
                n = st.nbytes()
                tr.count(st)
                tr.base_bytes -= n
            tr.persistent.add(key)

    def swap_out_persistent(self) -> None:
        """Swap out every resident storage of the optimizers (Note [Persistent state under the
        guard]: the end of iteration 0 under a plan with wrap-around decisions)."""
        if not self.tracker.active:
            return
        self.adopt_persistent()
        ex = self.ex
        for key, st in list(self._optimizer_storages()):
            if key in ex.entries or st.nbytes() == 0 or not st.resizable():
                continue
            e = Entry(
                f"passive:{key}", weakref.ref(st, ex.died(key)), st.nbytes(), True, Reason.PASSIVE
            )
            ex.adopt(key, e)
            ex.stats.stall_s += self.swap.evict_now(e)
            self.tracker.evicted(key)
            ex.stats.passive_evictions += 1

    def keeps_out(self, e: Entry) -> bool:
        """Whether the step end and the iteration end leave evicted ``e`` out: a storage of the
        optimizers the guard swapped (Note [Persistent state under the guard]), or another the
        guard swapped that does not fit back in the budget now (Note [Step end within the
        budget])."""
        st = e.storage
        if not e.swap or e.reason is Reason.PLANNED or st is None:
            return False
        if storage_key(st) in self.tracker.persistent:
            return True
        return (
            self.active
            and self.budget_bytes is not None
            and self.resident_bytes() + e.nbytes > self.budget_bytes
        )

    def stop(self) -> None:
        self.tracker.active = False

    # ---- per op ----------------------------------------------------------------------------------
    def before_op(self, func, args, kwargs, name: str, flat: list, keys: list):
        """Make room for what the op will allocate: its new outputs, its scratch, and its evicted
        inputs that come back on demand. Returns a token for ``after_op``."""
        self.tracker.touch(keys)
        pkey, out_bytes = self.memory.predict(func, args, kwargs)
        back = self.ex.coming_back(keys)  # restored after this, on demand: 0 bytes until then
        out_bytes += self.memory.scratch(name, flat, out_bytes, back)
        self.enforce(set(keys), out_bytes + back)
        return pkey

    def watch(self, outs: list, in_keys: set, token) -> None:
        self.tracker.track_outputs(outs, in_keys, token)

    def after_op(self, outs: list, in_keys: set, token) -> None:
        self.tracker.track_outputs(outs, in_keys, token)
        self.enforce(in_keys, outs=outs)

    def evicted(self, key: int) -> None:
        self.tracker.evicted(key)

    def restored(self, key: int, nbytes: int) -> None:
        self.tracker.restored(key, nbytes)

    def check_all_resident(self) -> None:
        if self.active and self.budget_bytes is not None:
            self.short(self.resident_bytes() - self.budget_bytes)

    def stays_out(self, e: Entry) -> bool:
        """Whether evicted ``e`` may stay evicted at the step end (dynamic mode: a dropped
        storage only its own replays read); the LRU guard restores everything."""
        return False

    def replay(self, e: Entry) -> None:
        """The LRU guard drops nothing, so no entry of its own is ever replayed."""
        raise RecomputeError(f"{e.sid}: the LRU guard swapped it; it has no replay")

    def on_oom(self, keys: set, need: int = 1) -> bool:
        """A real out-of-memory error: evict at least ``need`` bytes (not one victim per error:
        each error costs the allocator a full cache flush), outside ``keys``, in any iteration
        while a budget is guarded (Note [Out of memory in the runtime] in swap.py). True if it
        freed anything."""
        if self.budget_bytes is None:
            return False
        return self.evict(max(1, need), keys) > 0

    # ---- accounting ------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Device bytes in use: the allocator's count (CUDA), else the guard's estimate."""
        alloc = self.memory.allocated_bytes()
        return alloc if alloc is not None else self.tracker.estimate_bytes()

    def short(self, over: int) -> None:
        """Record that the budget was exceeded by ``over`` bytes with nothing left to evict."""
        stats = self.ex.stats
        if over > stats.passive_short_bytes:
            stats.passive_short_bytes = over

    def discover(self, flat: list) -> None:
        """Count (never evict) what an unwatched iteration left resident before a divergence
        (Note [Watched iterations] in tracker.py); nothing on a device whose allocator counts."""
        found = self.memory.discover(flat)
        if not found:
            return
        persistent = {key for key, _ in self._optimizer_storages()}
        for key, st in storages(found):
            if st.device.type == self.device_type and key not in persistent:
                self.tracker.count(st)

    def _optimizer_storages(self):
        """The storages of the optimizers' tensors (parameters, gradients, state) on the managed
        device, each once."""
        ts = []
        for opt in list(self.ex.ix.optimizers):
            for g in opt.param_groups:
                for p in g["params"]:
                    ts.append(p)
                    if p.grad is not None:
                        ts.append(p.grad)
            for st in opt.state.values():
                ts.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        for key, st in storages(ts):
            if st.device.type == self.device_type:
                yield key, st

    def _base_bytes(self) -> int:
        """Resident bytes passive mode cannot see on CPU: the optimizers' tensors (parameters,
        gradients, state) that it does not track. CUDA uses the allocator's count instead."""
        return sum(
            st.nbytes() for key, st in self._optimizer_storages() if key not in self.tracker.lru
        )

    # ---- eviction --------------------------------------------------------------------------------
    def enforce(self, protect: set, extra_bytes: int = 0, outs: list | None = None) -> None:
        """Evict until resident bytes plus ``extra_bytes`` (what the next op allocates) fit the
        budget, never a storage in ``protect`` or behind ``outs`` (an op's outputs: their keys
        are taken only when something is evicted, which most ops do not need); what cannot be
        evicted is counted as ``passive_short_bytes``."""
        budget = self.budget_bytes
        if budget is None:
            return
        over = self.resident_bytes() + extra_bytes - budget
        if over <= 0:
            return
        while over > 0 and self.swap.pending_out:
            over -= self.swap.sync_earliest()
        if over > 0:
            if outs:
                protect = protect | {k for k, _ in storages(outs)}
            self.short(over - self.evict(over, protect))

    def choose_victims(self, need: int, protect: set):
        """Which tracked storages to evict for ``need`` bytes: least recently used first. Yields
        (key, storage, nbytes)."""
        return self.tracker.victims(need, protect)

    def evict(self, need: int, protect: set) -> int:
        """Swap out victims synchronously (paper §4.2); returns the bytes freed."""
        got = 0
        ex = self.ex
        for key, st, n in list(self.choose_victims(need, protect)):
            if key in ex.entries:
                continue
            e = Entry(f"passive:{key}", weakref.ref(st, ex.died(key)), n, True, Reason.PASSIVE)
            ex.adopt(key, e)
            ex.stats.stall_s += self.swap.evict_now(e)
            self.tracker.evicted(key)
            ex.stats.passive_evictions += 1
            got += n
        return got
