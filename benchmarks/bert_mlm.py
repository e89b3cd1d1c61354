"""Hugging Face BERT masked LM trained with AdamW: 4 layers, hidden 256, batch 8, sequence 128,
the default vocabulary, dropout active; built from a config with random weights (no download).
Unmodified training script (the model and optimizer are module globals, so tests can read them).

    python benchmarks/bert_mlm.py --steps 5
    python benchmarks/bert_mlm.py --optim hf-trainer   # HF Trainer's default optimizer

``--optim``: ``adamw`` (PyTorch's default on CPU: the per-tensor loop), ``adamw-loop``
(``foreach=False``), ``adamw-foreach``, ``adamw-fused``, or ``hf-trainer``: the optimizer Hugging
Face ``Trainer`` builds with default ``TrainingArguments`` (``adamw_torch_fused``, its learning
rate, its two parameter groups: biases and LayerNorm weights without weight decay), made by
``Trainer.get_optimizer_cls_and_kwargs`` and ``Trainer.get_decay_parameter_names`` as
``Trainer.create_optimizer`` does; the loop stays this script's.
"""

import argparse

import torch
from transformers import BertConfig, BertForMaskedLM

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--vocab", type=int, default=30522)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--optim",
    choices=["adamw", "adamw-loop", "adamw-foreach", "adamw-fused", "hf-trainer"],
    default="adamw",
)
args = parser.parse_args()

torch.manual_seed(args.seed)
config = BertConfig(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    num_hidden_layers=args.layers,
    num_attention_heads=max(1, args.hidden // 64),
    intermediate_size=4 * args.hidden,
    max_position_embeddings=max(512, args.seq),
)
model = BertForMaskedLM(config)
model.train()
if args.optim == "hf-trainer":
    import tempfile

    from transformers import Trainer, TrainingArguments

    targs = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[])
    decay = set(Trainer.get_decay_parameter_names(None, model))
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if n in decay],
            "weight_decay": targs.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(targs, model)
    opt = cls(groups, **kwargs)
else:
    form = {"adamw-loop": {"foreach": False}, "adamw-foreach": {"foreach": True}}
    form["adamw-fused"] = {"fused": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **form.get(args.optim, {}))
for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {out.loss.item():.4f}")
