"""The CUDA caching allocator's peak counter, read and restarted by the runtime and the tracer
alike (Note [One peak counter]); imports torch only.
"""

from __future__ import annotations

import torch

# Note: [One peak counter]
# The caching allocator keeps one peak counter per device (``allocated_bytes.all.peak``), and
# resetting it is global. Learning an op's scratch (``CUDAMemory``, runtime/memory.py) needs the
# peak of each op alone, so it restarts the counter around every op; whoever wants the peak of a
# longer interval (a run's iteration, MemoryMeter in runtime/report.py; a traced iteration,
# tracer/record.py) would then read only the last op's. So every reader goes through
# ``reset_peak`` and ``peak_bytes``, and a per-op restart first folds what the counter held into
# ``_FOLDED``: the interval's peak is the larger of the counter and what was folded since the
# interval's ``reset_peak``.
_FOLDED: dict[int, int] = {}  # device index -> the largest peak folded since its reset_peak


def _index(device) -> int:
    device = torch.device(device) if device is not None else torch.device("cuda")
    return device.index if device.index is not None else torch.cuda.current_device()


def reset_peak(device=None) -> None:
    """Start an interval whose peak ``peak_bytes`` gives (Note [One peak counter])."""
    i = _index(device)
    torch.cuda.reset_peak_memory_stats(i)
    _FOLDED[i] = 0


def peak_bytes(device=None) -> int:
    """The allocator's peak since the last ``reset_peak`` (Note [One peak counter])."""
    i = _index(device)
    return max(int(torch.cuda.max_memory_allocated(i)), _FOLDED.get(i, 0))


def op_window(device) -> tuple[int, int]:
    """``(peak, current)`` allocated bytes since the last window, then a new window: the peak is
    folded into the interval's (Note [One peak counter]) and the counter restarts from current."""
    i = _index(device)
    a = torch._C._cuda_memoryStats(i)["allocated_bytes"]["all"]
    peak, cur = int(a["peak"]), int(a["current"])
    _FOLDED[i] = max(_FOLDED.get(i, 0), peak)
    torch._C._cuda_resetPeakMemoryStats(i)
    return peak, cur
