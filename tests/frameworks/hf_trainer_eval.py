"""A Hugging Face Trainer script: a small BERT classifier (random weights from a config) with an
evaluation every --eval-steps steps (eval_strategy="steps")."""

import argparse
import tempfile
import warnings

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from transformers.utils import logging

warnings.filterwarnings("ignore")
logging.set_verbosity_error()
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--eval-steps", type=int, default=2)
args = parser.parse_args()


class Data(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 512, (n, 64), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


torch.manual_seed(0)
config = BertConfig(
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=256,
    max_position_embeddings=64,
    num_labels=2,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
model = BertForSequenceClassification(config)
with tempfile.TemporaryDirectory() as out:
    targs = TrainingArguments(
        output_dir=out,
        max_steps=args.steps,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=64,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=targs, train_dataset=Data(32 * 16, 1), eval_dataset=Data(64, 2)
    )
    trainer.train()
