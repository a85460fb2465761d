"""The training scripts the integration tests run, one process per rank (not a test module).

    python tests/integration_runs.py SCRIPT MODE RANK OUT PORT0 PORT1

SCRIPT: ``hf`` (a ``transformers.Trainer`` on a tiny BERT made from a config), ``lightning``
(a ``LightningModule`` with BatchNorm), ``ddp_hook`` (a plain loop over ``DistributedDataParallel``).
MODE: ``p2p`` (two p2ptrain peers on loopback: PORT0, PORT1) or ``ddp`` (torch DDP on gloo, the
rendezvous on PORT0). Both modes see the same batches per rank. Each rank writes its final
``state_dict`` (and what the test checks besides) to OUT/<mode>-<rank>.pt.
"""

import faulthandler
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch

STEPS, BATCH, WORLD = 6, 4, 2
HANG_DUMP = 90  # seconds (run_ranks kills a rank after 100)


def peer_options(rank, ports):
    return dict(listen=f"127.0.0.1:{ports[rank]}", peers=[f"127.0.0.1:{p}" for p in ports[:WORLD]], discovery=False,
                min_peers=WORLD, secret="test")


def ddp_env(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))


# -- Hugging Face Trainer ------------------------------------------------------------------
def hf_dataset(n=BATCH * WORLD * STEPS):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (n, 8), generator=g)
    labels = (ids[:, 0] % 2).long()
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def hf_model():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=2)
    return BertForSequenceClassification(config)


def hf_args(out, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=5e-3,
                             weight_decay=0.01, max_grad_norm=0.05, warmup_steps=2, lr_scheduler_type="linear",
                             logging_steps=100, report_to=[], use_cpu=True, train_sampling_strategy="sequential",
                             seed=0, disable_tqdm=True, **extra)


def run_hf(mode, rank, out, ports):
    from transformers import Trainer

    result = {}
    if mode == "ddp":
        from accelerate.state import AcceleratorState

        ddp_env(rank, ports[-1])
        AcceleratorState._reset_state(reset_partial_state=True)  # (after a p2p run in this process)
        model = hf_model()
        Trainer(model=model, args=hf_args(os.path.join(out, "ddp"), save_strategy="no", ddp_backend="gloo"),
                train_dataset=hf_dataset()).train()
    else:
        from p2ptrain.integrations.transformers import P2PTrainer

        model = hf_model()
        trainer = P2PTrainer(model=model, args=hf_args(os.path.join(out, "p2p"), save_strategy="steps", save_steps=3),
                             train_dataset=hf_dataset(), peer=peer_options(rank, ports), data_rank=rank,
                             data_shares=WORLD)
        trainer.train()
        result["updates"] = trainer.peer.version
        # Resumed from the checkpoint at step 3 (a model made afresh, other ports): the same end.
        resumed = hf_model()
        torch.nn.init.normal_(resumed.classifier.weight)
        trainer = P2PTrainer(model=resumed, args=hf_args(os.path.join(out, "p2p"), save_strategy="no"),
                             train_dataset=hf_dataset(), peer=peer_options(rank, ports[2:]), data_rank=rank,
                             data_shares=WORLD)
        trainer.train(resume_from_checkpoint=os.path.join(out, "p2p", f"peer-{rank}", "checkpoint-3"))
        result["resumed"] = {k: v.clone() for k, v in resumed.state_dict().items()}
    result["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(result, os.path.join(out, f"{mode}-{rank}.pt"))


# -- a plain loop over DistributedDataParallel ---------------------------------------------
def small_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def rank_batches(rank, steps=STEPS):
    """The batches of ``rank``: the same in both modes."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(steps)]


def run_ddp_hook(mode, rank, out, ports):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    result = {}
    if mode == "ddp":
        ddp_env(rank, ports[-1])
        dist.init_process_group("gloo")
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        for x, y in rank_batches(rank):
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        from p2ptrain.integrations.ddp import P2PHook, init_local_group

        init_local_group()
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        options = peer_options(rank, ports)
        with P2PHook(listen=options["listen"], peers=options["peers"], secret="test") as hook:
            hook.register(ddp)
            for x, y in rank_batches(rank):
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            result["own_buffers"] = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
            hook.average_buffers(model)
    dist.barrier()  # (every rank past its last collective before any tears its group down)
    del ddp  # (before its process group: a DDP freed after it hung now and then at exit)
    dist.destroy_process_group()
    result["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(result, os.path.join(out, f"{mode}-{rank}.pt"))


def run_ddp_hook_desktops(mode, rank, out, ports):
    """Two machines of two GPUs each (here four processes): DDP within a machine (local ranks 0
    and 1), the hook between machines (local rank k of each in a ring of its own). ``ddp``: one
    DDP world of the four. Rank ``r`` trains on ``rank_batches(r)`` in both."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    machine, local = divmod(rank, 2)
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mode == "ddp":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[-1]), RANK=str(rank), WORLD_SIZE="4")
        dist.init_process_group("gloo")
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        for x, y in rank_batches(rank):
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        from p2ptrain.integrations.ddp import P2PHook

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[4 + machine]), RANK=str(local),
                          WORLD_SIZE="2")
        dist.init_process_group("gloo")  # (this machine's world, as torchrun --nproc-per-node 2 makes it)
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        ring = [f"127.0.0.1:{ports[2 * local + m]}" for m in range(2)]  # (local rank k of every machine)
        with P2PHook(listen=ring[machine], peers=ring, secret="test") as hook:
            hook.register(ddp)
            for x, y in rank_batches(rank):
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    dist.barrier()  # (every rank past its last collective before any tears its group down)
    del ddp  # (before its process group: a DDP freed after it hung now and then at exit)
    dist.destroy_process_group()
    torch.save({"state": {k: v.clone() for k, v in model.state_dict().items()}}, os.path.join(out, f"{mode}-{rank}.pt"))


