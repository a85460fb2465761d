"""A Hugging Face ``Trainer`` script on p2ptrain: two changed lines (marked ``# p2ptrain``).

    pip install "p2ptrain[transformers]"
    python examples/hf_trainer.py --rank 0 --peers 127.0.0.1:7100,127.0.0.1:7101 &
    python examples/hf_trainer.py --rank 1 --peers 127.0.0.1:7100,127.0.0.1:7101

Those two lines train one tiny GPT-2 (made from a config: nothing is downloaded) on two peers
of this machine; on a LAN give each machine its own ``--rank`` and the machines' addresses.
Each peer reads its share of the data (``data_rank`` of ``data_shares``), gradients are
averaged before the Trainer's clipping applies to them, each peer writes its checkpoints under
``out/hf_trainer/peer-<rank>`` and only rank 0 logs. Run the same commands again with
``--resume``: every peer continues from its last checkpoint, and they meet again there.
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from p2ptrain.integrations.transformers import P2PTrainer  # p2ptrain (was: from transformers import Trainer)


def byte_dataset(text: bytes, length: int = 32) -> list[dict]:
    ids = torch.tensor(list(text))
    return [{"input_ids": ids[i:i + length], "labels": ids[i:i + length]} for i in range(0, len(ids) - length, 8)]


def main(a):
    torch.manual_seed(0)  # the same starting weights on every peer (a joiner downloads them anyway)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    text = b"the quick brown fox jumps over the lazy dog; " * 60
    args = TrainingArguments(output_dir="out/hf_trainer", per_device_train_batch_size=8, max_steps=a.steps,
                             learning_rate=3e-3, max_grad_norm=1.0, warmup_steps=10, logging_steps=10,
                             save_steps=50, report_to=[], use_cpu=a.cpu, seed=0)
    peers = a.peers.split(",")
    trainer = P2PTrainer(model=model, args=args, train_dataset=byte_dataset(text),  # p2ptrain
                         peer=dict(listen=peers[a.rank], peers=peers, discovery=False, min_peers=len(peers)),
                         data_rank=a.rank, data_shares=len(peers))
    trainer.train(resume_from_checkpoint=a.resume or None)
    print(f"rank {a.rank}: {trainer.peer.version} updates, parameters {trainer.peer.param_checksum()}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True, help="this peer's place in --peers (its share of the data)")
    p.add_argument("--peers", required=True, help="every peer, this one included, host:port,...")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--resume", action="store_true", help="continue from this peer's last checkpoint")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even where an accelerator is")
    main(p.parse_args())
