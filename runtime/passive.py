"""Passive mode (paper §4.2): when the run is not following a plan and resident bytes would exceed
the budget, evict on demand (swap, least recently used first) and continue.

It runs where no plan applies: a run without a plan (``Runtime(budget_bytes=...)``), the rest of an
iteration that diverged from its plan, and iterations the plan does not cover. It tracks the
storages that ops allocate while it is on (an LRU order of last access) and only ever evicts those
(Note [Storage-level eviction] in state.py).

Memory: on CUDA the allocator's own count (``memory_allocated``) decides; on a real out-of-memory
error (the runtime caps the process with ``set_per_process_memory_fraction``) the tracker evicts and
retries the op. The CPU allocator keeps no count outside the profiler, so on CPU the estimate is
``base_bytes`` (what was resident when tracking began: the storages reachable from the
optimizers, or the plan's prediction at the divergence point) plus the tracked storages.
"""

from __future__ import annotations

import collections
import weakref

import torch

from .state import storage_key


class PassiveTracker:
    def __init__(self, budget_bytes: int, device: torch.device):
        self.budget_bytes = budget_bytes
        self.device_type = device.type
        self.lru: collections.OrderedDict[int, tuple[weakref.ref, int]] = collections.OrderedDict()
        self.in_iteration: set[int] = set()  # keys allocated in the current iteration
        self.tracked_bytes = 0  # tracked and resident
        self.base_bytes = 0
        self.active = False

    def start(self, base_bytes: int) -> None:
        self.active = True
        self.base_bytes = base_bytes

    def new_iteration(self) -> None:
        self.in_iteration.clear()

    def estimate_bytes(self) -> int:
        return self.base_bytes + self.tracked_bytes

    def track_outputs(self, outs: list, input_keys: set[int]) -> None:
        for t in outs:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if st.device.type != self.device_type:
                continue
            key = storage_key(st)
            if key in input_keys:
                continue
            if key in self.lru:
                self.lru.move_to_end(key)
                continue
            n = st.nbytes()
            self.lru[key] = (weakref.ref(st, self._died(key)), n)
            self.in_iteration.add(key)
            self.tracked_bytes += n

    def touch(self, keys) -> None:
        lru = self.lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)

    def _died(self, key: int):
        def cb(_ref, self=self, key=key):
            item = self.lru.pop(key, None)
            self.in_iteration.discard(key)
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
        """Least recently used resident storages allocated in this iteration, until ``need_bytes``
        are covered. Yields (key, storage, nbytes)."""
        got = 0
        for key, (ref, n) in list(self.lru.items()):
            if got >= need_bytes:
                return
            if n == 0 or key in protect or key not in self.in_iteration:
                continue
            st = ref()
            if st is None or st.nbytes() == 0 or not st.resizable():
                continue
            got += n
            yield key, st, n
