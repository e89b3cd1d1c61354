"""tracer/timing.py on synthetic profiler events: the CUDA kernel attribution (which cannot run
on this machine), the CPU back-to-back timeline and the allocator peaks."""

from __future__ import annotations

from dataclasses import dataclass

from capuchin.tracer.timing import _allocator_peaks, _cpu_times, _cuda_times, _op_alloc_peaks


@dataclass
class _Ev:
    n: str
    start: int
    dur: int
    dev: str = "DeviceType.CPU"
    corr: int = 0
    linked: int = 0
    thread: int = 1

    def name(self):
        return self.n

    def start_ns(self):
        return self.start

    def duration_ns(self):
        return self.dur

    def device_type(self):
        return self.dev

    def correlation_id(self):
        return self.corr

    def linked_correlation_id(self):
        return self.linked

    def start_thread_id(self):
        return self.thread


def _ranges(events):
    return {
        tuple(int(x) for x in e.n.split("#")[1].split(":")): (
            e.start,
            e.start + e.dur,
            e.thread,
            e.corr,
        )
        for e in events
        if e.n.startswith("capuchin#")
    }


def test_cuda_kernels_are_summed_per_op_on_the_gpu_timeline():
    cuda = "DeviceType.CUDA"
    events = [
        _Ev("capuchin#5:0", 1000, 100, corr=1),
        _Ev("aten::mm", 1010, 50, corr=2),
        _Ev("cudaLaunchKernel", 1020, 5, corr=3, linked=2),  # runtime event: ignored
        _Ev("gemm_kernel", 5000, 300, dev=cuda, linked=2),  # kernel of aten::mm
        _Ev("capuchin#5:1", 1200, 100, corr=4),  # launches nothing
        _Ev("capuchin#5:2", 1400, 100, corr=5, thread=2),  # backward op on another thread
        _Ev("aten::add", 1410, 20, corr=6, thread=2),
        _Ev("add_kernel", 5400, 40, dev=cuda, linked=6),
        _Ev("add_kernel", 5450, 60, dev=cuda, linked=6),  # two kernels: summed
        _Ev("copy_kernel", 5600, 10, dev=cuda, linked=5),  # linked to the range itself
        _Ev("aten::mul", 1350, 10, corr=7, thread=1),  # outside every range
        _Ev("stray_kernel", 9000, 10, dev=cuda, linked=7),  # -> not attributed
    ]
    times = _cuda_times(events, _ranges(events))
    assert times[(5, 0)] == (0, 300)  # first kernel of the iteration is time 0
    assert times[(5, 1)] == (300, 0)  # no kernel: starts where the previous ended
    assert times[(5, 2)] == (400, 40 + 60 + 10)  # start of its first kernel, kernels summed


def test_cpu_ops_are_laid_back_to_back():
    events = [
        _Ev("capuchin#1:0", 100, 30),
        _Ev("capuchin#1:1", 500, 20),
        _Ev("capuchin#2:0", 900, 5),
        _Ev("capuchin#1:2", 700, 10),
    ]
    times = _cpu_times(_ranges(events))
    assert times == {(1, 0): (0, 30), (1, 1): (30, 20), (1, 2): (50, 10), (2, 0): (0, 5)}


def test_allocator_peaks_count_only_what_an_iteration_allocated():
    ranges = {(1, 0): (100, 200, 1, 0), (1, 1): (300, 400, 1, 0), (2, 0): (1000, 1100, 1, 0)}
    allocs = [
        (50, 0xA, 1000),  # before the window: ignored
        (110, 0xB, 300),  # iteration 1, op 0: +300
        (120, 0xC, 200),  # +200 -> 500
        (130, 0xC, -200),  # scratch freed -> 300
        (150, 0xA, -1000),  # block from before: not subtracted from iteration 1
        (310, 0xD, 100),  # op 1 -> 400
        (1010, 0xE, 50),  # iteration 2: 50
        (1020, 0xB, -300),  # frees iteration 1's block: iteration 2 unaffected
        (1030, 0xF, 70),  # 120
    ]
    assert _allocator_peaks(allocs, ranges) == {1: 500, 2: 120}
    per_op = _op_alloc_peaks(allocs, ranges)
    # per op, every free inside its range counts (that memory is really gone): 50, -250, -180
    assert per_op[(1, 0)] == 500 and per_op[(1, 1)] == 100 and per_op[(2, 0)] == 50
