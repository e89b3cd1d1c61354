"""A Lightning Trainer script: automatic optimization, so forward and backward run inside
``optimizer.step(closure)``."""

import argparse
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        layers = [nn.Linear(64, 256), nn.ReLU()]
        for _ in range(6):
            layers += [nn.Linear(256, 256), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


torch.manual_seed(0)
model = Net()
data = TensorDataset(torch.randn(1024 * 8, 64), torch.randint(0, 10, (1024 * 8,)))
trainer = L.Trainer(
    max_steps=args.steps,
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)
trainer.fit(model, DataLoader(data, batch_size=1024, shuffle=False))
