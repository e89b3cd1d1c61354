"""Swap engine: swap-out after the evicted-access, prefetch at the in-trigger, restore at the
back-access, with late-prefetch feedback (paper §4.4, §5.3). Device specifics: runtime/backend.py.

# Note: [Decoupled swap-out]
# A swap-out only *starts* after its evicted-access: the copy runs on the device->host channel while
# compute goes on, and the device memory is released when the copy is done (CPU: polled by the
# tracker between ops; CUDA: at once, ``record_stream`` keeps the block from reuse until the copy
# has read it). Compute synchronizes with a swap-out only when memory runs short, and then only
# with the earliest unfinished one (``sync_earliest``, paper §5.3 "delayed synchronization").
# The plan's memory curve assumes each copy takes ``bytes / bandwidth``; on a loaded CPU host the
# copy thread can fall far behind and hold memory the plan counted as free. So a swap-out that is
# ``OVERDUE_FACTOR`` times over its planned duration (plus ``OVERDUE_SLACK_S``) is treated as memory
# running short: compute waits for it (``sync_overdue``; the wait is a counted stall). And at the
# op where the plan's simulation has a swap-out complete (``Decision.out_done_op``), compute
# waits for it if it is still running (``finish_out``): the memory curve the plan was judged by
# is then an upper bound of the run's, whatever the copy thread's speed.

# Note: [Late prefetch feedback]
# A prefetch still in flight at its back-access was late: the consuming op waits for it (a stall,
# never a wrong result) and the in-trigger moves earlier for the next iteration by 5% of the
# tensor's swap time (paper §4.4), measured on this iteration's op timeline. Moving it earlier
# keeps the storage resident over more ops, so the move is checked against the budget first:
# the plan's simulated peak per op (``Plan.op_peak_bytes``) plus the bytes earlier moves added
# must leave room for the storage at every op it now spans; the trigger moves only as far as
# that holds, or not at all (``trigger_moves_refused``). Unchecked, a steady iteration of a plan
# at its smallest feasible budget measured 1.10x its budget (0.994x with the feedback off).

# Note: [Lateness on the device's timeline]
# A prefetch is late when the consuming op would have run before its copy was complete *on the
# device*. The host cannot tell at dispatch: on CUDA it runs ahead of the GPU, so at the
# back-access the copy's event is usually not complete yet even when the copy will end long
# before the compute stream gets there; judged there, nearly every prefetch counted late and
# moved its trigger. So the back-access asks the backend for a judgement to read later
# (``judge_late``: CUDA records a timing event on the compute stream and compares it with the
# copy's completion event; the CPU "device" is the host, so its judgement is made at once), and
# the iteration's late prefetches are counted and fed back at its end (``judged_late``).

# Note: [Out of memory in the runtime]
# The runtime allocates too: a prefetch or an on-demand restore takes the storage's device memory
# again, a replay allocates its ops' outputs. On CUDA any of them can meet the allocator's cap
# (reserved memory, fragmentation, a swap-out whose block is not reusable yet) even where the
# plan's tensor bytes fit. None may kill the run: a prefetch that does not fit is skipped (the
# back-access restores on demand, a stall, never a wrong result); a restore or a replay first
# waits for the earliest swap-out, then has the budget guard evict what it needs
# (``make_room``), else gives back prefetched storages not read yet (``unprefetch``: their host
# copies are intact), and retries; only when nothing is left to free does the error reach the
# script. The script's own ops get the same retry (tracker.py ``_run``).
"""

from __future__ import annotations

import collections
import time

import torch

from .backend import DeviceBackend
from .device import caught_oom
from .state import Entry, Residency, resize

OVERDUE_FACTOR = 1.5
OVERDUE_SLACK_S = 0.0005


