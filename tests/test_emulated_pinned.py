"""The CUDA backend's pinned host buffers (review finding L4, Note [Pinned buffers are powers of
two] in runtime/backend.py): PyTorch's pinned host allocator rounds every block up to a power of
two, so the pool asks for that size itself, reuses a buffer for every size of its class, and
reports what is pinned."""

from __future__ import annotations

import pytest
import torch
from capuchin.runtime.backend import CUDABackend, _HostPool, pinned_size
from capuchin.testing.emulated import emulated_cuda

pytestmark = pytest.mark.emulated


def test_pinned_sizes_are_the_host_allocators_powers_of_two():
    assert [pinned_size(n) for n in (1, 2, 3, 4096, 4097, 3 << 20)] == [
        1,
        2,
        4,
        4096,
        8192,
        4 << 20,
    ]


def test_a_pinned_buffer_serves_every_size_of_its_class():
    pool = _HostPool(lambda n: torch.empty(n, dtype=torch.uint8), pinned_size)
    a = pool.get(3000)
    assert a.numel() == 4096
    pool.put(a)
    assert pool.get(4000) is a  # same class: reused
    assert pool.get(5000).numel() == 8192
    assert pool.allocated_bytes == 4096 + 8192  # what the host allocator pinned


def test_the_cuda_backend_pools_pinned_buffers_by_power_of_two(monkeypatch):
    with emulated_cuda():
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
        be = CUDABackend("cuda:0")
        be._pool._make = lambda n: torch.empty(n, dtype=torch.uint8)  # no pinning on this host
        buf = be.host_buffer(3 << 20)
        assert buf.numel() == 4 << 20 and be.host_pool_bytes == 4 << 20
