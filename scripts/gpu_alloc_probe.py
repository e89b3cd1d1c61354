"""A device probe (CUDA only; `python3 scripts/gpu_alloc_probe.py`): which allocations of a steady training step fall outside aten ops, and
what persistent non-tensor blocks exist after warm-up (cuBLAS/cuBLASLt workspaces)."""

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

dev = "cuda"
torch.cuda.memory._record_memory_history(max_entries=100000)
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(2048, 10)
).to(dev)
opt = torch.optim.Adam(model.parameters())


def step():
    opt.zero_grad()
    model(torch.randn(256, 512, device=dev)).square().mean().backward()
    opt.step()


print("allocated before any step", torch.cuda.memory_allocated())
for _ in range(3):
    step()
torch.cuda.synchronize()
params = sum(p.numel() * 4 for p in model.parameters())
print("allocated after warm-up", torch.cuda.memory_allocated(), "params bytes", params)
snap = torch.cuda.memory._snapshot()
for seg in snap["segments"]:
    for b in seg["blocks"]:
        if b["state"] == "active_allocated" and b["size"] >= 512 * 1024:
            fr = [
                f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}"
                for f in b.get("frames", [])
            ][:6]
            print("ACTIVE", b["size"], seg["stream"], " | ".join(fr))
torch.cuda.memory._record_memory_history(enabled=None)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
    step()
    torch.cuda.synchronize()
t0 = None
stack = list(prof.profiler.kineto_results.experimental_event_tree())
rows = []
while stack:
    n = stack.pop()
    stack.extend(n.children)
    if n.typed[0] == _EventType.Allocation:
        f = n.typed[1]
        if f.device.type != "cuda":
            continue
        chain, p = [], n.parent
        while p is not None and len(chain) < 4:
            chain.append(p.name)
            p = p.parent
        rows.append((n.start_time_ns, f.alloc_size, f.ptr, n.start_tid, chain))
rows.sort()
t0 = rows[0][0] if rows else 0
outside = 0
for t, size, _ptr, tid, chain in rows:
    if abs(size) >= 256 * 1024:
        print(
            f"ALLOC t={(t - t0) / 1e3:9.1f}us {size:>10} tid={tid} {' < '.join(chain) or '(no parent)'}"
        )
    if not any(c.startswith("aten::") for c in chain):
        outside += size
print("bytes allocated outside aten ops (net):", outside)
