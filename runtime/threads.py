"""Ops from threads other than the one that trains.

# Note: [Other threads]
# The tracker's dispatch mode is thread-local, so the ops of another thread the script starts (an
# EMA, a logger, a checkpoint uploader reading the parameters) passed it by and read storages the
# training thread kept evicted (0 bytes): a segfault. While a ``Runtime`` is entered, every thread
# started through ``threading.Thread`` (capuchin's own copy threads aside) runs under a
# ``ForeignMode``: each of its ops brings its evicted inputs back first, counts the writes it
# makes (rules R2/R3 in recompute.py), and runs holding ``LOCK``. The training thread holds
# ``LOCK`` for each op of its slow path and for every restore of all storages: those are the only
# places where storages are evicted or their bytes freed (the hot path evicts nothing, and lets
# no op read an evicted storage: Note [Hot path] in tracker.py), so no storage a foreign op
# reads loses its bytes while the op runs. A foreign op is no op of the iteration: it takes no
# op index, follows no plan, and what it allocates is not counted; what it brought back stays
# resident until the training thread evicts it again. Threads started before the runtime was
# entered are not seen, nor threads of a forked process (a DataLoader worker).
# Training in another thread (its optimizer step) is refused with one line at the step
# (``refuse_step``): the runtime follows one thread's op sequence, the one that entered it.
"""

from __future__ import annotations

import os
import threading

from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ScriptError


class _Lock:
    """A re-entrant lock that a forked child gets anew, free: a DataLoader worker forked while
    another thread held it would otherwise wait for it forever (its dispatch mode, inherited with
    the forking thread's state, takes it on its slow path)."""

    def __init__(self):
        self._lock = threading.RLock()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()

    def reset(self) -> None:
        self._lock = threading.RLock()


LOCK = _Lock()
os.register_at_fork(after_in_child=LOCK.reset)
_active: list = []  # (runtime, executor) of the entered runtimes
_orig_bootstrap = None
_pid = 0  # the process that installed it (a forked DataLoader worker inherits the patch)
_INTERNAL = ("capuchin-",)  # thread names of capuchin's own threads (runtime/backend.py)


class ForeignMode(TorchDispatchMode):
    """The dispatch mode of a thread that does not train (Note [Other threads])."""

    supports_higher_order_operators = True  # compiled regions (Note [torch.compile])

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Dynamo compiles under the mode (Note [torch.compile] in tracer/compiled.py)

    def __init__(self, executor):
        super().__init__()
        self.ex = executor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(e is self.ex for _, e in _active):  # the runtime exited: nothing is evicted
            return func(*args, **kwargs)
        with LOCK:
            self.ex.foreign_op(func, args, kwargs)
            return func(*args, **kwargs)


class ForeignTraining(ScriptError):
    """An optimizer step in a thread other than the one that entered the runtime."""


def _bootstrap_inner(self):
    if not _active or self.name.startswith(_INTERNAL) or os.getpid() != _pid:
        return _orig_bootstrap(self)
    rt, ex = _active[-1]
    mode = ForeignMode(ex)
    run = self.run

    def managed_run():
        with mode:
            try:
                run()
            except ForeignTraining as exc:  # raised again when the runtime exits, as one line
                rt.refusal = rt.refusal or exc

    self.run = managed_run
    return _orig_bootstrap(self)


def install(runtime, executor) -> None:
    global _orig_bootstrap, _pid
    if _orig_bootstrap is None:
        _pid = os.getpid()
        _orig_bootstrap = threading.Thread._bootstrap_inner
        threading.Thread._bootstrap_inner = _bootstrap_inner
    _active.append((runtime, executor))


def uninstall(runtime) -> None:
    global _orig_bootstrap
    _active[:] = [(r, e) for r, e in _active if r is not runtime]
    if not _active and _orig_bootstrap is not None:
        threading.Thread._bootstrap_inner = _orig_bootstrap
        _orig_bootstrap = None


_pid = 0  # the process that installed it (a forked DataLoader worker inherits the patch)


def refuse_step(runtime) -> None:
    """An optimizer step began: refuse it in any thread but the runtime's own."""
    if threading.get_ident() != runtime.thread_id:
        raise ForeignTraining(
            f"optimizer.step() ran in thread {threading.current_thread().name!r}, not in the "
            "thread that started capuchin: training in another thread is not managed; run the "
            "training loop in the main thread"
        )
