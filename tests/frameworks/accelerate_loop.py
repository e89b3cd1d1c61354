"""An Accelerate training loop: a GPT-2 from a tiny config, ``Accelerator.prepare`` of the model,
optimizer, schedule and a ``DataLoader`` with two persistent worker processes (batches unpickled
in the main process whenever a worker's arrive), ``accelerator.backward``,
``accelerator.clip_grad_norm_``, a cosine schedule."""

import argparse
import warnings

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup
from transformers.utils import logging

warnings.filterwarnings("ignore")
logging.set_verbosity_error()
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, default=4)
args = parser.parse_args()

torch.manual_seed(0)
config = GPT2Config(
    vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0,
)  # fmt: skip
model = GPT2LMHeadModel(config)
data = TensorDataset(torch.randint(0, 256, (64, 48)))
loader = DataLoader(
    data,
    batch_size=args.batch,
    shuffle=True,
    num_workers=2,
    persistent_workers=True,
    generator=torch.Generator().manual_seed(0),
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=20)
accelerator = Accelerator(cpu=True)
model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
model.train()
step = 0
while step < args.steps:
    for (ids,) in loader:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        print("step", step, "loss", float(loss))
        step += 1
        if step == args.steps:
            break
