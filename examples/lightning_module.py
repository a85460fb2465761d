"""A Lightning script on p2ptrain: one changed line, the strategy (marked ``# p2ptrain``).

    pip install "p2ptrain[lightning]"
    python examples/lightning_module.py --rank 0 --peers 127.0.0.1:7100,127.0.0.1:7101 &
    python examples/lightning_module.py --rank 1 --peers 127.0.0.1:7100,127.0.0.1:7101

Those two lines train one small classifier with BatchNorm on two peers of this machine; on a
LAN give each machine its own ``--rank`` and the machines' addresses. It runs on whatever this
machine has (CUDA, Apple's MPS, or the CPU: Lightning's DDP refuses MPS, this does not). Each
peer reads its share of the data (a ``DistributedSampler`` by rank), the clipping applies to
the averaged gradient, and ``sync_buffers=True`` keeps BatchNorm's statistics alike: the
replicas end bit-identical, buffers included (each validates on its share of the validation
set, as under DDP, so their ``val_acc`` differ by the data). Rank 0 writes the checkpoints and the logs (under
``out/lightning``), as global zero does under DDP.
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from p2ptrain.integrations.lightning import P2PStrategy


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def loaders():
    g = torch.Generator().manual_seed(0)  # the same data set on every peer; each reads its share
    x = torch.randn(4096, 20, generator=g)
    y = (x @ torch.randn(20, generator=g) > 0).long()
    train = torch.utils.data.TensorDataset(x[:3584], y[:3584])
    val = torch.utils.data.TensorDataset(x[3584:], y[3584:])
    return (torch.utils.data.DataLoader(train, batch_size=64, shuffle=True),
            torch.utils.data.DataLoader(val, batch_size=256))


def main(a):
    torch.manual_seed(0)  # the same starting weights on every peer (a joiner downloads them anyway)
    peers = a.peers.split(",")
    strategy = P2PStrategy(peer=dict(listen=peers[a.rank], peers=peers, discovery=False, min_peers=len(peers)),
                           data_rank=a.rank, data_shares=len(peers), sync_buffers=True)
    trainer = pl.Trainer(strategy=strategy, max_epochs=a.epochs, gradient_clip_val=1.0,  # p2ptrain: strategy=
                         accelerator=strategy.root_device.type, default_root_dir="out/lightning",
                         enable_progress_bar=False)
    train, val = loaders()
    trainer.fit(Classifier(), train, val)
    print(f"rank {a.rank}: {strategy.peer.version} updates, val_acc {trainer.callback_metrics['val_acc']:.4f}, "
          f"parameters {strategy.peer.param_checksum()}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True, help="this peer's place in --peers (its share of the data)")
    p.add_argument("--peers", required=True, help="every peer, this one included, host:port,...")
    p.add_argument("--epochs", type=int, default=3)
    main(p.parse_args())
