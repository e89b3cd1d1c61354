"""Host<->device copy bandwidth, measured on the copy path a swap would use.

CUDA: a pinned host buffer and a device buffer, each direction timed with CUDA events (what the
runtime's copy streams do). CPU: the "device" is torch's CPU allocator and the "host" a buffer
allocated outside it (numpy), which is where the runtime parks swapped-out bytes on CPU, so the
copy is a memcpy between the two.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bandwidth:
    """Measured copy bandwidth (bytes per second) in each direction."""

    d2h_bytes_per_s: float  # device -> host (swap-out)
    h2d_bytes_per_s: float  # host -> device (swap-in)
    buffer_bytes: int  # size of the copy that was timed
    method: str  # how it was measured


def measure_bandwidth(
    device_type: str, buffer_bytes: int = 32 << 20, repeats: int = 10
) -> Bandwidth:
    """Best of ``repeats`` timed copies of ``buffer_bytes`` in each direction (after one warm-up).

    Run it outside any dispatch mode: it issues torch ops of its own.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        if device_type == "cuda":
            return _measure_cuda(buffer_bytes, repeats)
        return _measure_cpu(buffer_bytes, repeats)


def _measure_cpu(n: int, repeats: int) -> Bandwidth:
    import numpy as np

    host = torch.from_numpy(np.ones(n, dtype=np.uint8))  # memory not owned by torch's allocator
    dev = torch.ones(n, dtype=torch.uint8, device="cpu")
    best = {"d2h": float("inf"), "h2d": float("inf")}
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        host.copy_(dev)
        t1 = time.perf_counter()
        dev.copy_(host)
        t2 = time.perf_counter()
        if i:  # the first round faults the pages in
            best["d2h"] = min(best["d2h"], t1 - t0)
            best["h2d"] = min(best["h2d"], t2 - t1)
    return Bandwidth(
        n / best["d2h"],
        n / best["h2d"],
        n,
        f"cpu: torch tensor <-> numpy-backed buffer, Tensor.copy_, best of {repeats}",
    )


def _measure_cuda(n: int, repeats: int) -> Bandwidth:  # pragma: no cover - needs a GPU
    host = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    best = {"d2h": float("inf"), "h2d": float("inf")}
    with torch.cuda.stream(stream):
        for i in range(repeats + 1):
            for direction, (dst, src) in (("d2h", (host, dev)), ("h2d", (dev, host))):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
                end.synchronize()
                if i:
                    best[direction] = min(best[direction], start.elapsed_time(end) / 1e3)
    return Bandwidth(
        n / best["d2h"],
        n / best["h2d"],
        n,
        f"cuda: pinned host buffer, side stream, CUDA events, best of {repeats}",
    )