class SwapEngine:
    """Carries out swap actions on ``Entry`` objects; counts bytes, stalls and late prefetches in
    ``stats`` (an object with ``swapped_out_bytes``, ``swapped_in_bytes``, ``stall_s``,
    ``late_prefetches`` attributes, replaced each iteration by the runtime)."""

    def __init__(self, backend: DeviceBackend, bandwidth_d2h_bytes_per_s: float = 12e9):
        self.backend = backend
        self.bandwidth_d2h = bandwidth_d2h_bytes_per_s
        self.pending_out: collections.deque[Entry] = collections.deque()
        self.stats = None
        # (bytes, storage) -> bytes freed: the budget guard's eviction for a restore that does
        # not fit (set by the executor; Note [Out of memory in the runtime])
        self.make_room = None
        self.prefetched: set[Entry] = set()  # SWAPPING_IN, for ``unprefetch``
        # planned back-accesses that found their prefetch in flight: (decision, bytes, judge)
        self.judging: list = []
        self.last_restore: object | None = None  # the copy of the last on-demand restore
        self.lift_cap = None  # the runtime's, where it may lift its cap (engine.py)

    # ---- out ------------------------------------------------------------------------------------
    def evict(self, e: Entry) -> None:
        """Start the swap-out of a resident storage (memory freed when the copy is done)."""
        st = e.storage
        if st is None:
            return
        if e.buf is None:
            e.buf = self.backend.host_buffer(e.nbytes)
        e.out_copy = self.backend.copy_out(st, e.buf)
        e.state = Residency.SWAPPING_OUT
        e.extra["out_start_s"] = time.perf_counter()
        self.stats.swapped_out_bytes += e.nbytes
        if self.backend.free_after_copy_out(st, e.out_copy):
            e.state = Residency.OUT
        else:
            self.pending_out.append(e)

    def evict_now(self, e: Entry) -> float:
        """Synchronous swap-out (passive mode, paper §4.2): copy, wait, free. Returns the wait."""
        st = e.storage
        if e.buf is None:
            e.buf = self.backend.host_buffer(e.nbytes)
        e.out_copy = self.backend.copy_out(st, e.buf, now=True)
        self.stats.swapped_out_bytes += e.nbytes
        waited = e.out_copy.wait()
        self.backend.free_after_copy_out(st, e.out_copy)
        e.state = Residency.OUT
        return waited

    def poll(self) -> int:
        """Release the memory of finished swap-outs, in issue order. Returns bytes freed."""
        freed = 0
        q = self.pending_out
        while q:
            e = q[0]
            if e.state is not Residency.SWAPPING_OUT:  # cancelled meanwhile
                q.popleft()
                continue
            st = e.storage
            if st is None:
                q.popleft()
                continue
            if not self.backend.free_after_copy_out(st, e.out_copy):
                break
            q.popleft()
            e.state = Residency.OUT
            freed += e.nbytes
        return freed

    def sync_overdue(self) -> int:
        """Wait for pending swap-outs far behind their planned duration (Note [Decoupled
        swap-out]). Returns bytes freed."""
        freed = 0
        now = time.perf_counter()
        while self.pending_out:
            e = self.pending_out[0]
            if e.state is not Residency.SWAPPING_OUT or e.storage is None:
                self.pending_out.popleft()
                continue
            due = (
                e.extra.get("out_start_s", now)
                + OVERDUE_SLACK_S
                + OVERDUE_FACTOR * e.nbytes / self.bandwidth_d2h
            )
            if now < due:
                break
            freed += self.sync_earliest()
        return freed

    def finish_out(self, e: Entry) -> int:
        """The plan has ``e``'s swap-out complete by now: wait for it (a stall) and free what is
        done, in issue order. Returns bytes freed."""
        if e.out_copy is not None:
            self.stats.stall_s += e.out_copy.wait()
        return self.poll()

    def sync_earliest(self) -> int:
        """Memory is short: wait for the earliest unfinished swap-out and free it. Returns bytes
        freed (0 if none was pending)."""
        while self.pending_out:
            e = self.pending_out[0]
            if e.state is Residency.SWAPPING_OUT and e.storage is not None:
                self.stats.stall_s += e.out_copy.wait()
                return self.poll()
            self.pending_out.popleft()
        return 0

    # ---- in -------------------------------------------------------------------------------------
    def prefetch(self, e: Entry) -> None:
        """In-trigger: take the device memory again and start the host->device copy."""
        if e.state is not Residency.OUT:
            return  # still swapping out (its data is intact: restore cancels it) or already in
        st = e.storage
        if st is None:
            return
        try:
            resize(st, e.nbytes)
        except torch.cuda.OutOfMemoryError:  # Note [Out of memory in the runtime]: skip it
            caught_oom()
            return
        e.in_copy = self.backend.copy_in(e.buf, st, after=e.out_copy)
        e.in_start_s = time.perf_counter()
        e.state = Residency.SWAPPING_IN
        self.prefetched.add(e)
        self.stats.swapped_in_bytes += e.nbytes

    def restore(self, e: Entry, planned_back_access: bool) -> None:
        """Make ``e``'s storage resident before an op reads it. A planned back-access that finds
        its prefetch in flight is judged late or not at the iteration's end (``judged_late``)."""
        st = e.storage
        if e.state is Residency.SWAPPING_OUT:
            # never freed: the device bytes are intact; wait only so the host buffer is reusable
            self.stats.stall_s += e.out_copy.wait()
        elif e.state is Residency.OUT:
            if st is not None:  # on demand: nothing was prefetched
                self._alloc(st, e.nbytes)
                e.in_copy = self.backend.copy_in(e.buf, st, after=e.out_copy, now=True)
                self.last_restore = e.in_copy  # its time on the device (dynamic mode's costs)
                self.stats.swapped_in_bytes += e.nbytes
                self.stats.stall_s += e.in_copy.wait()
                self.backend.wait_compute(e.in_copy)
        elif e.state is Residency.SWAPPING_IN:
            if planned_back_access:  # Note [Lateness on the device's timeline]
                self.judging.append((e.decision, e.nbytes, self.backend.judge_late(e.in_copy)))
            self.stats.stall_s += self.backend.wait_compute(e.in_copy)
        e.state = Residency.RESIDENT
        self.prefetched.discard(e)
        self._release(e)

    def unprefetch(self, need: int, protect: set) -> int:
        """Give back the device memory of prefetched storages not read yet (their host copies
        are intact): each comes back on demand at its back-access. Returns the bytes freed,
        stopping once ``need`` are (Note [Out of memory in the runtime])."""
        from .state import storage_key

        freed = 0
        for e in list(self.prefetched):
            if freed >= need:
                break
            st = e.storage
            if e.state is not Residency.SWAPPING_IN or st is None or storage_key(st) in protect:
                continue
            e.in_copy.wait()  # the copy writes the block: it must end before the block goes
            resize(st, 0)
            e.in_copy = None
            e.state = Residency.OUT
            self.prefetched.discard(e)
            freed += e.nbytes
        return freed

    def judged_late(self) -> list:
        """The prefetches of this iteration that were late on the device's timeline, counted in
        ``late_prefetches``: ``(decision, bytes)`` each (Note [Lateness on the device's
        timeline]). Called once the iteration's work is queued (its end)."""
        late = [(d, n) for d, n, judge in self.judging if judge()]
        self.judging.clear()
        if self.stats is not None:
            self.stats.late_prefetches += len(late)
        return late

    def _alloc(self, st, nbytes: int) -> None:
        """Take ``st``'s device memory again; on an out-of-memory error wait for the earliest
        swap-out or have ``make_room`` evict, and retry (Note [Out of memory in the runtime])."""
        for _ in range(64):
            try:
                resize(st, nbytes)
                return
            except torch.cuda.OutOfMemoryError:
                caught_oom()  # Note [Out-of-memory errors caught inside an op] in device.py
                if self.sync_earliest() > 0:
                    continue
                if self.make_room is None or self.make_room(nbytes, st) <= 0:
                    if self.lift_cap is None or not self.lift_cap(nbytes):
                        raise  # Note [Lifting the cap] in engine.py
        resize(st, nbytes)

    def discard(self, e: Entry) -> None:
        """The storage died while evicted: return its host buffer."""
        self.prefetched.discard(e)
        if e.out_copy is not None and not e.out_copy.done():
            e.out_copy.wait()
        if e.in_copy is not None and not e.in_copy.done():
            e.in_copy.wait()
        self._release(e)
        e.state = Residency.RESIDENT

    def _release(self, e: Entry) -> None:
        if e.buf is not None:
            if e.in_copy is None and e.out_copy is not None:
                e.out_copy.wait()  # the buffer may still be written by the swap-out
            self.backend.release(e.buf)
            e.buf = None
        e.out_copy = e.in_copy = None
