"""A nanoGPT-style script (karpathy/nanoGPT's train.py, eager): a GPT with causal SDPA and dropout,
GELU, the token embedding tied to the output head, AdamW with two parameter groups (decay for
matrices only), a hand-set cosine learning rate with warm-up, 2 gradient-accumulation micro-steps
under bf16 autocast, gradient clipping."""

import argparse
import math

import torch
from torch import nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, default=4)
args = parser.parse_args()

torch.manual_seed(0)
vocab, block, n_layer, n_head, n_embd, accum = 128, 32, 2, 2, 64, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        x = x + self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = F.dropout(self.wte(idx) + self.wpe(pos), 0.1, self.training)
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))


model = GPT()
params = [p for p in model.parameters() if p.requires_grad]
groups = [
    {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
]
opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95))
data = torch.randint(0, vocab, (4096,))


def get_batch():
    ix = torch.randint(len(data) - block - 1, (args.batch,))
    x = torch.stack([data[i : i + block] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
    return x, y


def get_lr(it, warmup=2, max_it=20):
    if it < warmup:
        return 6e-4 * (it + 1) / warmup
    ratio = min(1.0, (it - warmup) / (max_it - warmup))
    return 6e-5 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (6e-4 - 6e-5)


x, y = get_batch()
for step in range(args.steps):
    for g in opt.param_groups:
        g["lr"] = get_lr(step)
    for _micro in range(accum):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y) / accum
        x, y = get_batch()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    print("step", step, "loss", loss.item() * accum)
