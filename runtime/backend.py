"""Device backends for swapping: the only place that knows about streams, events and host memory.

The runtime logic (runtime/swap.py) talks to one small interface, ``DeviceBackend``:

- ``host_buffer(nbytes)`` / ``release(buf)``: a host buffer from a pool reused across iterations;
- ``copy_out(storage, buf)`` / ``copy_in(buf, storage)``: asynchronous copies, one FIFO channel per
  direction (paper §5.4: two streams; transfers in one direction serialize), returning a ``Copy``;
- ``Copy.done()`` (poll), ``Copy.wait()`` (block the host), ``wait_compute(copy)`` (make the
  compute stream wait for the copy before the consuming op);
- ``free_after_copy_out(storage, copy)``: release the device memory of a storage whose swap-out is
  in flight, without letting the allocator reuse memory the copy still reads;
- ``allocated_bytes()``: the allocator's own count of device bytes, or None where it has none;
- ``memory``: the device's memory accounting for the budget guard (runtime/memory.py: output and
  scratch prediction, resident bytes, what to discover at a divergence).

Two implementations: ``CPUBackend`` (a copy thread per direction; host buffers are numpy arrays,
allocated outside PyTorch's allocator so that its accounting counts only "device"-resident bytes) and
``CUDABackend`` (a copy stream per direction, events, a pinned host buffer pool, ``record_stream``).
The CUDA one cannot run on the machines this project is developed on; ``gpu``-marked tests cover it.
"""

from __future__ import annotations

import _thread
import collections
import queue
import threading
import time
from typing import Protocol

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes


def byte_view(storage: torch.UntypedStorage, nbytes: int | None = None) -> torch.Tensor:
    """A 1-d uint8 tensor over ``storage`` (no copy). Built with Python dispatch disabled so that a
    runtime-internal op is never seen by the tracker (see Note [Runtime-internal ops])."""
    n = storage.nbytes() if nbytes is None else nbytes
    with _no_python_dispatch():
        t = torch.empty(0, dtype=torch.uint8, device=storage.device)
        return t.set_(storage, 0, (n,), (1,))


# Note [Runtime-internal ops] (state.py) on plain storages: ``_DisableTorchDispatch`` excludes the
# Python dispatch keys (every dispatch mode, and tensor subclasses, which a byte view of a
# storage never is) for 0.7 µs where ``_disable_current_modes`` pops and re-pushes the mode
# stack for 7.6 µs (measured under load 2-4). Replays of the script's own ops, whose arguments
# may be subclasses, keep ``_disable_current_modes``.
_no_python_dispatch = torch._C._DisableTorchDispatch


class Copy(Protocol):
    """One asynchronous copy in flight."""

    nbytes: int

    def done(self) -> bool: ...

    def wait(self) -> float:
        """Block the host until the copy is complete; returns the seconds spent waiting."""
        ...


# Note: [Costs on the device's timeline]
# Where the host runs ahead of the device (CUDA), host time around an op is its launch, not its
# work, and a host wait for a copy drains every op queued before it: dynamic mode, which ranks
# victims by what their replay or their swap costs, saw drops as nearly free and swaps as dear.
# So such a backend has a ``clock``: ``mark()`` is a point on the compute stream (a timing
# event), ``span_s(a, b)`` the device seconds between two marks once both are reached (None
# before), and ``copy_s(copy)`` the seconds a copy took on its own stream, from its start there
# to its end (None while it runs). The CPU backend has none: its "device" is the host, and host
# time is what its ops and copies cost. Dynamic mode reads op times and replays when the device
# has reached them, and before it ranks victims while it records, it waits for the device to
# reach the op being dispatched (``wait``): the costs it ranks by are then device times, for one
# device synchronization per eviction while it records (a swap-out waits for the device
# anyway). A swap's way out or back costs the host's own part (its time without the wait, which
# drained whatever compute was queued before the copy) plus the copy's time on its stream.
class DeviceClock(Protocol):
    def mark(self): ...

    def wait(self, mark) -> None:
        """Block the host until the device has reached ``mark``."""
        ...

    def span_s(self, a, b) -> float | None: ...

    def copy_s(self, copy: Copy) -> float | None: ...


