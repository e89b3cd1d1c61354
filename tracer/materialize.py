"""Tensors rebuilt from another process (a ``DataLoader`` worker's batch) are invisible to
capuchin's dispatch modes.

# Note: [Batches from workers]
# A batch collated in a ``DataLoader`` worker reaches the main process pickled: unpickling
# rebuilds each tensor on the shared-memory storage the worker filled
# (``torch.multiprocessing.reductions.rebuild_tensor``: ``aten.empty.memory_format`` of 0 bytes,
# then ``aten.set_`` onto that storage). The main process unpickles a batch whenever it receives
# it, so how many such ops an iteration runs depends on the workers' timing (a batch that arrives
# early is unpickled inside an earlier iteration's ``next()``): in a trace they split iterations
# into kinds recorded once each, and in a run they diverge from the plan. They allocate nothing
# and read no bytes, so while a tracer or a runtime is installed the rebuild functions run with
# the dispatch modes off: no op index, no divergence. The rebuilt tensor's storage then appears
# as an input of the op that first reads the batch, as a tensor made before the iteration does.
# The functions are replaced in their module under their own names, so a worker (forked with
# them replaced) pickles references that resolve to them again.
"""

from __future__ import annotations

import functools

import torch.multiprocessing.reductions as _reductions
from torch.utils._python_dispatch import _disable_current_modes

_NAMES = ("rebuild_tensor", "rebuild_cuda_tensor")
_orig: dict = {}
_depth = 0


def _quiet(fn):
    @functools.wraps(fn)
    def rebuild(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return rebuild


def install() -> None:
    global _depth
    _depth += 1
    if _depth == 1:
        for name in _NAMES:
            fn = getattr(_reductions, name, None)
            if fn is not None:
                _orig[name] = fn
                setattr(_reductions, name, _quiet(fn))


def uninstall() -> None:
    global _depth
    if _depth == 0:
        return
    _depth -= 1
    if _depth == 0:
        for name, fn in _orig.items():
            setattr(_reductions, name, fn)
        _orig.clear()
