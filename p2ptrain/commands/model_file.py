"""The trained model as a file of its own, written by ``join`` at the end of every run.

A user expects the result of training to be a file that loads without p2ptrain:

    model.load_state_dict(torch.load("charlm-model.pt", weights_only=True))
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))   # --save *.safetensors

It is the model's ``state_dict`` alone (parameters and buffers, on the CPU, nothing else: no
optimizer, no p2ptrain keys), the replicas' common parameters as of the last applied update.
Written atomically (a temporary file, fsynced, then renamed), so an interrupted write leaves the
previous file whole. Where: ``--save PATH``; else ``model.pt`` in ``--checkpoint-dir``; else
``<task>-model.pt`` in the current folder, ``<task>-model-<port>.pt`` when ``--peers`` lists
another peer of this machine (peers of one machine started in one folder each keep their own).
"""

from __future__ import annotations

import os
import re

from p2ptrain.errors import CheckpointError


def default_path(task_name: str, checkpoint_dir: str | None, port: int, local_peers: int) -> str:
    """Where the model goes without ``--save`` (see the module docstring)."""
    if checkpoint_dir:
        return os.path.join(checkpoint_dir, "model.pt")
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", task_name).strip("-.") or "task"
    return f"{stem}-model-{port}.pt" if local_peers else f"{stem}-model.pt"


def write_model(path: str, model_state: dict) -> None:
    """Write ``model_state`` (a state_dict) to ``path``: safetensors for ``*.safetensors``, else
    ``torch.save``. CheckpointError (one line, naming the file) if the disk refuses."""
    import torch

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    folder = os.path.dirname(os.path.abspath(path))
    temp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import save_file

            # (safetensors refuses tensors that share memory: tied weights are stored once each)
            seen: set[int] = set()
            for key, value in tensors.items():
                if value.untyped_storage().data_ptr() in seen:
                    tensors[key] = value.clone()
                seen.add(tensors[key].untyped_storage().data_ptr())
            save_file(tensors, temp)
        else:
            with open(temp, "wb") as f:
                torch.save(tensors, f)
        with open(temp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(temp, path)
    except OSError as exc:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise CheckpointError(f"cannot write the model to {path} ({exc.strerror or exc}): free some disk space or "
                              "give another --save PATH") from None