class DeviceBackend(Protocol):
    device: torch.device

    def host_buffer(self, nbytes: int) -> torch.Tensor: ...

    def release(self, buf: torch.Tensor) -> None: ...

    def copy_out(self, storage: torch.UntypedStorage, buf: torch.Tensor, now: bool = False) -> Copy:
        """Start device->host; ``now``: the caller waits for it at once (it may run inline)."""
        ...

    def copy_in(
        self,
        buf: torch.Tensor,
        storage: torch.UntypedStorage,
        after: Copy | None = None,
        now: bool = False,
    ) -> Copy:
        """Start host->device; ``after``: a swap-out of the same data that must finish first;
        ``now``: the caller waits for it at once (it may run inline)."""
        ...

    def wait_compute(self, copy: Copy) -> float: ...

    def judge_late(self, copy: Copy):
        """At a back-access that found ``copy`` (a prefetch) in flight: a callable, read at the
        iteration's end, that says whether the copy completed after the consuming op could have
        started on the device (Note [Lateness on the device's timeline] in swap.py)."""
        ...

    def free_after_copy_out(self, storage: torch.UntypedStorage, copy: Copy) -> bool: ...

    # ``clock``: the device's timeline (``DeviceClock``), or None where the host is the device
    # (CPU: host time is device time). Note [Costs on the device's timeline].
    clock: DeviceClock | None

    def allocated_bytes(self) -> int | None: ...

    def snapshot(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """A copy of ``storage``'s bytes in host memory that the device's allocator does not
        count (Note [Snapshots on the host]); synchronous."""
        ...

    def close(self) -> None: ...


# Note: [Snapshots on the host]
# ``CAPUCHIN_VERIFY=1`` keeps a copy of every evicted storage to compare it with what comes back,
# and compares through a second copy. Both live in host memory the device's allocator never
# counts: on CUDA a device copy counts against the allocator cap set for the budget and turns
# the check itself into out-of-memory errors; on CPU a copy through PyTorch's allocator is what
# the runtime measures as the device's peak (numpy memory, as the host buffer pool, is not).


def _host_copy(storage: torch.UntypedStorage) -> torch.Tensor:
    """``storage``'s bytes in numpy memory (PyTorch's CPU allocator does not count it)."""
    n = storage.nbytes()
    out = torch.from_numpy(np.empty(n, dtype=np.uint8))
    with _no_python_dispatch():
        out.copy_(byte_view(storage, n))
    return out


# ---- host buffer pool ----------------------------------------------------------------------------


def pinned_size(nbytes: int) -> int:
    """The block PyTorch's pinned host allocator hands out for ``nbytes``: the next power of two
    (Note [Pinned buffers are powers of two])."""
    return 1 << max(0, int(nbytes) - 1).bit_length()


# Note: [Pinned buffers are powers of two]
# PyTorch's CachingHostAllocator rounds every pinned block up to a power of two (its
# ``pinned_max_round_threshold`` is unlimited by default), so a pinned buffer of n bytes holds up
# to 2n of page-locked host memory. With exact-size free lists the pool kept a buffer per
# distinct size, each rounded, none reusable for another size of its class, and
# ``host_pool_bytes`` reported the unrounded sum. So the CUDA pool asks for the
# rounded size itself and keeps one free list per power of two: a buffer serves every request of
# its class (copies use its first n bytes), and ``host_pool_bytes`` is what is pinned. The rounding
# itself stays (pinning exact sizes would need ``cudaHostRegister`` on pageable memory, which
# has not run here).


class _HostPool:
    """Free lists by size class (``size``: exact on CPU; powers of two for pinned memory, Note
    [Pinned buffers are powers of two]): an iteration repeats the same sizes, so buffers are
    reused as is; a buffer may be larger than asked (copies use its first bytes)."""

    def __init__(self, make, size=int):
        self._make = make
        self._size = size
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self.allocated_bytes = 0  # host bytes ever allocated by the pool
        self.lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        n = self._size(nbytes)
        with self.lock:
            free = self._free.get(n)
            if free:
                return free.pop()
            self.allocated_bytes += n
        return self._make(n)

    def put(self, buf: torch.Tensor) -> None:
        with self.lock:
            self._free[buf.numel()].append(buf)


# ---- CPU ---------------------------------------------------------------------------------------


class _ThreadCopy:
    """A copy queued on a copy thread: a plain lock, held until the copy is done (a
    ``threading.Event`` is a Python-level condition variable: several µs more on both threads,
    and the copy thread must hold the interpreter lock longer to set it)."""

    __slots__ = ("nbytes", "_lock", "error")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return not self._lock.locked()

    def wait(self) -> float:
        t0 = 0.0
        if self._lock.locked():
            t0 = time.perf_counter()
            self._lock.acquire()
            self._lock.release()
        if self.error is not None:
            raise self.error
        return time.perf_counter() - t0 if t0 else 0.0


class _DoneCopy:
    """A copy that ran on the calling thread (``INLINE_COPY_MAX_BYTES``): complete already."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def done(self) -> bool:
        return True

    def wait(self) -> float:
        return 0.0


class _CopyChannel:
    """One direction: a daemon thread that runs queued copies in order (a 'stream')."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, after: _ThreadCopy | None = None
    ) -> _ThreadCopy:
        c = _ThreadCopy(nbytes)
        self._q.put((dst, src, c, after))
        return c

    def _run(self) -> None:
        # No dispatch mode is active on this thread (modes are thread-local), so these copies are
        # never seen by the tracker; Tensor.copy_ releases the GIL while it copies.
        while True:
            job = self._q.get()
            if job is None:
                return
            dst, src, c, after = job
            try:
                if after is not None:
                    after.wait()  # the other channel must have written the host buffer
                with torch.no_grad():
                    dst.copy_(src)
            except BaseException as exc:  # surfaced by Copy.wait
                c.error = exc
            del dst, src, job, after
            c._lock.release()

    def close(self) -> None:
        self._q.put(None)


