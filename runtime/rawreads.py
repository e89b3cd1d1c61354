"""Reads of a tensor's bytes that pass through no op: ``Tensor.numpy()`` (and ``__array__``,
``np.asarray``), ``tolist()``, ``data_ptr()``, ``__dlpack__()`` and, on the storage that
``untyped_storage()`` returns, ``data_ptr()`` and ``tolist()``. While a ``Runtime`` is entered
they bring an evicted storage back first; those that hand out the address of the bytes also
expose the storage.

# Note: [Raw reads]
# An evicted storage comes back when an op reads it (the tracker sees every op). A raw read sees
# no op: on a storage the runtime keeps out (a wrap-around swap across the step, a dynamic-mode
# eviction of a tensor made after the step) it returned whatever memory was at the old address,
# and ``numpy()`` on a 0-byte storage made it non-resizable, so its restore then failed. So these
# methods restore the storage before they run. Those that hand out the address of the bytes,
# which the script may keep and read later (``numpy()``'s array shares them, ``data_ptr()``,
# ``__dlpack__()``, the storage's ``data_ptr()``), also *expose* it: an exposed storage is never
# evicted again (``evictable`` in state.py), since eviction frees the bytes and a restore puts
# them at a new address. A copy (``tolist()``) restores only. ``untyped_storage()`` itself
# restores nothing: the storage object is a handle (an evicted one's ``nbytes()`` is 0); the
# bytes are read through its ``data_ptr()`` or ``tolist()``.
# Only calls from the script's code count: with a dispatch mode on the calling thread's stack
# (the runtime's, or ``ForeignMode`` in another thread of the script: Note [Other threads] in
# threads.py) (the runtime's own calls run with the modes off: Note [Runtime-internal ops]
# in state.py). ``torch.save`` restores everything itself (Note [Reads outside ops] in
# engine.py) and exposes nothing: it copies the bytes and keeps no address.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from .state import expose
from .threads import LOCK

_TENSOR_METHODS = {  # name -> exposes the storage
    "numpy": True,
    "data_ptr": True,
    "__dlpack__": True,
    "tolist": False,
}
_STORAGE_METHODS = {"data_ptr": True, "tolist": False}

_active: list = []  # executors of the entered runtimes
_orig: dict = {}
_quiet = threading.local()  # inside torch.save: restore, never expose
_storage_of = torch._C.TensorBase.untyped_storage
_pid = 0  # the process that installed them (a forked DataLoader worker inherits the patch)


def _script_call() -> bool:
    return bool(_active) and torch._C._len_torch_dispatch_stack() > 0 and os.getpid() == _pid


def _before_read(st, exposes: bool) -> None:
    key = st._cdata
    for ex in _active:
        ex.restore_for_read(key)
    if exposes and not getattr(_quiet, "on", False):
        expose(st)


def _tensor_wrapper(name: str, orig, exposes: bool):
    def method(self, *args, **kwargs):
        if not _script_call():
            return orig(self, *args, **kwargs)
        try:
            st = _storage_of(self)
        except (RuntimeError, NotImplementedError, TypeError):
            return orig(self, *args, **kwargs)
        with LOCK:  # no eviction between the restore and the read (Note [Other threads])
            _before_read(st, exposes)
            return orig(self, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = orig.__doc__
    return method


def _storage_wrapper(name: str, orig, exposes: bool):
    def method(self, *args, **kwargs):
        if not _script_call():
            return orig(self, *args, **kwargs)
        with LOCK:
            _before_read(self, exposes)
            return orig(self, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = orig.__doc__
    return method


def install(executor) -> None:
    """Route raw reads through ``executor`` (Note [Raw reads]) until ``uninstall``."""
    global _pid
    if not _orig:
        _pid = os.getpid()
        for name, exposes in _TENSOR_METHODS.items():
            orig = torch.Tensor.__dict__.get(name)
            _orig[(torch.Tensor, name)] = orig
            setattr(torch.Tensor, name, _tensor_wrapper(name, getattr(torch.Tensor, name), exposes))
        for name, exposes in _STORAGE_METHODS.items():
            cls = torch.UntypedStorage
            _orig[(cls, name)] = cls.__dict__.get(name)
            setattr(cls, name, _storage_wrapper(name, getattr(cls, name), exposes))
    _active.append(executor)


def uninstall(executor) -> None:
    if executor in _active:
        _active.remove(executor)
    if not _active and _orig:
        for (cls, name), orig in _orig.items():
            if orig is None:
                delattr(cls, name)  # the method was inherited: the base class's again
            else:
                setattr(cls, name, orig)
        _orig.clear()


@contextlib.contextmanager
def quiet():
    """Raw reads inside restore but expose nothing (``torch.save``: it copies the bytes)."""
    prev = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = prev
