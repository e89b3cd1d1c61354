"""An emulated CUDA device for tests on CPU: what capuchin's logic depends on, without a GPU.

- ``CachingAllocatorModel``: the CUDA caching allocator's accounting (c10/cuda/
  CUDACachingAllocator.cpp): requests rounded to 512 B (``memory_allocated``), segments reserved
  per ``runtime.device.segment_bytes`` (2 MiB small pool, 20 MiB for 1-10 MiB, 2 MiB-rounded
  above), cached free segment space reused by later requests of its pool, a cap on *reserved*
  bytes (``set_per_process_memory_fraction``) checked when a new segment is needed, cached
  segments released and the request retried before ``torch.OutOfMemoryError`` is raised, and a
  cuBLAS workspace per thread (``workspace(thread)``). Fragmentation inside a segment is not
  modelled (optimistic: a real allocator can only need more).
- ``EmulatedBackend``: the runtime's ``DeviceBackend`` (runtime/backend.py) on CPU tensors with
  CUDA's timing: the host runs ahead of the device. A copy or a recorded event completes only
  when the emulated device has been given time (``advance()``, or a host ``wait`` that
  synchronizes), never at dispatch; ``done()`` is False until then.
- ``emulated_cuda(...)``: a context manager that makes ``torch.cuda`` report one or more devices
  backed by the allocator model (``is_available``, ``device_count``, ``current_device``,
  ``get_device_properties``, ``set_per_process_memory_fraction``, ``memory_allocated``,
  ``max_memory_allocated``, ``reset_peak_memory_stats``, ``synchronize``,
  ``torch._C._cuda_memoryStats``, ``torch._C._cuda_resetPeakMemoryStats``), restored on exit.
  Tensors stay on the CPU: it emulates what capuchin asks the CUDA runtime, not CUDA kernels.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.device import SMALL_REQUEST_MAX, block_bytes, segment_bytes


@dataclass
class _Segment:
    size: int
    small: bool
    used: int = 0


@dataclass
class CachingAllocatorModel:
    """Allocated and reserved bytes of one emulated GPU (see the module docstring)."""

    total_bytes: int
    workspace_bytes: int = 32 << 20
    fraction: float = 1.0
    allocated: int = 0
    max_allocated: int = 0
    num_ooms: int = 0
    num_alloc_retries: int = 0
    segments: list[_Segment] = field(default_factory=list)
    blocks: dict[int, tuple[_Segment, int]] = field(default_factory=dict)
    workspaces: dict[int, int] = field(default_factory=dict)  # thread id -> block
    _next: int = 0

    @property
    def reserved(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def cap(self) -> int:
        return int(self.fraction * self.total_bytes)

    def set_fraction(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"invalid fraction {fraction}")
        self.fraction = fraction

    def malloc(self, nbytes: int) -> int:
        """Allocate a block; returns its handle. Raises ``torch.OutOfMemoryError`` at the cap."""
        size = block_bytes(nbytes)
        small = nbytes <= SMALL_REQUEST_MAX
        seg = self._fit(size, small)
        if seg is None:
            need = segment_bytes(nbytes)
            if self.reserved + need > self.cap:
                self.num_alloc_retries += 1
                self.segments = [s for s in self.segments if s.used > 0]  # release cached
                if self.reserved + need > self.cap:
                    self.num_ooms += 1
                    raise torch.OutOfMemoryError(
                        f"emulated CUDA out of memory: tried to allocate {nbytes} B "
                        f"({need} B segment); {self.allocated} B allocated, {self.reserved} B "
                        f"reserved, cap {self.cap} B"
                    )
            seg = _Segment(need, small)
            self.segments.append(seg)
        seg.used += size
        self.allocated += size
        self.max_allocated = max(self.max_allocated, self.allocated)
        self._next += 1
        self.blocks[self._next] = (seg, size)
        return self._next

    def _fit(self, size: int, small: bool) -> _Segment | None:
        for s in self.segments:
            if s.small == small and s.size - s.used >= size:
                return s
        return None

    def free(self, handle: int) -> None:
        seg, size = self.blocks.pop(handle)
        seg.used -= size
        self.allocated -= size

    def workspace(self, thread: int | None = None) -> None:
        """The cuBLAS workspace of ``thread`` (default: the calling one), made on its first
        matmul and kept for the process's life."""
        t = threading.get_ident() if thread is None else thread
        if t not in self.workspaces and self.workspace_bytes:
            self.workspaces[t] = self.malloc(self.workspace_bytes)

    def stats(self) -> dict:
        """``torch._C._cuda_memoryStats``'s nested layout, for the counters capuchin reads."""
        return {
            "allocated_bytes": {"all": {"current": self.allocated, "peak": self.max_allocated}},
            "reserved_bytes": {"all": {"current": self.reserved}},
            "num_ooms": self.num_ooms,
            "num_alloc_retries": self.num_alloc_retries,
        }


