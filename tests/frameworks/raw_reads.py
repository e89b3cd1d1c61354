"""A training loop that reads every parameter and optimizer state tensor after each step without
an op (a logger, an EMA kept in NumPy, a checkpoint uploader): ``--read`` picks how. The values
read feed the next step's learning rate and are kept in a buffer of the model, so a wrong read
shows in the final state, not only in what the script prints."""

import argparse
import ctypes

import numpy as np
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument(
    "--read",
    choices=["numpy", "array", "tolist", "data_ptr", "dlpack", "storage"],
    default="numpy",
)
args = parser.parse_args()


def read(t: torch.Tensor) -> float:
    t = t.data  # no op (``detach()`` is one: it would restore an evicted storage)
    if args.read == "numpy":
        a = t.numpy()
    elif args.read == "array":
        a = np.asarray(t)
    elif args.read == "tolist":
        a = np.array(t.tolist(), dtype=np.float32)
    elif args.read == "dlpack":
        a = np.from_dlpack(t)
    else:
        if args.read == "data_ptr":
            ptr = t.data_ptr()
        else:
            st = t.untyped_storage()
            ptr = st.data_ptr() + t.storage_offset() * t.element_size()
        raw = ctypes.string_at(ptr, t.numel() * t.element_size())
        a = np.frombuffer(raw, dtype=np.float32)
    return float(np.abs(a).astype(np.float64).sum())


torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
n_read = 3 * len(list(model.parameters()))  # parameter, exp_avg, exp_avg_sq
model.register_buffer("reads", torch.zeros(args.steps, n_read, dtype=torch.float64))
x = torch.randn(256, 64)
y = torch.randint(0, 10, (256,))
for step in range(args.steps):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    tensors = []
    for p in model.parameters():
        tensors += [p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]]
    vals = [read(t) for t in tensors]
    model.reads[step] = torch.tensor(vals, dtype=torch.float64)
    scale = 1.0 / (1.0 + 1e-6 * sum(vals))
    for g in opt.param_groups:
        g["lr"] = 1e-3 * scale
    print("step", step, "loss", float(loss), "reads", sum(vals))
