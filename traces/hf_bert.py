"""A third-party transformer: Hugging Face transformers' BertForSequenceClassification, built
from a small config (random weights, no download), dropout active, AdamW, synthetic token
sequences. An ordinary training script; capuchin runs it unmodified.

    python traces/hf_bert.py --steps 6 --batch 8
"""

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=args.seq,
        num_labels=2,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    model = BertForSequenceClassification(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
        labels = torch.randint(0, 2, (args.batch,))
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        print(f"step {step} loss {out.loss.item():.4f}")


if __name__ == "__main__":
    main()
