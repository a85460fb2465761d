"""``AsyncPeer``'s keywords checked before anything starts: a bad value is a ``ConfigError``
that says what to pass instead."""

from __future__ import annotations

import math

from p2ptrain.cluster.rounds import RoundConfig, SyncPoint
from p2ptrain.cluster.sync_every import parse_sync_every
from p2ptrain.errors import ConfigError
from p2ptrain.net.auth import MAX_CLUSTER_LEN

PEER_TIMEOUT = RoundConfig.peer_timeout  # seconds a silent peer is waited for before the others go on (10)
MIN_PEER_TIMEOUT = 5.0  # (a silent peer is left out of rounds after 2.5 s; dropped sooner, a Wi-Fi hiccup drops it)


def check_options(*, staleness, target_batch_size, min_peers, clip_grad_norm, reconcile_every, step_timeout,
                  weight_prediction, max_rounds=None, duration=None, cluster="default", sync_every=None,
                  outer_lr=None, outer_momentum=None, overlap=False, peer_timeout=PEER_TIMEOUT) -> None:
    """Raise ``ConfigError`` for the first keyword of ``AsyncPeer`` that is out of range."""
    if not isinstance(cluster, str) or not 1 <= len(cluster) <= MAX_CLUSTER_LEN or not cluster.isprintable():
        raise ConfigError(f"cluster must be a name of 1..{MAX_CLUSTER_LEN} printable characters, got {cluster!r}")
    if sync_every is None and (outer_lr is not None or outer_momentum is not None):
        raise ConfigError("outer_lr and outer_momentum are for local-steps mode: give sync_every=H too (or "
                          "leave them out for gradient mode)")
    if sync_every is not None:
        check_local_steps(sync_every, *local_steps_defaults(outer_lr, outer_momentum, sync_every))
        if target_batch_size is not None:
            raise ConfigError("target_batch_size bounds the updates of gradient mode; with sync_every a round "
                              "averages what each peer did in its inner steps (drop one of the two)")
        if weight_prediction:
            raise ConfigError("weight_prediction is for gradient mode; with sync_every the inner steps already "
                              "compute on up-to-date local parameters (drop one of the two)")
    if type(staleness) is not int or staleness < 0:
        raise ConfigError(f"staleness must be an int >= 0 (0: synchronous), got {staleness!r}")
    if target_batch_size is not None and (type(target_batch_size) is not int or target_batch_size < 1):
        raise ConfigError(f"target_batch_size must be an int >= 1, got {target_batch_size!r}")
    if target_batch_size is not None and staleness == 0:
        raise ConfigError("target_batch_size needs staleness >= 1 (at staleness 0 each round takes one batch "
                          "from every member)")
    if weight_prediction and staleness == 0:
        raise ConfigError("weight_prediction needs staleness >= 1 (at staleness 0 every gradient is computed on "
                          "the parameters it is applied to)")
    if type(overlap) is not bool:
        raise ConfigError(f"overlap must be True or False, got {overlap!r}")
    if overlap and (staleness or sync_every is not None):
        raise ConfigError("overlap is for staleness 0 in gradient mode (at staleness >= 1 and with sync_every the "
                          "ring already runs beside the next batches): drop overlap=True")
    if type(min_peers) is not int or min_peers < 1:
        raise ConfigError(f"min_peers must be an int >= 1, got {min_peers!r}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ConfigError(f"clip_grad_norm must be > 0, got {clip_grad_norm!r}")
    if type(reconcile_every) is not int or reconcile_every < 0:
        raise ConfigError(f"reconcile_every must be an int >= 0 (0: never compare parameters), got "
                          f"{reconcile_every!r}")
    if not (isinstance(peer_timeout, (int, float)) and MIN_PEER_TIMEOUT <= peer_timeout < float("inf")):
        raise ConfigError(f"peer_timeout must be a number of seconds >= {MIN_PEER_TIMEOUT:g} (a silent peer is left "
                          f"out of rounds long before; this drops it), got {peer_timeout!r}")
    if not step_timeout > 0:
        raise ConfigError(f"step_timeout must be > 0 seconds, got {step_timeout!r}")
    if max_rounds is not None and (type(max_rounds) is not int or max_rounds < 1):
        raise ConfigError(f"max_rounds must be an int >= 1 (or None: no limit), got {max_rounds!r}")
    if duration is not None and not (isinstance(duration, (int, float)) and 0 < duration < float("inf")):
        raise ConfigError(f"duration must be a number of seconds > 0 (or None: no limit), got {duration!r}")


def check_model_and_optimizer(model, optimizer) -> None:
    """``AsyncPeer(model, optimizer)``: a module, and an optimizer over its parameters only (one
    over others' would step parameters whose gradients no peer averages, so replicas drift)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer over the model's parameters, got "
                          f"{type(optimizer).__name__}")
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in model.parameters()):
        raise ConfigError("the model has lazy parameters (LazyLinear, ...) that are not made yet: run one forward "
                          "pass on a sample batch before giving it to the peer")
    complex_ = next(((name, p.dtype) for name, p in own_module(model).named_parameters()
                     if p.requires_grad and p.is_complex()), None)
    if complex_:  # (the sum is of real values: a complex gradient's imaginary part was dropped, silently)
        raise ConfigError(f"parameter {complex_[0]!r} is {str(complex_[1]).removeprefix('torch.')}: peers average "
                          "real tensors only; keep it real with a last dimension of 2 (torch.view_as_real) and "
                          "use torch.view_as_complex(it) in forward")
    owned = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in owned for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ConfigError(f"the optimizer steps {foreign} tensor(s) that are not the model's parameters, whose "
                          f"gradients no peer would average: build it over model.parameters()")


def own_module(model):
    """The module that names the parameters as the model itself does. ``torch.compile`` wraps a
    model in one that adds ``_orig_mod.`` to every name, ``nn.DataParallel`` (a desktop's two
    GPUs) in one that adds ``module.``: a wrapped peer beside one that is not (MPS, CPU) must
    still name them alike, and a state or checkpoint load into either. (The wrappers train the
    module's own parameters, so its gradients are theirs.)"""
    import torch

    wrappers = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    while True:
        if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None),
                                                                    torch.nn.Module):
            model = model._orig_mod
        elif isinstance(model, wrappers) and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            return model


