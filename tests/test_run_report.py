"""The run summary's time line: a median of the steady iterations, and on CPU a word that the
memory profiler was on while it timed them (runtime/report.py)."""

from __future__ import annotations

from capuchin.runtime.report import IterationStats, RunReport


def _report(device: str, peak: int | None) -> RunReport:
    times = [0.5, 0.10, 0.12, 0.90, 0.11]  # iteration 0 builds the optimizer state
    its = [IterationStats(i, peak_bytes=peak, time_s=t) for i, t in enumerate(times)]
    return RunReport(budget_bytes=None, device=device, plan=None, iterations=its)


def test_time_is_the_median_of_the_steady_iterations():
    assert "time 115.0 ms/iteration (steady median" in _report("cpu", None).summary()


def test_cpu_times_taken_under_the_memory_profiler_say_so():
    assert "--no-measure" in _report("cpu", 2**20).summary()
    assert "--no-measure" not in _report("cpu", None).summary()  # run with --no-measure
    assert "--no-measure" not in _report("cuda:0", 2**20).summary()  # allocator counters
