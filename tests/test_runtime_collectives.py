"""Passive and dynamic mode never evict a buffer a collective touched (Note [Collectives] in
planner/problem.py): the communication backend may still read it after the op returns (DDP's
asynchronous all-reduce of a gradient bucket), outside any op; a freed bucket there crashed a
DDP rank. One process, a gloo group of one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from capuchin.runtime.engine import Runtime
from capuchin.runtime.state import evictable


@pytest.fixture
def group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_a_collective_s_buffer_is_never_evicted_by_dynamic_mode(group):
    torch.manual_seed(0)
    with Runtime(device="cpu", budget_bytes=1 << 20, measure_memory=False) as rt:
        bucket = torch.randn(1 << 16)  # 256 KiB
        work = dist.all_reduce(bucket, async_op=True)
        # over the budget: dynamic mode evicts what this iteration allocated
        rest = [torch.randn(1 << 16) for _ in range(8)]
        work.wait()
        assert bucket.untyped_storage().nbytes() == bucket.numel() * 4
        assert not evictable(bucket.untyped_storage())
        assert rt._cur.passive_evictions > 0, "dynamic mode evicted others meanwhile"
        total = float(bucket.sum()) + sum(float(t.sum()) for t in rest)
    torch.manual_seed(0)
    bucket = torch.randn(1 << 16)
    dist.all_reduce(bucket)
    rest = [torch.randn(1 << 16) for _ in range(8)]
    assert total == float(bucket.sum()) + sum(float(t.sum()) for t in rest)
