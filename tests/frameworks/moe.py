"""A mixture of experts: a Hugging Face Mixtral causal LM from a tiny config (4 experts, top-2
routing, the router's auxiliary loss), with the experts run eagerly (``--experts eager``:
Hugging Face's per-expert loop, so which experts run and on how many tokens changes every step)
or batched (``grouped_mm``), AdamW."""

import argparse
import warnings

import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.utils import logging

warnings.filterwarnings("ignore")
logging.set_verbosity_error()
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--experts", default="eager")
args = parser.parse_args()

torch.manual_seed(0)
config = MixtralConfig(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.02,
)  # fmt: skip
model = MixtralForCausalLM(config)
model.set_experts_implementation(args.experts)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch, 32))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("step", step, "loss", float(loss))