# A peer with discovery on leads nothing this long after it starts. Peers started together (a script)
# each trained alone for the moment their beacons took (a second at most: they go every second,
# and a new peer is answered at once), then all but one loaded the state of the one with the most
# updates: 50 s each from a laptop on 10 Mbit/s Wi-Fi when it won. Met at genesis, none loads.
START_LISTEN = 1.5


def round_config(min_peers: int, start: SyncPoint | None, max_rounds: int | None, duration: float | None,
                 now: float, discovery: bool = True, peer_timeout: float = PEER_TIMEOUT) -> RoundConfig:
    """The round machine's settings; the run's limits (``cluster.ending``): the version this peer
    starts from (a checkpoint's, or 0) plus ``max_rounds``, and ``duration`` from ``now`` (the
    cluster's loop clock). ``discovery``: whether it is on (``START_LISTEN`` then; its beacons take
    up to a second, while a ``peers`` address is dialled at once). ``peer_timeout``: a peer silent
    this long is dead (``RoundConfig.peer_timeout``)."""
    return RoundConfig(min_peers=min_peers, max_version=(start.version if start else 0) + max_rounds if max_rounds
                       else 0, deadline=now + duration if duration else math.inf,
                       listen=START_LISTEN if discovery else 0.0, peer_timeout=peer_timeout,
                       max_rounds=max_rounds or 0)


def listen_address(listen: str) -> tuple[str, int]:
    """``host:port`` to listen on; port 0 means any free port."""
    host, _, port = str(listen).strip().rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"listen={listen!r}: expected host:port, e.g. 0.0.0.0:7000 (port 0: any free port)")
    return host.strip("[]"), int(port)


BY_COUNT_OUTER = (0.7, 0.9)  # DiLoCo's outer lr and momentum (tuned for hundreds of steps a round)
BY_TIME_OUTER = (0.8, 0.6)  # rounds by time's: tens of rounds of a few dozen steps, each a round late


def local_steps_defaults(outer_lr, outer_momentum, sync_every=None) -> tuple:
    """The outer step's learning rate and momentum where not given (None): DiLoCo's for a count
    of steps, ``BY_TIME_OUTER`` for rounds by time (``sync_every`` a window or ``auto``). Measured
    (``bench/uneven.py --model 9m --slow 10``, int8, staleness 1, ``--sync-every 2s``, one run):
    the pair reached the loss in 0.68x the fast peer's time alone with 0.8/0.6, 0.91x with 0.7/0.9,
    whose momentum, amplifying updates a round late, left the pair's final loss above the fast
    peer's alone (0.72 against 0.67; 0.65 with 0.8/0.6). Plain averaging (1.0/0) took 1.3-1.7x
    the default's time to the loss on a CPU pair at batch 64 and 2.3-2.4x with four peers at
    batch 8, but a pair at batch 8 ended lower with it in eight runs of eight (0.78-0.83 against
    0.80-0.86): ``bench/README.md``, "The outer step, by regime"."""
    by_time = sync_every is not None and parse_sync_every(sync_every).by_time
    lr, momentum = BY_TIME_OUTER if by_time else BY_COUNT_OUTER
    return (lr if outer_lr is None else outer_lr), (momentum if outer_momentum is None else outer_momentum)


def check_local_steps(sync_every, outer_lr, outer_momentum) -> None:
    """Local-steps mode's keywords (``join --sync-every --outer-lr --outer-momentum`` too)."""
    parse_sync_every(sync_every)  # (ConfigError: not a count, a window of time or auto)
    if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not 0 < outer_lr < float("inf"):
        raise ConfigError(f"outer_lr must be a number > 0 (DiLoCo's: 0.7), got {outer_lr!r}")
    if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) or not 0 <= outer_momentum < 1:
        raise ConfigError(f"outer_momentum must be a number in [0, 1) (DiLoCo's: 0.9; 0: none), got "
                          f"{outer_momentum!r}")
