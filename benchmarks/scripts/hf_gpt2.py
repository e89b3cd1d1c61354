"""A Hugging Face GPT-2 (built from a config: random weights, nothing downloaded) trained on random
tokens. By default with ``transformers.Trainer``, a third-party training loop, for the runtime
benchmark (benchmarks/runtime.py); with ``--plain``, a plain SGD loop for planner benchmarks,
narrow so that deep models trace in seconds on a CPU while keeping GPT-2's op structure per layer.

    python benchmarks/scripts/hf_gpt2.py [--steps 6] [--batch 8] [--seq 128] [--gradient-checkpointing]
    capuchin trace --device cpu --iterations 2 -o gpt2-12.trace.parquet benchmarks/scripts/hf_gpt2.py --plain --layers 12
"""

from __future__ import annotations

import argparse
import os
import tempfile

# the model's shape, and the batch, by loop: (Trainer, --plain)
DEFAULTS = {
    "layers": (4, 12),
    "width": (128, 64),
    "heads": (4, 2),
    "vocab": (1000, 512),
    "seq": (128, 64),
    "batch": (8, 4),
    "dropout": (0.0, 0.1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain", action="store_true", help="a plain SGD loop instead of Trainer")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    for name, (trainer, plain) in DEFAULTS.items():
        ap.add_argument(f"--{name}", type=type(trainer), help=f"default {trainer}; --plain {plain}")
    ap.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="checkpoint every transformer block (Hugging Face's own option; Trainer only)",
    )
    args = ap.parse_args()
    for name, defaults in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, defaults[args.plain])
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(args.seed)
    cfg = GPT2Config(
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
        vocab_size=args.vocab,
        n_positions=args.seq,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
    )
    model = GPT2LMHeadModel(cfg)
    if args.plain:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
        for _ in range(args.steps):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (args.steps * args.batch, args.seq), generator=g)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=args.batch,
            max_steps=args.steps,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            seed=args.seed,
            dataloader_num_workers=0,
            disable_tqdm=True,
            gradient_checkpointing=args.gradient_checkpointing,
        )
        Trainer(model=model, args=targs, train_dataset=Data()).train()


if __name__ == "__main__":
    main()
