"""A word language model in the style of pytorch/examples: embedding, a 2-layer ``nn.LSTM`` or
``nn.GRU`` (``--cell``), a decoder, SGD with momentum. On CPU the recurrent layers run
``aten.mkldnn_rnn_layer``, whose fourth output (the training workspace) exists only with grad
mode on."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--cell", choices=["lstm", "gru"], default="lstm")
args = parser.parse_args()

torch.manual_seed(0)
vocab, emb, hidden, seq, batch = 200, 32, 64, 12, 8


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Embedding(vocab, emb)
        cell = nn.LSTM if args.cell == "lstm" else nn.GRU
        self.rnn = cell(emb, hidden, num_layers=2, dropout=0.1)
        self.dec = nn.Linear(hidden, vocab)

    def forward(self, x):
        out, _ = self.rnn(self.enc(x))
        return self.dec(out)


model = LM()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
data = torch.randint(0, vocab, (args.steps, seq + 1, batch))
for step in range(args.steps):
    x, y = data[step, :-1], data[step, 1:]
    loss = nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    opt.step()
    print("step", step, "loss", float(loss))
