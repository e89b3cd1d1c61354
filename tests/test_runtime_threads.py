"""Other threads of the script (Note [Other threads] in runtime/threads.py): a thread that reads
the parameters and optimizer state while the script trains (an EMA after each step, or a loop
without pause) sees whole storages, never crashes the process, and the training, the EMA and
what the thread read are bitwise those of plain training; training in another thread is refused
with one line."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from capuchin.errors import InfeasibleBudgetError, ScriptError
from capuchin.planner.api import make_plan
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import run_example, state_mismatches
from capuchin.tracer.script import trace_script

SCRIPT = Path(__file__).resolve().parent / "frameworks" / "reader_thread.py"


@cache
def _plan(tmp: Path):
    trace = trace_script(
        SCRIPT, ["--steps", "4"], output=tmp / "t.parquet", iterations=1, log=lambda m: None
    )
    try:
        plan = make_plan(trace, "50%", policy="capuchin")
    except InfeasibleBudgetError as exc:
        plan = make_plan(trace, str(exc.smallest_feasible_bytes), policy="capuchin")
    assert any(d.wraps for d in plan.decisions), "parameters or state stay out across the step"
    return plan


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return _plan(tmp_path_factory.mktemp("threads"))


def _check(args, rt):
    got = run_example(SCRIPT, args, rt)
    assert state_mismatches(run_example(SCRIPT, args), got) == []
    return [s for s in rt.report.iterations if s.complete and s.iteration >= 1]


def test_an_ema_thread_reads_what_plain_training_reads(plan):
    its = _check(["--steps", "4", "--mode", "ema"], Runtime(plan, measure_memory=False))
    assert its and all(s.evictions > 0 for s in its)


def test_an_ema_thread_in_dynamic_mode(plan):
    _check(
        ["--steps", "4", "--mode", "ema"],
        Runtime(device="cpu", budget_bytes=plan.budget_bytes, measure_memory=False),
    )


def test_a_thread_reading_without_pause_never_crashes(plan):
    _check(["--steps", "6", "--mode", "free"], Runtime(plan, measure_memory=False))


def test_training_in_another_thread_is_refused(plan):
    with pytest.raises(ScriptError, match="optimizer.step\\(\\) ran in thread .*not managed"):
        run_example(
            SCRIPT, ["--steps", "4", "--mode", "train"], Runtime(plan, measure_memory=False)
        )


def test_a_forked_child_gets_the_lock_free():
    """A DataLoader worker forked while another thread holds the runtime's lock would wait for
    it forever on its first op."""
    import os
    import threading

    from capuchin.runtime.threads import LOCK

    held, release = threading.Event(), threading.Event()

    def hold():
        with LOCK:
            held.set()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit 0 if the lock is free there
            os._exit(0 if LOCK._lock.acquire(timeout=5) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        t.join()
