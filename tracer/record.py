"""``capuchin.Tracer``: record a tensor access trace of whatever trains inside a ``with`` block.

    with capuchin.Tracer("train.trace.parquet", iterations=3, warmup=1):
        train()          # unmodified; stopped cleanly after warm-up + 3 iterations

A ``TorchDispatchMode`` sees every aten op (forward, backward, optimizer); ``tracer.hooks`` indexes
them (iterations, phases, ids); during the recorded iterations each op runs inside a
``record_function`` marker under ``torch.profiler`` (``tracer.timing``) and its accesses, the
allocations and frees of storages, become rows of the event table (``tracer.schema``), written
atomically when the block ends.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from .. import __version__
from ..distributed import default_warmup, per_rank, say, world
from ..errors import CapuchinError, ScriptError
from ..outputs import check_output
from ..peak import peak_bytes, reset_peak
from ..units import format_bytes
from .bandwidth import measure_bandwidth
from .compiled import replay_refusal
from .hooks import OpEvent, OpIndexer, describe_args, flatten_tensors, join_outputs, split_calls
from .optimizer_chunks import ChunkedOptimizers
from .reader import write_trace
from .schema import COLUMNS, Col, Kind, Phase, Role, TraceMeta, scratch_id, shape_signature
from .timing import marker_name, parse_profile, profiler_quiet, start_profiler_quietly

try:
    from torch._C._profiler import _RecordFunctionFast as _Marker
except ImportError:  # pragma: no cover - older torch
    from torch.autograd.profiler import record_function as _Marker


class TooFewStepsError(ScriptError):
    """The script ended within the warm-up: nothing recorded. ``steps``: the steps it made."""

    def __init__(self, steps: int, message: str):
        super().__init__(message)
        self.steps = steps


def _end_children() -> None:
    """The script was stopped after its last recorded iteration, or ran on for the plain step
    (Note [Plain step]): end the processes it started through multiprocessing (workers, spawned
    helpers), which would otherwise outlive it and fail with tracebacks after capuchin's last line
    (their parent's queues and semaphores are gone). Only this process's multiprocessing
    children; the trace does not need them."""
    import multiprocessing

    children = multiprocessing.active_children()
    for p in children:
        p.terminate()
    for p in children:
        p.join(timeout=5)


class StopScript(BaseException):
    """Raised inside the traced code at the first op after the last recorded iteration, to stop
    the script cleanly; ``Tracer.__exit__`` swallows it. A BaseException so that a script's
    ``except Exception`` does not catch it."""


def resolve_device(device: str) -> str:
    """``auto`` -> ``cpu`` where CUDA is not available (else ``auto`` stays: the tracer decides
    from where the script's tensors live, Note [Auto device]); ``cpu`` / ``cuda`` checked.
    Raises CapuchinError on a bad name or on ``cuda`` without a CUDA device."""
    if device == "auto":
        return _auto()
    if device not in ("cpu", "cuda"):
        raise CapuchinError(f"unknown device {device!r}; use auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise CapuchinError(
            f"--device cuda: no CUDA device is available (this torch: {torch.__version__})"
        )
    return device


def _auto() -> str:
    return "auto" if torch.cuda.is_available() else "cpu"


def resolve_device_now(device: str, why: str) -> str:
    """``resolve_device`` for a caller that needs the device before the script runs (a memory
    cap): ``auto`` on a host with CUDA is refused with one line, since only the script's own
    tensors tell (Note [Auto device])."""
    dev = resolve_device(device)
    if dev == "auto":
        raise CapuchinError(
            f"--device auto: {why}, before the script shows where its tensors live, and this "
            "host has CUDA; name the device the script trains on: --device cuda or --device cpu"
        )
    return dev


# Note: [Auto device]
# The tracer records the storages of one device type. Which one is a property of the script
# (where its model and batches live), not of the host: picking CUDA whenever a GPU exists traced
# CPU scripts as "cuda" with no allocation, and the plan then failed on a 0-byte peak. So, on a
# host with CUDA, ``auto`` is decided when recording starts (after warm-up): the device of the
# optimizers' parameters seen at the last step, else the device type holding the most live
# bytes. Without warm-up nothing has run yet, so ``auto`` is refused there, as it is where the
# device is needed before the script runs (a memory cap: ``resolve_device_now``). Whatever the
# device, a trace in which it holds no storage at all is refused, never written empty.


def _device_of_script(indexer) -> str | None:
    """Where the script's tensors live, at an iteration boundary (Note [Auto device])."""
    for opt in list(indexer.optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if isinstance(p, torch.Tensor) and p.device.type in ("cpu", "cuda"):
                    return p.device.type
    by_type: dict[str, int] = {}
    for rec in indexer.residents:
        by_type[rec.device_type] = by_type.get(rec.device_type, 0) + rec.nbytes
    by_type = {k: v for k, v in by_type.items() if k in ("cpu", "cuda") and v > 0}
    if not by_type:
        return None
    return max(by_type, key=by_type.get)


def _stderr(line: str) -> None:
    say(line)


class _CountingMode(TorchDispatchMode):
    """Passes every op on and counts it: the cheapest dispatch mode, timed after the plain steps
    (Note [Calibrated host costs] in planner/costs.py)."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **kwargs) if kwargs else func(*args)


class _TraceMode(TorchDispatchMode):
    supports_higher_order_operators = True  # compiled regions (Note [torch.compile])

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Dynamo compiles under the mode (Note [torch.compile] in tracer/compiled.py)

    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer
        self.indexer = tracer.indexer
        self.pid = os.getpid()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if os.getpid() != self.pid:  # a forked DataLoader worker inherited the mode: not ours
            return func(*args, **kwargs)
        calls = split_calls(func, args, kwargs)  # Note [Multi-tensor op split] in hooks.py
        if calls is not None:
            return join_outputs([self.__torch_dispatch__(func, types, a, k) for a, k in calls])
        op = self.indexer.begin_op(func, args, kwargs)
        if op is None:
            return func(*args, **kwargs)
        if not self.tracer._recording:
            out = func(*args, **kwargs)
            self.indexer.end_op(op, out)
            return out
        if self.tracer.runtime is not None:  # Note [Tracing under a budget]
            self.tracer._pending = (marker_name(op.iteration, op.index), func, op.inputs)
            try:
                out = func(*args, **kwargs)
            finally:
                self.tracer._pending = None
        else:
            with _Marker(marker_name(op.iteration, op.index)):
                out = func(*args, **kwargs)
        self.indexer.end_op(op, out)
        self.tracer._record_op(op)
        return out


# Note: [Tracing under a budget]
# With ``budget_bytes`` the traced run is kept within the budget by the runtime's passive mode
# (on demand, least recently used storages are evicted and come back when an op reads them; the
# ``keeper`` the tracer is given, capuchin/tracing.py: the tracer never imports the runtime),
# while the trace records the *unmanaged* program. Three modes
# are stacked, innermost last:
#
#     _TraceMode (top)      sees the script's ops, indexes and records them (ids, accesses, frees)
#     Runtime's mode        evicts / restores around each op; its own copies run with the modes
#                           disabled, anything else it dispatches reaches only the mode below
#     _KernelMarkMode       wraps the script's op, when the runtime finally runs it, in the op's
#                           ``record_function`` marker; every other op passes through unmarked
#
# So the tracer never sees the runtime's internal ops (they are below it), and the profiler
# ranges that give an op's duration and its scratch memory (tracer/timing.py) hold the op's own
# kernels only, not the evictions that made room for it nor the restores of its inputs: CPU ops
# are laid back to back with their own durations, CUDA ops are their own kernels. Evicting a
# storage resizes it to 0 bytes but keeps the storage object alive, so the weak-reference
# callbacks that time frees (tracer/hooks.py) fire when the *program* releases it, as without the
# budget; sizes are read from storages only while resident (an op's inputs are restored before it
# runs), and the iteration's resident set is the indexer's live storages, evicted or not. The trace
# therefore has the same ops, accesses, ids, lifetimes and computed peak as an uncapped one
# (tests/test_trace_budget.py). What the budget changes is recorded beside it: the cap
# (``TraceMeta.trace_budget_bytes``) and the peak the allocator measured while tracing
# (``measured_peak_bytes``: CUDA ``max_memory_allocated`` less the non-tensor bytes the cap adds to
# the budget; CPU the profiler's allocation events
# rebuilt by address from before the script, as ``capuchin run`` measures, runtime/report.py),
# and in ``extra`` the passive evictions and any shortfall. ``allocator_peak_bytes`` in ``extra``
# stays the allocator's own reading of each iteration, which under a budget is the capped one.


# Note: [Plain step]
# Op times in a trace are taken under the profiler (CPU: each op's own range, with the profiler's
# per-op and memory accounting in it) and under the tracer's dispatch mode, so on CPU their sum can
# be several times the step the script makes without capuchin; a plan's overhead stated against it
# reads small where the user's slowdown is large. So after the recorded iterations (profiler
# stopped) the tracer times the plain step: one more iteration runs with the dispatch mode passing
# ops through (a warm-up; it also ends the last recorded iteration, which ends lazily at its next
# op), and at that iteration's optimizer step the mode is popped (the step hooks run outside any
# dispatch, where the tracer's mode is the top of the stack; if another mode is above it, nothing
# is timed). Then one iteration runs with no mode and no profiler, untimed (``plain~``), and
# ``plain_steps`` more are timed; the time from one optimizer step to the next is one plain
# iteration (data loading and the script's own work between steps included, as the user measures a
# step). The untimed one is there because the first step without the mode is not a steady one (on
# T5, tests/frameworks/hf_t5.py, it is up to 45% slower than the plain steps after it:
# benchmarks/results/plain_prediction_real.txt), just as the step after a plain run's first is
# not, which a steady median (benchmarks/runtime.py's) leaves out; timed, it would be one of the
# three whose median is stored, which would then be the larger of the other two, and a plan's
# overhead against it would read low. The timed steps run in rounds with the runtime's own
# steps (``_steps_schedule``): each round is a plain step, a step under the runtime without actions
# and one with an action at every op (Note [The runtime in the script's steps] in
# runtime/calibrate.py; the first round also has an untimed warm-up of each), or, where the runtime
# is not composed in or does not follow the recorded ops, a plain step and one through a dispatch
# mode that only passes ops on (``_CountingMode``); the runtime's per-op costs in this script are
# the median within-round differences, so load that changes from one round to the next cancels
# (Note [Calibrated host costs] in planner/costs.py; not where another mode is on the stack). A
# step that follows a step of another kind is slower, as the first step without the tracer's
# mode is: on T5 the first plain step after a probe step took 29.7-31.4 ms where the plain steps
# before the probe took 27.5-29.7 ms and the plain steps after that first one 28.0-29.6 ms; so
# every later round's plain step is such a first one, while a user's plain steps follow plain
# steps. So ``plain_steps - 1`` plain steps run before the first round, whose plain step also
# precedes every probe step, and the baseline is those ``plain_steps`` consecutive plain steps;
# the later rounds' plain steps serve only their rounds' differences. A step's time runs from just
# after its phase was entered to its optimizer step. At the last step ``StopScript`` ends the
# script. The median plain step is ``TraceMeta.plain_iteration_ns`` (the intervals in
# ``extra["plain_iteration_wall_s"]``; for comparison only, the untimed step's in
# ``extra["plain_warmup_wall_s"]`` and the later rounds' in ``extra["plain_after_probe_wall_s"]``).
# None, with the reason in ``extra["plain_iteration_note"]`` and a log line, when the script ended before one interval, when
# traced under a budget (the runtime's passive mode would be in every step), under torchrun (the
# ranks stop where their recording ends, at one step: the way the distributed tests hold every rank
# in step; a rank's plain step would also time its waits on the others), or with ``plain_steps=0``.
# A script that fails in the plain iterations (where the tracer used to stop it) gets a warning and
# the trace is written all the same. Limits: two optimizer steps with no op between them (two
# optimizers stepped back to back, one iteration for the indexer) make two intervals here; the
# plain iterations run after the recorded ones, so a script whose steps change in cost (a schedule
# of sequence lengths, several kinds of iteration) is timed at another point than traced; the
# intervals are wall time, so a loaded host lengthens them as it lengthens the traced op times. The
# planner uses the field (Note [Plain baseline] in planner/problem.py).

# Note: [Training in another thread]
# The tracer's dispatch mode is on the stack of the thread that runs the script; a thread the
# script starts sees no mode, so training there would record nothing, and the old diagnosis
# ("all within the warm-up") misled. An optimizer step in any other thread is refused at once
# (a ``SystemExit`` ends that thread's loop quietly) and the refusal is raised when the tracer
# exits, so the command ends with that one line and writes nothing. The runtime refuses the
# same (Note [Other threads] in runtime/threads.py).


class _OtherThread(SystemExit):
    """Ends the loop of a thread whose optimizer step the tracer refused; a ``SystemExit``, so
    the thread ends quietly (``threading.excepthook`` ignores it) and ``except Exception`` in the
    script's loop does not catch it."""


class _KernelMarkMode(TorchDispatchMode):
    """Below the runtime's mode: puts the script's op (``Tracer._pending``: marker, func, inputs)
    in its marker when the runtime runs it (Note [Tracing under a budget])."""

    supports_higher_order_operators = True  # compiled regions (Note [torch.compile])

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Dynamo compiles under the mode (Note [torch.compile] in tracer/compiled.py)

    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        want = self.tracer._pending
        if (
            want is None
            or func is not want[1]
            or not _same_tensors(flatten_tensors(args, kwargs), want[2])
        ):
            return func(*args, **kwargs)
        self.tracer._pending = None
        try:
            with _Marker(want[0]):
                return func(*args, **kwargs)
        except BaseException:
            self.tracer._pending = want  # a retry (CUDA out of memory: evict, run again) is marked
            raise


def _same_tensors(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class _Iteration:
    """Rows of one recorded iteration while it runs."""

    def __init__(self, number: int):
        self.number = number
        self.ops: list[tuple] = []
        self.frees: list[tuple[int, str, int]] = []  # (after op, storage id, bytes)
        self.residents: list[tuple[str, int]] = []  # (storage id, bytes at start)
        self.kinds: dict[str, Kind] = {}  # storage id -> persistent kind seen at the step
        self.elapsed_s = 0.0
        self.cuda_start_allocated_bytes: int | None = None  # memory_allocated() at the start
        self.cuda_max_allocated_bytes: int | None = None  # max_memory_allocated() during it


class Tracer:
    """Record a trace of the training that runs inside the ``with`` block.

    path: output Parquet file (written atomically when the block ends).
    iterations: iterations recorded (default 3); warmup: iterations run before recording (default
        1; iteration 0 differs from the others because optimizer state is created in it; 2 under a
        world of several ranks, ``distributed.default_warmup``).
    device: ``"auto"`` | ``"cpu"`` | ``"cuda"``: the device whose memory and timeline are traced.
    force: overwrite an existing ``path`` (otherwise CapuchinError before anything runs).
    script, argv: provenance stored in the metadata (default ``sys.argv``).
    budget_bytes: keep the traced run within this many bytes of device memory by passive eviction,
        while the trace records the unmanaged program (Note [Tracing under a budget]). None: no cap.
    keeper: with ``budget_bytes``, ``keeper(budget_bytes, device)`` makes the context that keeps
        the budget (the runtime's passive mode: ``capuchin.Tracer``, capuchin/tracing.py, supplies
        it; the tracer does not import the runtime). Required with ``budget_bytes``.
    calibrate_host: ``calibrate_host(nbytes, (d2h, h2d) ns per byte)`` times the runtime's slow path,
        swaps and replays on this host and returns (``host_costs`` keys, lines for ``extra``);
        called on CPU after the plain steps were timed (Note [Calibrated host costs] in
        planner/costs.py; ``capuchin.Tracer`` supplies the runtime's). None: not measured.
    runtime_probe: ``runtime_probe(ops, indexer, path, device)`` makes the context that runs
        the runtime of ``device`` over one of the script's steps with a plan of ``ops`` (the
        recorded iteration as ``[[name, signature], ...]``), its ops on ``path`` ("hot",
        "guarded" or "slow"), following ``indexer``'s step hooks, with ``steady(n)`` and
        ``slow_calls``; entered in the rounds after the plain warm-up (Note
        [The runtime in the script's steps] in runtime/calibrate.py; ``capuchin.Tracer``
        supplies the runtime's). None: the hot path is timed through ``_CountingMode``, the
        slow path not in the script.
    log: receives one progress line per iteration and warnings (default: stderr).
    plain_steps: after the recorded iterations, time this many iterations with neither the
        tracer's dispatch mode nor the profiler (Note [Plain step]); 0: stop right after them.

    Iterations are delimited by optimizer steps (or ``capuchin.step()``): see Note [Iteration
    boundaries] in ``tracer/hooks.py``. After the recorded iterations ``plain_steps`` more are
    timed plain (Note [Plain step]), and the last one's optimizer step raises ``StopScript``
    (with ``plain_steps=0``: the first op after the recorded iterations), which ends the block
    cleanly. If the block ends earlier, what was recorded is written and ``log`` says so; if
    nothing was recorded, ``ScriptError``. An exception from the traced code propagates and no
    file is written, unless it comes after the recorded iterations (then ``log`` warns).

    After the block: ``recorded`` (iteration numbers), ``path``, ``profiler`` (the
    ``torch.profiler.profile`` of the recorded iterations, for cross-checks).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        iterations: int = 3,
        warmup: int | None = None,
        device: str = "auto",
        *,
        force: bool = False,
        script: str | None = None,
        argv: list[str] | None = None,
        log: Callable[[str], None] | None = _stderr,
        budget_bytes: int | None = None,
        plain_steps: int = 3,
        keeper: Callable[[int, str], Any] | None = None,
        calibrate_host: Callable[[int, tuple], tuple[dict, dict]] | None = None,
        runtime_probe: Callable[[list, OpIndexer, str, str], Any] | None = None,
        region_tags: dict[str, list[str]] | None = None,
    ):
        if iterations < 1:
            raise CapuchinError(f"iterations must be at least 1, got {iterations}")
        if warmup is None:
            warmup = default_warmup()
        if warmup < 0:
            raise CapuchinError(f"warmup must be 0 or more, got {warmup}")
        self.path = per_rank(path)  # Note [Per-rank files] in distributed.py
        self.iterations = iterations
        self.warmup = warmup
        self.device_request = device
        self.force = force
        if budget_bytes is not None and int(budget_bytes) <= 0:
            raise CapuchinError(f"budget must be positive, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes) if budget_bytes is not None else None
        if self.budget_bytes is not None and keeper is None:
            raise CapuchinError(
                "tracing under a budget needs keeper=, the runtime that keeps it: use "
                "capuchin.Tracer (capuchin/tracing.py), which supplies it"
            )
        self.keeper = keeper
        self.calibrate_host = calibrate_host
        self.runtime_probe = runtime_probe
        if plain_steps < 0:
            raise CapuchinError(f"plain_steps must be 0 or more, got {plain_steps}")
        self.plain_steps = int(plain_steps)
        self._live_devices: set[str] | None = None  # device types alive after recording
        self._plain_state: str | None = None  # Note [Plain step]: None, warm-up, steps, done
        # the steps after the plain warm-up (Note [Plain step]): the phases still to run, the
        # current one and when it started, and each round's step time by phase
        self._schedule: list[str] = []
        self._phase = "plain"
        self._timing_phase: str | None = None  # the phase whose end ``_now`` marks (tests)
        self._step_start = 0.0
        self._rounds: list[dict[str, float]] = []
        self._plain_warmup_s: float | None = None  # the untimed plain step's length
        # Note [Plain step]: plain steps timed before any runtime probe step (the baseline), and
        # those of the probe's later rounds
        self._plain_before_probe: list[float] = []
        self._plain_after_probe: list[float] = []
        self._plain_note: str | None = None  # why the plain step was not timed
        # Note [Calibrated host costs] in planner/costs.py: the steps timed through a dispatch
        # mode after the plain ones
        self._pt: _CountingMode | None = None
        self._pt_steps = 0
        # Note [The runtime in the script's steps] in runtime/calibrate.py: the steps run by
        # the runtime without actions ("hot") and with an action at every op ("slow")
        self._probe = None
        self._probe_ops: list[list[str]] | None = None
        self._probe_note: str | None = None
        self._probe_slow_calls = 0
        self._mode_on = False
        self.runtime = None  # the Runtime that keeps the budget (Note [Tracing under a budget])
        self._pending = None
        self.script = script if script is not None else (sys.argv[0] if sys.argv else "")
        self.argv = list(argv) if argv is not None else list(sys.argv[1:])
        self.log = log or (lambda line: None)
        self.recorded: list[int] = []
        self.profiler = None
        self.indexer: OpIndexer | None = None
        self._recording = False
        self._cur: _Iteration | None = None
        self._done: dict[int, _Iteration] = {}
        self._params_seen: dict[int, torch.Tensor] = {}
        self._replayable_regions: set[str] = set()  # Note [Region replay] in compiled.py
        # Note [Region tags] in region_tags.py: the tags compiled in (verified by the caller),
        # the partitioner that applies and records them, each forward region's output names
        self.region_tags = dict(region_tags) if region_tags else None
        self._partitioner = None
        self._recorded_partitioner = None
        self._region_outputs: dict[str, tuple] = {}
        # persistent kind of a storage, remembered across iterations: last iteration's gradients
        # are resident (and often freed by zero_grad before any access) in the next one
        self._rec_kind: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._iter_started_s = 0.0

    # ---- context manager ------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        check_output(self.path, force=self.force, inputs=[self.script or None])
        self.device = resolve_device(self.device_request)
        if self.device == "auto":  # Note [Auto device]
            why = None
            if self.budget_bytes is not None:
                why = "a trace under --budget caps the device's memory"
            elif self.warmup == 0:
                why = "--warmup 0 records from the first op"
            if why is not None:
                self.device = resolve_device_now(self.device_request, why)
            else:
                self.device = None  # decided when recording starts
        self.bandwidth = None  # measured after the script (its own device chosen by then)
        # Note [Training in another thread]: the tracer records the thread that runs the script;
        # an optimizer step in another thread is refused at the step, and named at the end
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._thread_id = threading.get_ident()
        self.refusal: CapuchinError | None = None
        self._thread_hook = register_optimizer_step_pre_hook(self._check_thread)
        self.indexer = OpIndexer(
            on_iteration_start=self._on_iteration_start,
            on_iteration_end=self._on_iteration_end,
            on_free=self._on_free,
            on_step=self._on_step,
        ).install()
        from . import region_tags

        try:
            self._partitioner = region_tags.install(self.region_tags)
            self._recorded_partitioner = self._partitioner
        except BaseException:
            self._thread_hook.remove()
            self.indexer.uninstall()
            raise
        if self.budget_bytes is not None:  # Note [Tracing under a budget]
            if self.device == "cpu":  # the allocator's count from before the script
                self._start_profiler()
            self._mark_mode = _KernelMarkMode(self)
            self._mark_mode.__enter__()
            try:
                self.runtime = self.keeper(self.budget_bytes, self.device)
                self.runtime.__enter__()
            except BaseException:
                self.runtime = None
                self._mark_mode.__exit__(None, None, None)
                self._thread_hook.remove()
                self.indexer.uninstall()
                self._uninstall_partitioner()
                self._stop_profiler()
                raise
        # Note [Multi-tensor optimizers per chunk] in optimizer_chunks.py: as the runtime does
        self._chunks = ChunkedOptimizers().__enter__()
        self._mode = _TraceMode(self)
        self._mode.__enter__()
        self._mode_on = True
        self._iter_started_s = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        stopped = exc_type is not None and issubclass(exc_type, StopScript)
        if not stopped and self._plain_state is not None and isinstance(exc, Exception):
            # Note [Plain step]: the recorded iterations are complete; where the tracer used to
            # stop the script, its failure afterwards does not cost the trace
            why = str(exc).removesuffix("; no trace written")
            self.log(
                f"capuchin: warning: the script failed after the recorded iterations, while "
                f"the plain step was timed ({why}); the trace is written"
            )
            self._plain_note = self._plain_note or "the script failed before one was timed"
            stopped = True
        if self._plain_state == "steps":  # the script ended inside a timed step: close it
            self._plain_state = "done"
            self._end_step(self._phase, exc_type, exc, tb, ended=True)
        if self._mode_on:  # Note [Plain step]: popped already while the plain step was timed
            self._mode_on = False
            self._mode.__exit__(None, None, None)
        self._chunks.__exit__(None, None, None)
        try:
            if self.runtime is not None:  # restores what it evicted; out of the modes below
                try:
                    self.runtime.__exit__(exc_type, exc, tb)
                finally:
                    self._mark_mode.__exit__(None, None, None)
            if (exc_type is None or stopped) and self._plain_state is None:
                self.indexer.finish()  # (once the plain iterations began, all recorded ones ended)
        finally:
            self.indexer.uninstall()
            self._uninstall_partitioner()
            self._stop_profiler()
            self._thread_hook.remove()
        self._params_seen.clear()  # do not keep the script's parameters alive
        if stopped or self._plain_state is not None:  # past the recorded iterations
            _end_children()
        if self.refusal is not None:
            raise self.refusal
        if exc_type is not None and not stopped:
            return False  # the script failed: nothing is written
        self._write()
        return stopped

    def _uninstall_partitioner(self) -> None:
        if self._partitioner is not None:
            from . import region_tags

            region_tags.uninstall()
            self._partitioner = None  # its record stays in _recorded_partitioner for _write

    def _check_thread(self, optimizer, args, kwargs) -> None:
        """An optimizer step began: refuse it in any thread but the one that runs the script
        (Note [Training in another thread])."""
        if threading.get_ident() != self._thread_id:
            self.refusal = self.refusal or CapuchinError(
                f"{self.script}: optimizer.step() ran in thread "
                f"{threading.current_thread().name!r}, not in the thread that runs the script: "
                "capuchin traces that thread's training only; run the training loop in the main "
                "thread; no trace written"
            )
            raise _OtherThread()  # ends that thread's loop without a traceback

    # ---- indexer callbacks ----------------------------------------------------------------
    def _last_recorded(self) -> int:
        return self.warmup + self.iterations - 1

    def _on_iteration_start(self, it: int) -> None:
        if it > self._last_recorded():
            if it == self._last_recorded() + 1:  # where the script's tensors live, for a refusal
                self._live_devices = {r.device_type for r in self.indexer.live.values()}
            if it == self._last_recorded() + 1 and self._plain_wanted():
                self._plain_state = "warm-up"  # Note [Plain step]
                return
            raise StopScript()
        self._iter_started_s = time.perf_counter()
        if it < self.warmup:
            return
        if self.device is None:  # Note [Auto device]
            self.device = _device_of_script(self.indexer)
            if self.device is None:
                raise CapuchinError(
                    f"{self.script}: --device auto: the script holds no tensor on cpu or cuda "
                    "after warm-up; name the device: --device cuda or --device cpu"
                )
            self.log(f"capuchin: --device auto: tracing {self.device} (the script's tensors)")
        if it == self.warmup and self.profiler is None:
            self._start_profiler()
        self._cur = _Iteration(it)
        if self.device == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize()
            reset_peak()  # Note [One peak counter] in peak.py
            self._cur.cuda_start_allocated_bytes = torch.cuda.memory_allocated()
        self._recording = True

    def _on_iteration_end(self, it: int, last_op: int) -> None:
        elapsed = time.perf_counter() - self._iter_started_s
        cur = self._cur
        if self._recording and cur is not None and cur.number == it:
            # names of residents first accessed during the iteration are known only now
            cur.residents = []
            for r in self.indexer.residents:
                if r.device_type == self.device:
                    name = self.indexer.storage_name(r)
                    cur.residents.append((name, r.start_nbytes))
                    kind = self._rec_kind.get(r)
                    if kind is not None:
                        cur.kinds.setdefault(name, kind)
            cur.elapsed_s = elapsed
            if self.device == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.synchronize()
                cur.cuda_max_allocated_bytes = peak_bytes()
            self._done[it] = cur
            self.recorded.append(it)
            self._cur = None
            n = len(self.recorded)
            self.log(
                f"capuchin: iteration {it}: recorded {n}/{self.iterations}, "
                f"{last_op + 1} ops, {elapsed:.2f} s"
            )
            if it >= self._last_recorded():
                self._recording = False
                self._stop_profiler()
        else:
            self.log(f"capuchin: iteration {it}: warm-up, {last_op + 1} ops, {elapsed:.2f} s")

    def _on_free(self, rec, name: str, it: int, op_index: int) -> None:
        cur = self._cur
        if cur is not None and cur.number == it and rec.device_type == self.device:
            cur.frees.append((op_index, name, rec.nbytes))

    def _on_step(self, optimizer) -> None:
        if self._plain_state is not None:
            self._plain_step()
            return
        cur = self._cur
        if cur is None:
            if self.indexer.iteration < self.warmup - 1:
                return
            cur = _Iteration(-1)  # the last warm-up step: only remember the kinds
        ix = self.indexer

        def mark(t, kind):
            if isinstance(t, torch.Tensor):
                rec = ix.storage_rec(t)
                if rec is not None:
                    cur.kinds.setdefault(ix.storage_name(rec), kind)
                    self._rec_kind.setdefault(rec, kind)

        params = []
        if optimizer is not None:
            for group in optimizer.param_groups:
                params.extend(group["params"])
        params.extend(self._params_seen.values())
        for p in params:
            mark(p, Kind.PARAMETER)
            mark(p.grad, Kind.GRADIENT)
        if optimizer is not None:
            for state in optimizer.state.values():
                for v in state.values():
                    mark(v, Kind.OPTIMIZER_STATE)

    # ---- the plain step (Note [Plain step]) -------------------------------------------------
    def _plain_wanted(self) -> bool:
        if self.plain_steps == 0:
            self._plain_note = "not asked for (plain_steps 0)"
            return False
        if self.runtime is not None:
            self._plain_note = (
                "traced under a budget: the runtime's passive mode stays in every iteration"
            )
            return False
        if world()[1] > 1:
            self._plain_note = (
                "under torchrun: every rank stops where its recording ends, all at one step"
            )
            return False
        return True

    def _plain_step(self) -> None:
        """An optimizer step (or ``capuchin.step()``) after the recorded iterations."""
        if self._plain_state == "warm-up":
            if not self._mode_on or _get_current_dispatch_mode() is not self._mode:
                self._plain_state = "done"
                self._plain_note = "another dispatch mode was above the tracer's"
                return  # the next iteration's first op stops the script
            self._mode_on = False
            self._mode.__exit__(None, None, None)
            self._chunks.__exit__(None, None, None)  # the plain step is the script's own
            self._plain_state = "steps"
            self._schedule = self._steps_schedule()
            self._begin_step()
        elif self._plain_state == "steps":
            phase = self._phase
            self._timing_phase = phase
            end = self._now()
            self._timing_phase = None
            if phase == "plain~":  # untimed, kept to show it (Note [Plain step])
                self._plain_warmup_s = end - self._step_start
            if self._end_step(phase) and not phase.endswith("~"):
                if phase == "plain":
                    self._rounds.append({})
                    probed = any(k in _PROBE_PHASES for r in self._rounds for k in r)
                    (self._plain_after_probe if probed else self._plain_before_probe).append(
                        end - self._step_start
                    )
                if self._rounds:
                    self._rounds[-1][phase] = end - self._step_start
                    if phase in ("hot", "guarded"):  # ops the runtime sent down its slow path
                        self._rounds[-1][f"{phase} slow calls"] = self._probe_slow_calls
            self._schedule.pop(0)
            if not self._schedule:
                self._plain_state = "done"
                raise StopScript()
            self._begin_step()

    def _steps_schedule(self) -> list[str]:
        """The phases of the steps after the plain warm-up (Note [Plain step]): ``plain``
        (no mode), ``count`` (``_CountingMode``), ``hot`` and ``slow`` (the runtime probe
        without actions and with one at every op); a ``~`` marks an untimed warm-up. Rounds
        begin with a plain step, so each figure is a difference within one round."""
        n = self.plain_steps
        first = ["plain~"]  # the first step without the mode is a warm-up (Note [Plain step])
        if torch._C._len_torch_dispatch_stack():
            return first + ["plain"] * n  # a mode of the script's is on
        # on CUDA too: what the runtime's host work adds to a step there is what the probe's
        # steps measure (Note [Host work on CUDA] in planner/costs.py)
        if self.runtime_probe is None or not self.recorded:
            return first + ["plain", "count"] * n
        return (
            first
            + ["plain"] * (n - 1)  # the baseline's steps before any probe (Note [Plain step])
            + ["plain", "hot~", "hot", "guarded", "slow"]
            + ["plain", "hot", "guarded", "slow"] * (n - 1)
        )

    def _degrade(self, keep_current: bool) -> None:
        """The runtime probe cannot run or does not follow the recorded ops: the steps still to
        run (with the current one unless ``keep_current``) time a passthrough mode instead
        (Note [The runtime in the script's steps])."""
        head = self._schedule[:1] if keep_current else []
        rest = self._schedule[len(head) :]
        self._schedule = head + [
            "count" if p == "hot" else p for p in rest if p not in ("hot~", "guarded", "slow")
        ]
        for r in self._rounds:
            for p in ("hot", "guarded", "slow"):
                r.pop(p, None)

    def _begin_step(self) -> None:
        """Open the next phase of the schedule, then mark the step's start."""
        if not self._schedule:
            self._plain_state = "done"
            raise StopScript()
        phase = self._schedule[0]
        if phase == "count":
            self._pt = self._pt or _CountingMode()
            self._pt.__enter__()
            self._pt_steps += 1
        elif phase.rstrip("~") != "plain" and not self._start_probe(phase.rstrip("~")):
            self._degrade(keep_current=False)
            return self._begin_step()
        self._phase = phase
        self._step_start = self._now()

    def _end_step(self, phase: str, *exc, ended: bool = False) -> bool:
        """Close the phase of the step that ended; False where its time is not to be used (a
        probe that did not follow the recorded ops; ``ended``: the script ended inside the
        step, which is no step to time)."""
        if phase == "count":
            self._pt.__exit__(None, None, None)
            return True
        if phase.rstrip("~") == "plain":
            return True
        ok = self._end_probe(*exc, ended=ended)
        if not ok and phase == "hot~":
            self._degrade(keep_current=True)
        return ok

    def _start_probe(self, path: str) -> bool:
        """Enter the runtime probe from the step hook (Note [The runtime in the script's steps]
        in runtime/calibrate.py); False where there is none or it cannot start."""
        if self.runtime_probe is None or not self.recorded:
            return False
        if self._probe_ops is None:
            self._probe_ops = [
                [name, shape_signature(s[4] for s in ins)]
                for (_, name, _, _, _, ins, _) in self._done[self.recorded[-1]].ops
            ]
        try:
            self._probe = self.runtime_probe(
                self._probe_ops, self.indexer, path, self.device
            ).__enter__()
        except Exception as e:  # the trace does not depend on it: no figure
            self._probe = None
            self._probe_note = f"the runtime probe did not start ({e})"
            return False
        return True

    def _end_probe(self, *exc, ended: bool = False) -> bool:
        """Leave the probe; True when its step followed the recorded ops (else
        ``_probe_note`` says why)."""
        probe, self._probe = self._probe, None
        if probe is None:
            return False
        self._probe_slow_calls = probe.slow_calls
        try:
            probe.__exit__(*(exc or (None, None, None)))
        except Exception as e:
            self._probe_note = f"the runtime probe failed ({e})"
            return False
        if ended:
            return False
        if probe.steady(1):
            return True
        self._probe_note = (
            "an iteration under the runtime probe did not follow the recorded ops (another kind "
            "of iteration or other shapes)"
        )
        return False

    def _now(self) -> float:
        if self.device == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize()
        return time.perf_counter()

    def _plain_iteration_ns(self) -> int | None:
        """The median plain step (ns), or None (and ``log`` says why)."""
        steps = self._baseline_steps()
        if steps:
            ns = int(round(statistics.median(steps) * 1e9))
            self.log(
                f"capuchin: plain step {ns / 1e6:.2f} ms (median of {len(steps)} iteration(s) "
                "after the recorded ones, without the tracer or the profiler)"
            )
            return ns
        if self._plain_note is None:
            # the traced iterations, the plain warm-up, the untimed plain step, one timed
            need = self.warmup + self.iterations + 3
            self._plain_note = (
                f"the script ended before a plain iteration could be timed (it needs at least "
                f"{need} optimizer steps)"
            )
        if self.plain_steps > 0:
            self.log(
                f"capuchin: note: plain step not timed: {self._plain_note}; plans will state "
                "their overhead against the traced iteration, whose op times the profiler inflates"
            )
        return None

    def _calibrate(self, plain_ns: int | None, extra: dict) -> dict | None:
        """The runtime's host costs in this script on this host (Note [Calibrated host costs] in
        planner/costs.py), as ``TraceMeta.host_costs``: the per-op cost of a dispatch mode, from
        the steps timed through ``_CountingMode`` after the plain ones, and what
        ``calibrate_host`` times (the slow path, swaps, replays); None (and
        ``extra["host_costs_note"]`` says why) where nothing was measured or every figure came
        out at 0 or below (noise)."""
        costs = dict(self._hot_path(plain_ns, extra) or {})
        if plain_ns is not None and self.device == "cpu" and self.calibrate_host is not None:
            nbytes = self._typical_bytes()
            bw = self.bandwidth
            per_byte = tuple(
                1e9 / b if b else 0.0 for b in (bw.d2h_bytes_per_s, bw.h2d_bytes_per_s)
            )
            found, lines = self.calibrate_host(nbytes, per_byte)
            extra["host_calibration_ns"] = lines
            found = {k: int(v) for k, v in found.items() if int(v) > 0}
            costs.update(found)
            self.log(
                "capuchin: the runtime's host costs measured now: "
                + (", ".join(f"{k} {v / 1e3:.1f} us" for k, v in sorted(found.items())) or "none")
            )
        return costs or None

    def _typical_bytes(self) -> int:
        """The median size of the storages the recorded iteration allocated on the device, within
        64 KiB-64 MiB: what a swap of this script typically moves."""
        sizes = [
            o[3] for op in self._done[self.recorded[-1]].ops for o in op[6] if o[7] and o[3] > 0
        ]
        mid = int(statistics.median(sizes)) if sizes else 1 << 20
        return min(max(mid, 64 << 10), 64 << 20)

    def _baseline_steps(self) -> list[float]:
        """The plain steps the baseline takes (Note [Plain step]): those before any probe step
        where the probe ran, else every plain step."""
        return self._plain_before_probe or self._phase_times("plain")

    def _phase_times(self, phase: str) -> list[float]:
        return [r[phase] for r in self._rounds if phase in r]

    def _hot_path(self, plain_ns: int | None, extra: dict) -> dict | None:
        """``hot_op_ns`` (and ``slow_op_script_ns``) from the rounds of steps after the plain
        warm-up (Note [Plain step]): the median within-round difference of the runtime probe
        (Note [The runtime in the script's steps] in runtime/calibrate.py) or, without it, of
        ``_CountingMode``'s step over the plain step, and of the slow path's over the hot
        path, per op of the recorded iteration; ``guarded_op_ns`` by ``_guarded_ns``."""
        if self._probe_note is not None:
            extra["runtime_probe_note"] = self._probe_note
        base, what = ("hot", "the runtime without actions")
        if not self._phase_times("hot"):
            base, what = ("count", "a dispatch mode")
        pairs = [(r["plain"], r[base]) for r in self._rounds if base in r and "plain" in r]
        if base == "hot":
            extra["runtime_probe_wall_s"] = [round(x, 6) for x in self._phase_times("hot")]
        elif pairs:
            extra["mode_iteration_wall_s"] = [round(x, 6) for x in self._phase_times("count")]
            extra["mode_iteration_calls"] = round(self._pt.ops / max(1, self._pt_steps), 1)
        if plain_ns is None or not pairs:
            if plain_ns is not None and self.device == "cpu":
                extra["host_costs_note"] = (
                    "the script ended before the steps through a dispatch mode were timed"
                )
            return None
        # per op of the recorded iteration, as the planner charges it (``runtime_cost_ns``: every
        # op of the planned iteration); the calls the trace does not index are in the figure
        ops = max(1, len(self._done[self.recorded[-1]].ops))
        extra_s = statistics.median(b - a for a, b in pairs)
        hot_ns = int(round(extra_s / ops * 1e9))
        if hot_ns <= 0:
            extra["host_costs_note"] = (
                f"the steps through {what} took no longer than the plain ones "
                f"({extra_s * 1e3:.2f} ms a step, the median difference in {len(pairs)} "
                "round(s)): noise; not used"
            )
            return None
        self.log(
            f"capuchin: {what} costs {hot_ns / 1e3:.1f} us per op in this script ({ops:.0f} ops "
            f"a step, {extra_s * 1e3:.2f} ms a step over the plain one; the runtime's host costs "
            "are charged at this speed)"
        )
        found = {"hot_op_ns": hot_ns}
        slow_pairs = [(r["hot"], r["slow"]) for r in self._rounds if "hot" in r and "slow" in r]
        if slow_pairs:
            extra["runtime_probe_slow_wall_s"] = [round(b, 6) for _, b in slow_pairs]
            more = statistics.median(b - a for a, b in slow_pairs)
            slow_ns = int(round(more / ops * 1e9))
            if slow_ns > 0:
                found["slow_op_script_ns"] = slow_ns
                self.log(
                    f"capuchin: the runtime's slow path costs {slow_ns / 1e3:.1f} us more per op "
                    f"in this script ({more * 1e3:.2f} ms a step with an action at every op)"
                )
            else:
                extra["runtime_probe_note"] = (
                    f"the steps with an action at every op took no longer than without "
                    f"({more * 1e3:.2f} ms a step, the median difference): noise; not used"
                )
        guarded = self._guarded_ns(ops, found.get("slow_op_script_ns"), extra)
        if guarded is not None:
            found["guarded_op_ns"] = guarded
        return found

    def _guarded_ns(self, ops: int, slow_ns: int | None, extra: dict) -> int | None:
        """``guarded_op_ns``: what an op costs on the guarded hot path beyond the hot path, per
        op that stays on it, from the rounds' guarded steps (Note [The runtime in the script's
        steps] in runtime/calibrate.py): the ops that write in place leave it for the slow
        path, charged at ``slow_ns`` (the difference in the probe's slow-path calls)."""
        keys = ("hot", "guarded", "hot slow calls", "guarded slow calls")
        rounds = [r for r in self._rounds if all(k in r for k in keys)]
        if not rounds or slow_ns is None:
            return None
        extra["runtime_probe_guarded_wall_s"] = [round(r["guarded"], 6) for r in rounds]
        extra["runtime_probe_slow_calls"] = [
            [r["hot slow calls"], r["guarded slow calls"]] for r in rounds
        ]
        per_op = []
        for r in rounds:
            moved = max(0, r["guarded slow calls"] - r["hot slow calls"])
            rest = (r["guarded"] - r["hot"]) * 1e9 - moved * slow_ns
            per_op.append(rest / max(1, ops - moved))
        ns = int(round(statistics.median(per_op)))
        if ns <= 0:
            extra["runtime_probe_guarded_note"] = (
                "the guarded steps took no longer than the hot ones: noise; not used"
            )
            return None
        self.log(f"capuchin: the runtime's guarded hot path costs {ns / 1e3:.1f} us more per op")
        return ns

    # ---- profiler ---------------------------------------------------------------------------
    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device == "cuda":  # pragma: no cover - needs a GPU
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities, profile_memory=True)
        start_profiler_quietly(self.profiler.start)  # Note [Profiler noise] in timing.py
        self._profiling = True

    def _stop_profiler(self) -> None:
        if self.profiler is not None and getattr(self, "_profiling", False):
            self._profiling = False
            if self.device == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.synchronize()
            with profiler_quiet():
                self.profiler.stop()

    # ---- per-op recording -------------------------------------------------------------------
    def _record_op(self, op: OpEvent) -> None:
        written = op.written
        info = op.info
        if info.hop and replay_refusal(info.seeded, info.region_writes, self.device) is None:
            self._replayable_regions.add(info.name)
        if info.hop and op.phase is Phase.FORWARD and info.name not in self._region_outputs:
            from .region_tags import region_output_names

            self._region_outputs[info.name] = region_output_names(op.args[0])
        ins = []
        for a, t in enumerate(op.inputs):
            rec = op.input_storages[a]
            is_param = isinstance(t, torch.nn.Parameter)
            if is_param:
                self._params_seen.setdefault(id(t), t)
            ins.append(
                (
                    op.input_ids[a],
                    rec.name if rec is not None else "",
                    _tensor_bytes(t),
                    rec.nbytes if rec is not None else 0,
                    tuple(t.shape),
                    _dtype(t.dtype),
                    t._is_view(),
                    a in written,
                    is_param,
                )
            )
        outs = []
        for j, t in enumerate(op.outputs):
            rec = op.output_storages[j]
            on_device = rec is not None and rec.device_type == self.device
            outs.append(
                (
                    op.output_ids[j],
                    rec.name if rec is not None else "",
                    _tensor_bytes(t),
                    rec.nbytes if rec is not None else 0,
                    tuple(t.shape),
                    _dtype(t.dtype),
                    t._is_view(),
                    op.output_alloc[j] and on_device,
                    op.output_aliases[j],
                )
            )
        self._cur.ops.append(
            (
                op.index,
                op.info.name,
                op.phase.value,
                op.info.seeded,
                describe_args(op.args, op.kwargs),
                ins,
                outs,
            )
        )

    # ---- building the file -------------------------------------------------------------------
    def _write(self) -> None:
        requested = self.iterations
        if not self.recorded:
            if self.indexer.steps_seen == 0:
                raise ScriptError(
                    f"{self.script}: no iteration: the script never called optimizer.step() "
                    "(torch.optim) nor capuchin.step(), so there is nothing to delimit and record"
                )
            raise TooFewStepsError(
                self.indexer.steps_seen,
                f"{self.script}: the script ended after {self.indexer.steps_seen} optimizer "
                f"step(s), all within the {self.warmup} warm-up iteration(s); nothing was "
                "recorded (lower --warmup or let it train longer)",
            )
        if len(self.recorded) < requested:
            self.log(
                f"capuchin: warning: the script ended after {len(self.recorded)} of "
                f"{requested} recorded iterations; writing those"
            )
        self._check_not_empty()
        if self.bandwidth is None:
            self.bandwidth = measure_bandwidth(self.device)
        times = parse_profile(self.profiler, self.device) if self.profiler is not None else None
        frames = [self._rows(self._done[it], times) for it in self.recorded]
        events = pd.concat(frames, ignore_index=True)
        regular, divergence = _regularity(self._done, self.recorded)
        extra = {
            "requested_iterations": requested,
            "timeline": "cuda-kernels" if self.device == "cuda" else "cpu-ops-back-to-back",
            "bandwidth_method": self.bandwidth.method,
            "allocator_peak_bytes": {
                str(k): v for k, v in (times.allocator_peak_bytes if times else {}).items()
            },
            "iteration_wall_s": {
                str(it): round(self._done[it].elapsed_s, 6) for it in self.recorded
            },
        }
        plain_ns = self._plain_iteration_ns()
        host_costs = self._calibrate(plain_ns, extra)
        if self._plain_warmup_s is not None:
            extra["plain_warmup_wall_s"] = round(self._plain_warmup_s, 6)
        if self._phase_times("plain"):
            extra["plain_iteration_wall_s"] = [round(x, 6) for x in self._baseline_steps()]
            if self._plain_after_probe:
                extra["plain_after_probe_wall_s"] = [round(x, 6) for x in self._plain_after_probe]
        elif self._plain_note is not None:
            extra["plain_iteration_note"] = self._plain_note
        measured = None
        if self.runtime is not None:
            measured = self._measured_peak(times)
            its = [s for s in self.runtime.report.iterations if s.iteration in self._done]
            extra["passive_evictions"] = {str(s.iteration): s.passive_evictions for s in its}
            extra["passive_short_bytes"] = {str(s.iteration): s.passive_short_bytes for s in its}
            if measured is not None and measured > 1.05 * self.budget_bytes:
                # Not an error: the trace is the unmanaged program's either way; but a cap the
                # run did not keep is said where it happened, not only by `capuchin show`.
                self.log(
                    f"capuchin: warning: the trace cap {format_bytes(self.budget_bytes)} was "
                    f"not kept: the allocator measured {format_bytes(measured)} "
                    f"({measured / self.budget_bytes:.2f}x); parameters, gradients, "
                    "optimizer state and each op's own inputs and outputs stay resident"
                )
        if self.device == "cuda":  # pragma: no cover - needs a GPU
            # PyTorch's own measurement of each iteration (blocks rounded to 512 bytes; includes
            # memory no op touched, e.g. the cuBLAS workspace, so compare the rise above start)
            extra["cuda_memory_allocated_bytes"] = {
                str(it): {
                    "start": self._done[it].cuda_start_allocated_bytes,
                    "max": self._done[it].cuda_max_allocated_bytes,
                }
                for it in self.recorded
            }
            # Note [Budget and the allocator] (runtime/device.py): what no row counts
            extra["cuda_non_tensor_bytes"] = max(
                non_tensor_at_start(self._done[it]) for it in self.recorded
            )
        meta = TraceMeta(
            capuchin_version=__version__,
            torch_version=torch.__version__,
            device=self.device,
            device_name=_device_name(self.device),
            bandwidth_d2h_bytes_per_s=self.bandwidth.d2h_bytes_per_s,
            bandwidth_h2d_bytes_per_s=self.bandwidth.h2d_bytes_per_s,
            iterations=list(self.recorded),
            warmup=self.warmup,
            script=str(self.script),
            argv=[str(a) for a in self.argv],
            date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            regular=regular,
            first_divergence=divergence,
            steady_iteration=self.recorded[-1],
            trace_budget_bytes=self.budget_bytes,
            measured_peak_bytes=measured,
            plain_iteration_ns=plain_ns,
            replayable_regions=sorted(self._replayable_regions),
            region_candidates=self._region_candidates(),
            region_tags=self.region_tags,
            host_costs=host_costs,
            extra=extra,
        )
        write_trace(events, meta, self.path, force=self.force)

    def _region_candidates(self) -> dict:
        """Note [Region tags] in region_tags.py: the forward regions' candidates."""
        if not self._region_outputs:
            return {}
        from .region_tags import region_candidates

        return region_candidates(self._recorded_partitioner, self._region_outputs)

    def _check_not_empty(self) -> None:
        """Refuse a trace in which the traced device holds no storage (Note [Auto device])."""
        for it in self.recorded:
            cur = self._done[it]
            if cur.residents or any(o[7] for op in cur.ops for o in op[6]):
                return
        live = self._live_devices
        if live is None:  # the script ended in a recorded iteration: its tensors now
            live = {r.device_type for r in self.indexer.live.values()}
        others = sorted(live - {self.device, "meta"})
        hint = f" (its tensors live on {', '.join(others)}: --device {others[0]})" if others else ""
        raise CapuchinError(
            f"{self.script}: nothing was allocated on {self.device} in the recorded iterations"
            f"{hint}; no trace written"
        )

    def _measured_peak(self, times) -> int | None:
        """The most device memory the allocator held during the recorded iterations (Note
        [Tracing under a budget])."""
        if self.device == "cuda":  # pragma: no cover - needs a GPU
            # tensor bytes, as the cap's budget counts them and a run measures its peaks:
            # the allocator's less what the runtime takes as non-tensor (Note [Budget and the
            # allocator] in runtime/device.py; on the H200 two 32 MiB cuBLAS workspaces)
            off = getattr(self.runtime, "non_tensor_bytes", 0) or 0
            peaks = [self._done[it].cuda_max_allocated_bytes for it in self.recorded]
            return max((max(0, p - off) for p in peaks if p is not None), default=None)
        peaks = times.live_peak_bytes if times is not None else {}
        return max((peaks[it] for it in self.recorded if it in peaks), default=None)

    def _rows(self, cur: _Iteration, times) -> pd.DataFrame:
        it = cur.number
        op_times = times.op_times if times is not None else {}
        op_peaks = times.op_alloc_peak_bytes if times is not None else {}
        kinds = dict(cur.kinds)
        allocated = set()
        first_role: dict[str, str] = {}
        for _, _, _, _, _, ins, outs in cur.ops:
            for _, sid, _, _, _, _, _, written, is_param in ins:
                first_role.setdefault(sid, Role.WRITE.value if written else Role.INPUT.value)
                if is_param:
                    kinds.setdefault(sid, Kind.PARAMETER)
            for _, sid, _, _, _, _, _, alloc, _ in outs:
                first_role.setdefault(sid, Role.OUTPUT.value)
                if alloc:
                    allocated.add(sid)

        def kind_of(sid: str) -> str:
            k = kinds.get(sid)
            if k is not None:
                return k.value
            if sid in allocated:
                return Kind.ACTIVATION.value
            role = first_role.get(sid)
            if role == Role.INPUT.value:
                return Kind.INPUT.value
            return Kind.OTHER.value

        cols: dict[str, list] = {c: [] for c in COLUMNS}

        def row(
            op_index,
            role,
            sid,
            storage_bytes,
            name=None,
            phase=None,
            arg=-1,
            tid=None,
            alloc=None,
            alias=None,
            view_of=None,
            nbytes=None,
            shape=None,
            dtype=None,
            start=None,
            dur=None,
            seeded=None,
            op_args=None,
        ):
            cols[Col.ITERATION].append(it)
            cols[Col.EVENT].append(len(cols[Col.EVENT]))
            cols[Col.OP].append(op_index)
            cols[Col.OP_NAME].append(name)
            cols[Col.PHASE].append(phase)
            cols[Col.ROLE].append(role)
            cols[Col.ARG].append(arg)
            cols[Col.TENSOR].append(tid)
            cols[Col.STORAGE].append(sid)
            cols[Col.ALLOC].append(alloc)
            cols[Col.ALIASES].append(alias)
            cols[Col.VIEW_OF].append(view_of)
            cols[Col.BYTES].append(nbytes)
            cols[Col.STORAGE_BYTES].append(storage_bytes)
            cols[Col.SHAPE].append(list(shape) if shape is not None else None)
            cols[Col.DTYPE].append(dtype)
            cols[Col.KIND].append(kind_of(sid))
            cols[Col.START_NS].append(start)
            cols[Col.DURATION_NS].append(dur)
            cols[Col.SEEDED].append(seeded)
            cols[Col.OP_ARGS].append(op_args)

        for sid, nbytes in cur.residents:
            row(-1, Role.RESIDENT.value, sid, nbytes)
        frees = sorted(cur.frees, key=lambda f: f[0])  # stable: keeps release order within an op
        fi = 0
        while fi < len(frees) and frees[fi][0] < 0:
            row(-1, Role.FREE.value, frees[fi][1], frees[fi][2])
            fi += 1
        for k, name, phase, seeded, op_args, ins, outs in cur.ops:
            start, dur = op_times.get((it, k), (None, None))
            common = dict(
                name=name, phase=phase, start=start, dur=dur, seeded=seeded, op_args=op_args
            )
            for a, (tid, sid, nbytes, sbytes, shape, dtype, is_view, written, _) in enumerate(ins):
                row(
                    k,
                    Role.WRITE.value if written else Role.INPUT.value,
                    sid,
                    sbytes,
                    arg=a,
                    tid=tid,
                    view_of=sid if is_view else None,
                    nbytes=nbytes,
                    shape=shape,
                    dtype=dtype,
                    **common,
                )
            for j, (tid, sid, nbytes, sbytes, shape, dtype, is_view, alloc, alias) in enumerate(
                outs
            ):
                row(
                    k,
                    Role.OUTPUT.value,
                    sid,
                    sbytes,
                    arg=j,
                    tid=tid,
                    alloc=bool(alloc),
                    alias=alias,
                    view_of=sid if is_view else None,
                    nbytes=nbytes,
                    shape=shape,
                    dtype=dtype,
                    **common,
                )
            peak = op_peaks.get((it, k))
            if peak is not None:
                scratch = peak - sum(o[3] for o in outs if o[7])
                if scratch > 0:
                    row(k, Role.SCRATCH.value, scratch_id(k), scratch, **common)
            while fi < len(frees) and frees[fi][0] <= k:
                row(k, Role.FREE.value, frees[fi][1], frees[fi][2], name=name, phase=phase)
                fi += 1
        for f in frees[fi:]:  # released after the last op (before the next iteration's first op)
            row(f[0], Role.FREE.value, f[1], f[2])
        return pd.DataFrame(cols)


_PROBE_PHASES = ("hot", "guarded", "slow")  # the runtime probe's timed steps (Note [Plain step])


def non_tensor_at_start(cur: _Iteration) -> int:
    """Device bytes the allocator held at an iteration's start beyond its resident storages
    (cuBLAS workspaces, allocator rounding): what a budget of tensor bytes does not count."""
    if cur.cuda_start_allocated_bytes is None:
        return 0
    return max(0, cur.cuda_start_allocated_bytes - sum(n for _, n in cur.residents))


def _regularity(done: dict[int, _Iteration], recorded: list[int]) -> tuple[bool, dict | None]:
    """Do the recorded iterations have identical op sequences (name, phase, input shapes)?"""

    def signature(cur: _Iteration) -> list[str]:
        return [
            f"{name} {phase} [{shape_signature(s[4] for s in ins)}]"
            for (_, name, phase, _, _, ins, _) in cur.ops
        ]

    if len(recorded) < 2:
        return True, None
    ref = signature(done[recorded[0]])
    for it in recorded[1:]:
        sig = signature(done[it])
        for k in range(max(len(ref), len(sig))):
            a = ref[k] if k < len(ref) else "<end of iteration>"
            b = sig[k] if k < len(sig) else "<end of iteration>"
            if a != b:
                return False, {
                    "iteration": it,
                    "op_index": k,
                    "expected": a,
                    "got": b,
                    "reference_iteration": recorded[0],
                }
    return True, None


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_DTYPE_NAMES: dict = {}


def _dtype(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _device_name(device: str) -> str:
    if device == "cuda":  # pragma: no cover - needs a GPU
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


__all__ = ["Tracer", "StopScript", "resolve_device", "Phase"]
