"""What a dispatch mode sees of a compiled transformer, and how far eager training is from
compiled training (the two facts behind Note [torch.compile] in tracer/compiled.py).

    python benchmarks/compile_visibility.py [--steps 3]

Prints, for tests/frameworks/compiled_lm.py's model: ops per training step that a counting
TorchDispatchMode sees eagerly, and compiled when the mode declares ``ignore_compile_internals``
(so that Dynamo compiles at all); then the state entries (parameters, gradients, optimizer state)
that differ after ``--steps`` steps between eager and compiled training, and the largest
difference.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def build():
    torch.manual_seed(0)
    vocab, dim = 256, 64
    layer = nn.TransformerEncoderLayer(dim, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    model = nn.Sequential(
        nn.Embedding(vocab, dim), nn.TransformerEncoder(layer, 2), nn.Linear(dim, vocab)
    )
    return model, vocab


def train(compiled: bool, steps: int, count_step: int | None = None):
    model, vocab = build()
    fn = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = None
    for step in range(steps):
        tokens = torch.randint(0, vocab, (8, 33))
        mode = Count() if step == count_step else None
        with mode if mode is not None else contextlib.nullcontext():
            logits = fn(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
        if mode is not None:
            seen = mode.ops
        opt.step()
    state = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"g.{n}": p.grad.clone() for n, p in model.named_parameters()})
    for i, s in opt.state_dict()["state"].items():
        state.update({f"o.{i}.{k}": v.clone() for k, v in s.items()})
    return state, seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    t = time.time()
    eager, eager_ops = train(False, args.steps, count_step=args.steps - 1)
    comp, comp_ops = train(True, args.steps, count_step=args.steps - 1)
    print(
        f"ops seen by a dispatch mode in one forward+backward: eager {sum(eager_ops.values())}, "
        f"compiled (ignore_compile_internals) {sum(comp_ops.values())}"
    )
    print("  compiled, by op:", dict(comp_ops.most_common(8)))
    diff = [k for k in eager if not torch.equal(eager[k], comp[k])]
    worst = max((float((eager[k] - comp[k]).abs().max()) for k in diff), default=0.0)
    print(
        f"eager vs compiled after {args.steps} steps: {len(diff)} of {len(eager)} state "
        f"entries differ, max |difference| {worst:.3g}"
    )
    print(f"({time.time() - t:.0f} s, torch {torch.__version__})")


if __name__ == "__main__":
    main()
