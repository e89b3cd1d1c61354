"""The CPU backend's copies (Note [Inline copies on CPU] in runtime/backend.py): small swap-outs and
synchronous restores on the calling thread, the rest on the copy threads; bytes come back equal
either way, and a failed copy is raised by ``wait``."""

from __future__ import annotations

import pytest
import torch
from capuchin.runtime.backend import INLINE_COPY_MAX_BYTES, CPUBackend


@pytest.mark.parametrize("nbytes", [4096, INLINE_COPY_MAX_BYTES, 4 * INLINE_COPY_MAX_BYTES])
@pytest.mark.parametrize("now", [False, True])
def test_cpu_swap_roundtrip_is_exact(nbytes, now):
    be = CPUBackend()
    try:
        t = torch.randn(nbytes // 4)
        want = t.clone()
        st = t.untyped_storage()
        buf = be.host_buffer(nbytes)
        out = be.copy_out(st, buf)
        if nbytes <= INLINE_COPY_MAX_BYTES:
            assert out.done(), "a small swap-out is complete when copy_out returns"
        out.wait()
        assert be.free_after_copy_out(st, out) and st.nbytes() == 0
        st.resize_(nbytes)
        cin = be.copy_in(buf, st, after=out, now=now)
        if now:
            assert cin.done(), "a synchronous restore is complete when copy_in returns"
        be.wait_compute(cin)
        assert torch.equal(t, want)
    finally:
        be.close()


def test_a_failed_threaded_copy_is_raised_by_wait():
    be = CPUBackend()
    try:

        class _Bad:
            def copy_(self, src):
                raise RuntimeError("copy failed")

        c = be._h2d.submit(_Bad(), torch.empty(4), 16)
        with pytest.raises(RuntimeError, match="copy failed"):
            c.wait()
        with pytest.raises(RuntimeError, match="copy failed"):
            c.wait()  # also once it is known to be done
    finally:
        be.close()


def test_wrapper_subclasses_have_no_storage_to_manage():
    """A wrapper subclass's own storage holds no data (DTensor, FSDP2's sharded parameters):
    copying from it crashed the process when the guard swapped an FSDP2 model's parameters. Only
    the storages of plain tensors are managed; the inner tensors reach the mode as arguments."""
    from capuchin.runtime.state import storages
    from torch.testing._internal.two_tensor import TwoTensor

    plain = torch.randn(2)
    wrapped = TwoTensor(torch.randn(4), torch.randn(4))
    assert [st.data_ptr() for _, st in storages([wrapped, plain])] == [
        plain.untyped_storage().data_ptr()
    ]
