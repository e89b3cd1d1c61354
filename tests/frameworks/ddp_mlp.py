"""A torchrun job: DistributedDataParallel on CPU with the gloo backend; each rank saves its final
state (model state_dict with gradients, optimizer state_dict) to --out with its rank in the name."""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--out", default=None)
parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
layers = [nn.Linear(64, 256), nn.ReLU()]
for _ in range(6):
    layers += [nn.Linear(256, 256), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(256, 10))
if args.fsdp:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    net = model
else:
    # small buckets: several all-reduces per backward
    # init_sync=False: every rank builds the same model from the same seed. (The broadcast that
    # would check it frees its buffer on a gloo thread, which the CPU profiler does not see:
    # rank 0 would measure 1.6 MiB that is no longer there.)
    net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.5, init_sync=False)
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data
for _ in range(args.steps):
    x = torch.randn(1024, 64, generator=gen)
    y = torch.randint(0, 10, (1024,), generator=gen)
    loss = nn.functional.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
if args.out:
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state.update({f"grad.{n}": p.grad for n, p in model.named_parameters()})
    for i, s in opt.state_dict()["state"].items():
        state.update({f"opt.{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    state = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in state.items()
    }
    root, ext = os.path.splitext(args.out)
    torch.save(state, f"{root}.rank{rank}{ext}")
dist.destroy_process_group()