@contextlib.contextmanager
def emulated_cuda(
    total_bytes: int = 8 << 30,
    devices: int = 1,
    workspace_bytes: int = 32 << 20,
    major: int = 9,
):
    """Make ``torch.cuda`` report ``devices`` emulated GPUs of ``total_bytes`` each, compute
    capability ``major``; yields the list of their ``CachingAllocatorModel``."""
    models = [CachingAllocatorModel(total_bytes, workspace_bytes) for _ in range(devices)]
    current = [0]

    def idx(device=None) -> int:
        if device is None:
            return current[0]
        if isinstance(device, int):
            return device
        d = torch.device(device)
        return current[0] if d.index is None else d.index

    def props(device=None):
        return SimpleNamespace(
            total_memory=total_bytes, major=major, minor=0, name="emulated", multi_processor_count=1
        )

    def set_fraction(fraction, device=None):
        models[idx(device)].set_fraction(fraction)

    def reset_peak(device=None):
        m = models[idx(device)]
        m.max_allocated = m.allocated

    patches = {
        (torch.cuda, "is_available"): lambda: True,
        (torch.cuda, "device_count"): lambda: devices,
        (torch.cuda, "current_device"): lambda: current[0],
        (torch.cuda, "set_device"): lambda d: current.__setitem__(0, idx(d)),
        (torch.cuda, "get_device_properties"): props,
        (torch.cuda, "get_device_name"): lambda device=None: "emulated",
        (torch.cuda, "set_per_process_memory_fraction"): set_fraction,
        (torch.cuda, "memory_allocated"): lambda device=None: models[idx(device)].allocated,
        (torch.cuda, "max_memory_allocated"): lambda device=None: models[idx(device)].max_allocated,
        (torch.cuda, "reset_peak_memory_stats"): reset_peak,
        (torch.cuda, "synchronize"): lambda device=None: None,
        (torch._C, "_cuda_memoryStats"): lambda device=None: models[idx(device)].stats(),
        (torch._C, "_cuda_resetPeakMemoryStats"): reset_peak,
    }
    from ..runtime import device as device_module

    def warm_cublas(device=None) -> int:  # runtime/device.py: the calling thread's workspace
        m = models[idx(device)]  # and autograd's device thread's (CPU autograd has none)
        before = m.allocated
        m.workspace()
        m.workspace(thread=AUTOGRAD_THREAD)
        return m.allocated - before

    patches[(device_module, "warm_cublas")] = warm_cublas
    saved = {k: getattr(k[0], k[1], _MISSING) for k in patches}
    try:
        for (obj, name), fn in patches.items():
            setattr(obj, name, fn)
        yield models
    finally:
        for (obj, name), old in saved.items():
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def emulated_backend_for(device, plan=None):
    """``runtime.engine.backend_for`` on the emulated device: the copy engine on CPU tensors
    (``EmulatedBackend``), the memory accounting of ``plan``'s device."""
    from ..runtime.memory import memory_for

    be = EmulatedBackend()
    be.memory = memory_for(be.device, plan)
    return be


AUTOGRAD_THREAD = -1  # the emulated id of autograd's device thread (no real thread has it)


# ---- the device timeline: the host runs ahead ----------------------------------------------------


class _EmulatedEvent:
    """A point on an emulated stream: complete once the device has run up to it."""

    __slots__ = ("_device", "tick")

    def __init__(self, device: EmulatedTimeline, tick: int):
        self._device = device
        self.tick = tick

    def query(self) -> bool:
        return self._device.now >= self.tick

    def synchronize(self) -> None:
        self._device.run_until(self.tick)


class EmulatedTimeline:
    """The emulated device's progress. Each stream runs its work in order; work submitted on a
    stream starts when that stream is free and the host has issued it, and takes ``cost``
    ticks. The device's clock (``now``) advances only when the host waits (``run_until``) or
    gives it time (``advance``): until then the host runs ahead and nothing is complete.
    Issuing work takes the host ``launch`` ticks (its launch cost); ``host_s()`` is the host's
    clock in seconds (``tick_s`` per tick), for code that times itself on the host."""

    def __init__(self, launch: int = 0, tick_s: float = 1e-6):
        self.now = 0
        self.host = 0  # the device time at which the host issues its next work
        self.launch = launch
        self.tick_s = tick_s
        self.stream_end: dict[str, int] = {}
        self.pending: list[tuple[int, object]] = []  # (tick, completion callback)

    def host_s(self) -> float:
        return self.host * self.tick_s

    def submit(
        self,
        work=None,
        stream: str = "compute",
        cost: int = 1,
        launch: int | None = None,
        after: str | None = None,
    ) -> _EmulatedEvent:
        """Issue ``cost`` ticks of work on ``stream``; ``after``: a stream whose work issued so
        far must end first (a ``wait_event`` on an event recorded there now)."""
        self.host += self.launch if launch is None else launch
        start = max(self.stream_end.get(stream, 0), self.host)
        if after is not None:
            start = max(start, self.stream_end.get(after, 0))
        end = self.stream_end[stream] = start + cost
        if work is not None:
            self.pending.append((end, work))
        return _EmulatedEvent(self, end)

    def compute(self, ops: int = 1) -> None:
        """The host issues ``ops`` ops of one tick each on the compute stream."""
        for _ in range(ops):
            self.submit(stream="compute")

    def advance(self, ticks: int = 1) -> None:
        self.run_until(self.now + ticks)

    def run_until(self, tick: int) -> None:
        self.now = max(self.now, tick)
        self.host = max(self.host, self.now)  # work issued after a wait starts no earlier
        due = [w for t, w in self.pending if t <= self.now]
        self.pending = [(t, w) for t, w in self.pending if t > self.now]
        for w in due:
            w()