# -- Lightning ------------------------------------------------------------------------------
def lightning_module():
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = small_net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}

    return Classifier()


def lightning_data():
    g = torch.Generator().manual_seed(7)
    n = BATCH * WORLD * STEPS // 2  # (two epochs: a checkpoint at the first one's end resumes exactly)
    data = torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)


def run_lightning(mode, rank, out, ports):
    import lightning.pytorch as pl

    common = dict(accelerator="cpu", max_steps=STEPS, gradient_clip_val=0.05, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
    module = lightning_module()
    result = {}
    if mode == "ddp":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[-1]), NODE_RANK=str(rank), LOCAL_RANK="0",
                          WORLD_SIZE=str(WORLD))
        pl.Trainer(strategy="ddp", devices=1, num_nodes=WORLD, **common).fit(module, lightning_data())
    else:
        from p2ptrain.integrations.lightning import P2PStrategy

        saves = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), every_n_train_steps=3,
                                             save_top_k=-1, filename="{step}")
        strategy = P2PStrategy(peer=peer_options(rank, ports), data_rank=rank, data_shares=WORLD, device="cpu",
                               sync_buffers=True)
        pl.Trainer(strategy=strategy, callbacks=[saves], **{**common, "enable_checkpointing": True}).fit(
            module, lightning_data())
        result["updates"] = strategy.peer.version
        # Every peer resumed from rank 0's checkpoint at step 3 (other ports): the same end.
        resumed = lightning_module()
        strategy = P2PStrategy(peer=peer_options(rank, ports[2:]), data_rank=rank, data_shares=WORLD, device="cpu",
                               sync_buffers=True)
        pl.Trainer(strategy=strategy, **common).fit(resumed, lightning_data(),
                                                    ckpt_path=os.path.join(out, "checkpoints", "step=3.ckpt"))
        result["resumed"] = {k: v.clone() for k, v in resumed.state_dict().items()}
    result["state"] = {k: v.clone() for k, v in module.state_dict().items()}
    torch.save(result, os.path.join(out, f"{mode}-{rank}.pt"))


SCRIPTS = {"hf": run_hf, "ddp_hook": run_ddp_hook, "ddp_hook_desktops": run_ddp_hook_desktops,
           "lightning": run_lightning}

if __name__ == "__main__":
    # A rank still running after HANG_DUMP seconds prints every thread's stack and exits, so that a
    # hang (in torch's teardown or ours) fails its test with where it stood, before run_ranks' kill.
    faulthandler.dump_traceback_later(HANG_DUMP, exit=True)
    script, modes, rank, out, *ports = sys.argv[1:]
    for mode in modes.split(","):  # ("p2p,ddp": both in one process, p2p first: it needs no process group)
        SCRIPTS[script](mode, int(rank), out, [int(p) for p in ports])
