"""A Hugging Face T5 (encoder-decoder) from a tiny config: padded source batches with an attention
mask, labels padded with -100, dropout, trained with Hugging Face's ``Adafactor``."""

import argparse
import warnings

import torch
from transformers import T5Config, T5ForConditionalGeneration
from transformers.optimization import Adafactor
from transformers.utils import logging

warnings.filterwarnings("ignore")
logging.set_verbosity_error()
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, default=4)
args = parser.parse_args()

torch.manual_seed(0)
config = T5Config(
    vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
    num_heads=4, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0,
)  # fmt: skip
model = T5ForConditionalGeneration(config)
model.train()
opt = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
src_len, tgt_len = 40, 16
for step in range(args.steps):
    lengths = torch.randint(src_len // 2, src_len + 1, (args.batch,))
    lengths[0] = src_len  # every batch padded to the same length
    ids = torch.randint(1, 256, (args.batch, src_len))
    mask = (torch.arange(src_len)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    labels = torch.randint(1, 256, (args.batch, tgt_len))
    labels[:, -3:] = -100
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("step", step, "loss", float(loss))
