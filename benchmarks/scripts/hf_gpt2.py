"""A Hugging Face GPT-2 (tiny config, random weights) trained with ``transformers.Trainer`` on
random tokens: a third-party training loop for the runtime benchmark.

    python benchmarks/scripts/hf_gpt2.py [--steps 6] [--batch 8] [--seq 128] [--gradient-checkpointing]
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="checkpoint every transformer block (Hugging Face's own option)",
    )
    args = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(args.seed)
    cfg = GPT2Config(
        n_layer=4,
        n_head=4,
        n_embd=128,
        vocab_size=1000,
        n_positions=args.seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
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