# Note: [Inline copies on CPU]
# A CPU "device" has no copy engine: a copy thread only moves the copy to another core, and
# handing it over costs more than a small copy. Measured (benchmarks/runtime.py "swap cycle", a
# 64 KiB storage out and back): 101 µs per direction through the copy threads on a quiet host;
# the interpreter lock and the thread wake-ups (queue put, event set, event wait), not the
# copy, which takes a few µs. So a swap-out of at most ``INLINE_COPY_MAX_BYTES`` copies on the
# calling thread at once (its memory is freed at once: never later than the plan's curve has
# it), and a restore that waits anyway (on demand, synchronous eviction) copies in place.
# Prefetches stay asynchronous whatever their size: the in-trigger starts the copy, the
# back-access waits for it (a late prefetch is measured and fed back, Note [Late prefetch
# feedback] in swap.py). Larger swap-outs stay on the copy thread, where another core can take
# them.
INLINE_COPY_MAX_BYTES = 1 << 20


def _host(buf: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bytes of a host buffer (pool buffers are exact-size: usually itself)."""
    if buf.numel() == n:
        return buf
    with _no_python_dispatch():
        return buf[:n]


class CPUBackend:
    """'Device' = CPU memory counted by PyTorch's allocator; 'host' = numpy memory it never sees.

    Copies run on two threads (device->host, host->device). The device memory of a swapped-out
    storage is released by the main thread once its copy is done (``free_after_copy_out`` returns
    False until then): the CPU allocator's profiler accounting is thread-local, so a free on the
    copy thread would never be subtracted from the measured peak.
    """

    clock = None  # the host is the device (Note [Costs on the device's timeline])

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._pool = _HostPool(lambda n: torch.from_numpy(np.empty(n, dtype=np.uint8)))
        self._d2h = _CopyChannel("capuchin-d2h")
        self._h2d = _CopyChannel("capuchin-h2d")

    @property
    def host_pool_bytes(self) -> int:
        return self._pool.allocated_bytes

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return self._pool.get(nbytes)

    def release(self, buf: torch.Tensor) -> None:
        self._pool.put(buf)

    def copy_out(self, storage: torch.UntypedStorage, buf: torch.Tensor, now: bool = False) -> Copy:
        n = storage.nbytes()
        if now or n <= INLINE_COPY_MAX_BYTES:  # Note [Inline copies on CPU]
            with _no_python_dispatch():
                _host(buf, n).copy_(byte_view(storage, n))
            return _DoneCopy(n)
        return self._d2h.submit(_host(buf, n), byte_view(storage, n), n)

    def copy_in(
        self,
        buf: torch.Tensor,
        storage: torch.UntypedStorage,
        after: Copy | None = None,
        now: bool = False,
    ) -> Copy:
        n = storage.nbytes()
        if now:  # the caller waits for it at once (an on-demand restore): no thread handoff
            if after is not None:
                after.wait()
            with _no_python_dispatch():
                byte_view(storage, n).copy_(_host(buf, n))
            return _DoneCopy(n)
        return self._h2d.submit(byte_view(storage, n), _host(buf, n), n, after)

    def wait_compute(self, copy: Copy) -> float:
        return copy.wait()  # the "compute stream" is the main thread

    def judge_late(self, copy: Copy):
        late = not copy.done()  # the host is the device: judged now
        return lambda: late

    def free_after_copy_out(self, storage: torch.UntypedStorage, copy: Copy) -> bool:
        if not copy.done():
            return False
        copy.wait()  # re-raise a failed copy
        with _no_python_dispatch():
            storage.resize_(0)
        return True

    def allocated_bytes(self) -> int | None:
        return None  # the CPU allocator keeps no count outside the profiler

    def snapshot(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return _host_copy(storage)  # Note [Snapshots on the host]

    def close(self) -> None:
        self._d2h.close()
        self._h2d.close()


# ---- CUDA --------------------------------------------------------------------------------------


class _EventCopy:
    __slots__ = ("nbytes", "event", "keep", "start")

    def __init__(self, nbytes: int, event, keep, start=None):
        self.nbytes = nbytes
        self.event = event
        self.keep = keep  # host buffers the copy reads/writes: alive until the event completes
        self.start = start  # a timing event where the copy's stream began it

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> float:
        if self.event.query():
            return 0.0
        t0 = time.perf_counter()
        self.event.synchronize()
        return time.perf_counter() - t0


def _timing_event(stream):
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


class _CUDAClock:
    """Timing events on the compute stream (Note [Costs on the device's timeline])."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self):
        return _timing_event(torch.cuda.current_stream(self.device))

    def wait(self, mark) -> None:
        mark.synchronize()

    def span_s(self, a, b) -> float | None:
        if not (b.query() and a.query()):
            return None
        return a.elapsed_time(b) / 1000.0

    def copy_s(self, copy) -> float | None:
        start = getattr(copy, "start", None)
        if start is None or not copy.event.query():
            return None
        return start.elapsed_time(copy.event) / 1000.0


class CUDABackend:
    """One copy stream per direction, events, a pinned host buffer pool, ``record_stream``.

    Ordering (paper §5.4, actions are deferred to their point in the compute stream):
    - swap-out: the d2h stream waits on an event recorded on the compute stream right after the
      evicted-access, then copies; ``record_stream(d2h)`` on the device view tells the caching
      allocator that the d2h stream still reads the block, so the storage can be resized to 0 at
      once (memory_allocated drops now; the block is reused only after the copy has finished).
    - swap-in: the storage is re-allocated on the compute stream (the caching allocator's stream
      of record), the h2d stream waits for that allocation point, copies, and records an event; the
      compute stream waits on that event before the consuming op (``wait_compute``), so the host
      thread does not block unless the runtime asks it to.
    - the pinned host buffer is not reused before the copy's event completes (the ``keep`` list).

    # Note: [A copy keeps no view of the device storage]
    # A copy object keeps its host buffer alive until its event completes, and nothing of the
    # device side: ``record_stream`` already keeps the allocator from reusing the block before
    # the copy stream is done with it. A device view kept there (as once, ``(src, buf)``) kept
    # the storage itself alive as long as the entry held the copy: a swapped-out storage the
    # program released never died, so the runtime never discarded its entry and the tracer's
    # free callback fired late (on the H200 the trace under a real cap recorded a 32 MiB
    # activation's free at another op than the free trace); a restored one held its device bytes
    # after the program's release while the copy was referenced (``last_restore``).
    """

    def __init__(self, device: torch.device | str = "cuda"):
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._d2h = torch.cuda.Stream(self.device)
        self._h2d = torch.cuda.Stream(self.device)
        self._pool = _HostPool(  # Note [Pinned buffers are powers of two]
            lambda n: torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=True), pinned_size
        )
        self.clock = _CUDAClock(self.device)  # Note [Costs on the device's timeline]
        # buffers released while a copy may still touch them: (event, buf)
        self._releasing: collections.deque = collections.deque()

    @property
    def host_pool_bytes(self) -> int:
        return self._pool.allocated_bytes

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self._reclaim()
        return self._pool.get(nbytes)

    def release(self, buf: torch.Tensor) -> None:
        ev = torch.cuda.Event()
        ev.record(self._h2d)  # the last user of a host buffer is a swap-in on the h2d stream
        self._releasing.append((ev, buf))

    def _reclaim(self) -> None:
        while self._releasing and self._releasing[0][0].query():
            self._pool.put(self._releasing.popleft()[1])

    def copy_out(self, storage: torch.UntypedStorage, buf: torch.Tensor, now: bool = False) -> Copy:
        n = storage.nbytes()
        with _disable_current_modes(), torch.no_grad():
            src = byte_view(storage, n)
            ready = torch.cuda.current_stream(self.device).record_event()
            self._d2h.wait_event(ready)
            with torch.cuda.stream(self._d2h):
                start = _timing_event(self._d2h)  # Note [Costs on the device's timeline]
                buf[:n].copy_(src, non_blocking=True)
                src.record_stream(self._d2h)
                done = _timing_event(self._d2h)
        return _EventCopy(
            n, done, (buf,), start
        )  # Note [A copy keeps no view of the device storage]

    def copy_in(
        self,
        buf: torch.Tensor,
        storage: torch.UntypedStorage,
        after: Copy | None = None,
        now: bool = False,
    ) -> Copy:
        n = storage.nbytes()  # already resized by the caller on the compute stream
        with _disable_current_modes(), torch.no_grad():
            dst = byte_view(storage, n)
            ready = torch.cuda.current_stream(self.device).record_event()
            self._h2d.wait_event(ready)
            if after is not None:
                self._h2d.wait_event(after.event)  # the swap-out has filled the host buffer
            with torch.cuda.stream(self._h2d):
                start = _timing_event(self._h2d)  # Note [Costs on the device's timeline]
                dst.copy_(buf[:n], non_blocking=True)
                dst.record_stream(self._h2d)
                done = _timing_event(self._h2d)  # judge_late compares times
        return _EventCopy(
            n, done, (buf,), start
        )  # Note [A copy keeps no view of the device storage]

    def wait_compute(self, copy: Copy) -> float:
        torch.cuda.current_stream(self.device).wait_event(copy.event)
        return 0.0

    def judge_late(self, copy: Copy):
        need = torch.cuda.Event(enable_timing=True)
        need.record(torch.cuda.current_stream(self.device))
        done = copy.event

        def late() -> bool:
            need.synchronize()
            return done.elapsed_time(need) < 0  # the copy ended after the consumer's turn

        return late

    def free_after_copy_out(self, storage: torch.UntypedStorage, copy: Copy) -> bool:
        # record_stream(d2h) in copy_out keeps the allocator from reusing the block early.
        with _disable_current_modes():
            storage.resize_(0)
        return True

    def allocated_bytes(self) -> int | None:
        return self.memory.allocated_bytes()  # Note [Cheap memory counter] in device.py

    def snapshot(self, storage: torch.UntypedStorage) -> torch.Tensor:
        # pageable host memory: the caching allocator never sees it (Note [Snapshots on the host])
        with _no_python_dispatch():
            return byte_view(storage).to("cpu", copy=True)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self._reclaim()


def backend_for(device: torch.device | str, plan=None) -> DeviceBackend:
    """The backend for a plan's device ("cpu" or "cuda[:n]"), with its memory accounting
    (``backend.memory``, runtime/memory.py) reading ``plan``'s per-op scratch."""
    from .memory import memory_for

    device = torch.device(device)
    b = CUDABackend(device) if device.type == "cuda" else CPUBackend(device)
    b.memory = memory_for(b.device, plan)
    return b
