"""CUDABackend under forced races (needs a GPU; skipped without one). ``torch.cuda._sleep`` (a
spin kernel) delays the stream that must be waited for; each test has a control that removes
the synchronization under test and must see the race, so a test that cannot see it fails
(review defect 14; from ../shared/gpu-probes/backend_races.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SLEEP = 200_000_000  # cycles: ~0.1 s
N = 64 << 20


def _fresh(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randint(0, 255, (N,), dtype=torch.uint8, device="cuda", generator=g)
    return t, t.clone()


def _swap_out_then_reuse(control: bool) -> bool:
    from capuchin.runtime.backend import CUDABackend

    be = CUDABackend("cuda")
    t, want = _fresh(0)
    st = t.untyped_storage()
    buf = be.host_buffer(st.nbytes())
    orig = torch.Tensor.record_stream
    if control:
        torch.Tensor.record_stream = lambda self, s: None
    try:
        with torch.cuda.stream(be._d2h):
            torch.cuda._sleep(SLEEP)  # the swap-out starts late
        before = torch.cuda.memory_allocated()
        out = be.copy_out(st, buf)
        assert be.free_after_copy_out(st, out)
        assert before - torch.cuda.memory_allocated() >= N  # freed at once, in the count
        x = torch.empty(N, dtype=torch.uint8, device="cuda")  # may reuse the freed block
        x.fill_(0xAB)
        out.wait()
    finally:
        torch.Tensor.record_stream = orig
    ok = torch.equal(buf.to("cuda"), want)
    be.close()
    return ok


def _swap_in_then_read(control: bool) -> bool:
    from capuchin.runtime.backend import CUDABackend

    be = CUDABackend("cuda")
    t, want = _fresh(1)
    st = t.untyped_storage()
    buf = be.host_buffer(st.nbytes())
    out = be.copy_out(st, buf)
    be.free_after_copy_out(st, out)
    out.wait()
    st.resize_(N)
    t.zero_()
    with torch.cuda.stream(be._h2d):
        torch.cuda._sleep(SLEEP)
    cin = be.copy_in(buf, st, after=out)
    if not control:
        be.wait_compute(cin)
    ok = torch.equal(t, want)  # on the compute stream
    torch.cuda.synchronize()
    be.close()
    return ok


def test_swap_out_keeps_its_block_until_the_copy_has_read_it():
    assert _swap_out_then_reuse(control=False)
    assert not _swap_out_then_reuse(control=True), "the control did not race: the test is blind"


def test_swap_in_orders_the_consumer_after_the_copy():
    assert _swap_in_then_read(control=False)
    assert not _swap_in_then_read(control=True), "the control did not race: the test is blind"


def test_a_prefetch_ahead_of_its_consumer_on_the_gpu_is_not_late():
    from capuchin.runtime.backend import CUDABackend

    be = CUDABackend("cuda")
    t, _ = _fresh(2)
    st = t.untyped_storage()
    buf = be.host_buffer(st.nbytes())
    out = be.copy_out(st, buf)
    be.free_after_copy_out(st, out)
    out.wait()
    torch.cuda._sleep(SLEEP)  # the GPU is busy: the host runs ahead
    st.resize_(N)
    cin = be.copy_in(buf, st, after=out)  # waits for the compute stream's point: after sleep
    torch.cuda._sleep(SLEEP)  # ops between the in-trigger and the back-access
    judge = be.judge_late(cin)
    assert not cin.done()  # what the host saw, and why host-side judgement was wrong
    be.wait_compute(cin)
    torch.cuda.synchronize()
    assert judge() is False
    be.close()
