"""A training loop with a second thread that reads the parameters while the script trains (an
EMA, a logger, a checkpoint uploader). ``--mode ema``: after each step the thread folds every
parameter into an EMA (``no_grad`` ops: clone, lerp) and a NumPy norm, while the main thread
waits; the EMA ends in the module ``ema`` (compared with the rest of the state). ``--mode free``:
the thread loops over the parameters without pause while the main thread trains.
``--mode train``: the whole training loop runs in a ``threading.Thread``."""

import argparse
import threading

import numpy as np
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--mode", choices=["ema", "free", "train"], default="ema")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(256, 64)
y = torch.randint(0, 10, (256,))
ema = nn.Module()  # the EMA of the parameters, and what the thread read (compared)
ema.params = nn.ParameterList(
    [nn.Parameter(p.detach().clone(), requires_grad=False) for p in model.parameters()]
)
ema.register_buffer("norms", torch.zeros(0, dtype=torch.float64))
norms = []
errors = []
stop = threading.Event()
go, done = threading.Semaphore(0), threading.Semaphore(0)


def fold():
    with torch.no_grad():
        for e, p in zip(ema.params, model.parameters(), strict=True):
            e.lerp_(p.detach().clone(), 0.1)
            norms.append(float(np.linalg.norm(p.detach().numpy())))
            norms.extend(float(v.abs().sum()) for v in opt.state[p].values() if v.dim() > 0)


def reader():
    try:
        if args.mode == "ema":
            while True:
                go.acquire()
                if stop.is_set():
                    return
                fold()
                done.release()
        while not stop.is_set():
            with torch.no_grad():
                for p in model.parameters():
                    s = p.detach().clone()
                    if not torch.isfinite(s).all():
                        errors.append("nonfinite")
    except Exception as exc:  # reported by the main thread
        errors.append(repr(exc))
        done.release()


def train():
    for step in range(args.steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.mode == "ema":
            go.release()
            done.acquire()
        print("step", step, "loss", float(loss))


if args.mode == "train":
    t = threading.Thread(target=train)
    t.start()
    t.join()
else:
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    train()
    stop.set()
    go.release()
    t.join()
assert not errors, errors
ema.norms = torch.tensor(norms, dtype=torch.float64)
print("norms", sum(norms))
