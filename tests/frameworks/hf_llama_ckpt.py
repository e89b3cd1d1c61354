"""A Hugging Face Llama causal LM built from a tiny ``LlamaConfig`` (random weights), trained with
``gradient_checkpointing_enable()`` (the decoder layers' activations recomputed in backward by
``torch.utils.checkpoint``), AdamW and a linear warm-up schedule. ``--layers N``: N decoder layers
(default 2; benchmarks/planner_speed.py traces 32, a deep model of thin layers)."""

import argparse
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup
from transformers.utils import logging

warnings.filterwarnings("ignore")
logging.set_verbosity_error()
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--layers", type=int, default=2, help="decoder layers (num_hidden_layers)")
args = parser.parse_args()

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=args.layers,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
model = LlamaForCausalLM(config)
model.gradient_checkpointing_enable()
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=20)
for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch, 48))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    print("step", step, "loss", float(loss))
