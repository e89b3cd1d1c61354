"""The CUDA backend's copies on CPU (torch.cuda's streams, events and ``record_stream`` replaced by
stand-ins that do nothing): what a copy object keeps alive. Note [A copy keeps no view of the
device storage] in runtime/backend.py: on the H200 a kept device view held a swapped-out storage
alive after the program released it."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from capuchin.runtime.backend import CUDABackend
from capuchin.testing.emulated import emulated_cuda

pytestmark = pytest.mark.emulated


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_event(self, ev):
        pass

    def record_event(self, ev=None):
        return _Event()


class _Event:
    def __init__(self, *a, **k):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


@pytest.fixture
def backend(monkeypatch):
    with emulated_cuda(total_bytes=1 << 30):
        monkeypatch.setattr(torch.cuda, "Stream", _Stream)
        monkeypatch.setattr(torch.cuda, "Event", _Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None, raising=False)
        be = CUDABackend("cuda:0")
        be._pool._make = lambda n: torch.empty(n, dtype=torch.uint8, device="cpu")
        yield be


def _released_storage_dies(make_copy) -> bool:
    t = torch.arange(1024, dtype=torch.float32)
    st = t.untyped_storage()
    dead = []
    weakref.finalize(st, dead.append, True)
    copy = make_copy(st)
    del t, st
    gc.collect()
    alive = not dead
    del copy
    return not alive


def test_a_swap_outs_copy_keeps_no_view_of_the_storage(backend):
    def out(st):
        buf = backend.host_buffer(st.nbytes())
        copy = backend.copy_out(st, buf)
        backend.free_after_copy_out(st, copy)  # evicted: 0 bytes, the copy still referenced
        return copy

    assert _released_storage_dies(out)


def test_a_swap_ins_copy_keeps_no_view_of_the_storage(backend):
    def back(st):
        buf = backend.host_buffer(st.nbytes())
        return backend.copy_in(buf, st)

    assert _released_storage_dies(back)
