"""A LightningModule with BatchNorm and dropout on a small built-in data set, under the toolkit's
guarantees through hpc.lightning (its Trainer and DataLoader in place of Lightning's and torch's)."""

import argparse

import pytorch_lightning as pl
import torch
from torch import nn

from hpc.lightning import DataLoader, Trainer


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 10, 0.9)}


def data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
    return torch.utils.data.TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-every", type=int, default=20, help="training batches between validations")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    model = Classifier(args.lr)
    train = DataLoader(data(2048, 1), batch_size=32, shuffle=True)
    val = DataLoader(data(512, 2), batch_size=128)
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = Trainer(max_steps=args.max_steps, accelerator="auto", devices="auto", val_check_interval=args.val_every, log_every_n_steps=10, **quiet)
    trainer.fit(model, train, val)


if __name__ == "__main__":
    main()
