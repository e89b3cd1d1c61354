"""A device probe (CUDA only; `python3 scripts/gpu_host_probe.py`): the host (CPU) time of each
CUDA call the runtime makes per op and per swap, and of the backend's copy_out/copy_in as a whole,
so that a managed step's host cost can be split into its parts. Prints a table: µs per call,
median of 7 rounds of 200 calls, main-thread CPU time and wall time."""

from __future__ import annotations

import statistics
import time

import torch

dev = torch.device("cuda", torch.cuda.current_device())
N, ROUNDS = 200, 7
NBYTES = 4 << 20


def timed(label, fn, setup=None):
    walls, cpus = [], []
    for _ in range(ROUNDS):
        args = setup() if setup is not None else None
        torch.cuda.synchronize()
        w, c = time.perf_counter(), time.thread_time()
        for i in range(N):
            fn(args, i)
        c = time.thread_time() - c
        w = time.perf_counter() - w
        torch.cuda.synchronize()
        walls.append(w / N * 1e6)
        cpus.append(c / N * 1e6)
    cpu, wall = statistics.median(cpus), statistics.median(walls)
    print(f"| {label} | {cpu:.1f} | {wall:.1f} |", flush=True)


def main() -> None:
    from capuchin.runtime import backend as B
    from capuchin.runtime.device import allocated_bytes

    print(f"device {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; {NBYTES} B copies")
    print("| call | CPU µs | wall µs |")
    print("|---|---|---|")
    cur = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    timed("torch._C._cuda_memoryStats (allocated_bytes)", lambda a, i: allocated_bytes(dev))
    timed("torch.cuda.memory_allocated", lambda a, i: torch.cuda.memory_allocated(dev))
    timed("torch.cuda.current_stream", lambda a, i: torch.cuda.current_stream(dev))
    timed("stream.record_event()", lambda a, i: cur.record_event())
    timed("Event() + record", lambda a, i: torch.cuda.Event().record(cur))
    timed("Event(enable_timing=True) + record", lambda a, i: B._timing_event(cur))
    timed("side.wait_event(ev)", lambda a, i: side.wait_event(a), lambda: cur.record_event())
    timed("event.query()", lambda a, i: a.query(), lambda: cur.record_event())

    def ctx(a, i):
        with torch.cuda.stream(side):
            pass

    timed("with torch.cuda.stream(side)", ctx)
    x = torch.empty(NBYTES, dtype=torch.uint8, device=dev)
    pinned = torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(NBYTES, dtype=torch.uint8)
    timed("record_stream", lambda a, i: x.record_stream(side))
    timed("byte_view(storage)", lambda a, i: B.byte_view(x.untyped_storage(), NBYTES))
    timed("pinned[:n] (a slice)", lambda a, i: pinned[:NBYTES])

    def d2h(a, i):
        with torch.cuda.stream(side):
            pinned.copy_(x, non_blocking=True)

    timed("d2h copy_ non_blocking, pinned (issue only)", d2h)

    def h2d(a, i):
        with torch.cuda.stream(side):
            x.copy_(pinned, non_blocking=True)

    timed("h2d copy_ non_blocking, pinned (issue only)", h2d)
    timed("d2h copy_ to pageable (synchronous)", lambda a, i: pageable.copy_(x))

    def resize(a, i):
        st = a[i % len(a)]
        st.resize_(0)
        st.resize_(NBYTES)

    timed(
        "storage resize_(0) + resize_(n) (allocator free + malloc)",
        resize,
        lambda: [torch.empty(NBYTES, dtype=torch.uint8, device=dev).untyped_storage()],
    )
    be = B.backend_for(dev)
    buf = be.host_buffer(NBYTES)
    timed("CUDABackend.copy_out (whole)", lambda a, i: be.copy_out(x.untyped_storage(), buf))
    timed("CUDABackend.copy_in (whole)", lambda a, i: be.copy_in(buf, x.untyped_storage()))
    timed("CUDABackend.host_buffer + release", lambda a, i: be.release(be.host_buffer(NBYTES)))
    c = be.copy_out(x.untyped_storage(), buf)
    timed("CUDABackend.wait_compute", lambda a, i: be.wait_compute(c))
    torch.cuda.synchronize()
    # the cost of a tiny kernel launch, for scale
    y = torch.zeros(16, device=dev)
    timed("a tiny aten op (y.add_(1))", lambda a, i: y.add_(1))


if __name__ == "__main__":
    main()