class _TimelineCopy:
    __slots__ = ("nbytes", "event", "cost")

    def __init__(self, nbytes: int, event: _EmulatedEvent, cost: int):
        self.nbytes = nbytes
        self.event = event
        self.cost = cost  # ticks on its stream

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> float:
        """Block the host until the copy is done; the host seconds that took."""
        tl = self.event._device
        before = tl.host
        self.event.synchronize()
        return (tl.host - before) * tl.tick_s


class EmulatedClock:
    """The backend's ``clock`` on the emulated timeline (Note [Costs on the device's timeline]
    in runtime/backend.py): marks on the compute stream, read once the device has reached them."""

    def __init__(self, timeline: EmulatedTimeline):
        self.timeline = timeline

    def mark(self) -> _EmulatedEvent:
        return self.timeline.submit(stream="compute", cost=0, launch=0)

    def wait(self, mark: _EmulatedEvent) -> None:
        mark.synchronize()

    def span_s(self, a: _EmulatedEvent, b: _EmulatedEvent) -> float | None:
        if not b.query():
            return None
        return (b.tick - a.tick) * self.timeline.tick_s

    def copy_s(self, copy: _TimelineCopy) -> float | None:
        return copy.cost * self.timeline.tick_s if copy.done() else None


class EmulatedCompute(TorchDispatchMode):
    """Every op dispatched below capuchin's mode takes ``ticks`` on the emulated compute stream
    (and the timeline's launch cost on the host): the device time of a kernel the host does not
    wait for. Enter it before the runtime, so that it sits under the runtime's mode."""

    def __init__(self, timeline: EmulatedTimeline, ticks: int):
        super().__init__()
        self.timeline = timeline
        self.ticks = ticks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.timeline.submit(stream="compute", cost=self.ticks)
        return func(*args, **(kwargs or {}))


class EmulatedBackend:
    """``DeviceBackend`` on CPU tensors whose copies complete on an ``EmulatedTimeline``: the
    bytes are moved when the device reaches the copy, not at dispatch (a consumer that does not
    wait reads stale bytes, as a missing ``wait_event`` would on CUDA)."""

    def __init__(self, timeline: EmulatedTimeline | None = None, copy_cost: int = 1):
        from ..runtime.memory import CPUMemory

        self.device = torch.device("cpu")
        self.timeline = timeline or EmulatedTimeline()
        self.clock = EmulatedClock(self.timeline)
        self.copy_cost = copy_cost  # ticks per copy on its stream
        self.memory = CPUMemory()
        self.host_pool_bytes = 0

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self.host_pool_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8)

    def release(self, buf: torch.Tensor) -> None:
        pass

    def _copy(self, dst, src, stream: str, after=None) -> _TimelineCopy:
        from ..runtime.backend import _no_python_dispatch

        def work():
            if after is not None:
                after.wait()
            with _no_python_dispatch(), torch.no_grad():
                dst.copy_(src)

        # after the compute issued so far, as CUDABackend's copies wait for its ``ready`` event
        ev = self.timeline.submit(work, stream, self.copy_cost, after="compute")
        return _TimelineCopy(dst.numel(), ev, self.copy_cost)

    def copy_out(self, storage, buf, now: bool = False):
        from ..runtime.backend import _host, byte_view

        n = storage.nbytes()
        return self._copy(_host(buf, n), byte_view(storage, n), "d2h")  # ``now``: caller waits

    def copy_in(self, buf, storage, after=None, now: bool = False):
        from ..runtime.backend import _host, byte_view

        n = storage.nbytes()
        return self._copy(byte_view(storage, n), _host(buf, n), "h2d", after)  # as CUDA's

    def wait_compute(self, copy) -> float:
        return copy.wait()

    def judge_late(self, copy):
        need = self.timeline.submit(stream="compute", cost=0, launch=0)  # the consumer's turn
        return lambda: copy.event.tick > need.tick

    def free_after_copy_out(self, storage, copy) -> bool:
        if not copy.done():
            return False
        from ..runtime.backend import _no_python_dispatch

        with _no_python_dispatch():
            storage.resize_(0)
        return True

    def allocated_bytes(self) -> int | None:
        return None

    def snapshot(self, storage) -> torch.Tensor:
        from ..runtime.backend import _host_copy

        return _host_copy(storage)

    def close(self) -> None:
        self.timeline.run_until(max(self.timeline.stream_end.values(), default=0))
