"""The LAN benchmark: what a group of machines can do with p2ptrain, beside torch.distributed gloo.

    python bench/lan.py --local 2 --quick                           # seconds: the CI smoke run
    python bench/lan.py --local 3                                   # 3 processes on this machine
    python bench/lan.py --local 3 --netns 1gbit --json lan.json     # 3 emulated hosts (root, ip, tc)
    python bench/lan.py --local 3 --netns 1gbit,1gbit,100mbit       # one host on a slower link
    python bench/lan.py --peers 10.0.0.1:29700,10.0.0.2:29700 --host 10.0.0.1 --link 1gbit --json lan.json
                                    # on every machine of a real LAN, each with its own --host

Every machine runs the same phases (bench/_lan_peer.py): the allreduce per codec and size
(bench/allreduce.py's worker) and gloo's fp32 allreduce (bench/gloo_allreduce.py's
worker); then training, for N = 1..all peers: the real ``python -m p2ptrain join`` on the
synthetic task per training codec and staleness, and DDP over gloo on the same task,
batch and seed (bench/_lan_ddp.py). The first peer of ``--peers`` gathers the figures:
Markdown tables on stdout, ``--json FILE``, and PNG plots beside it when matplotlib
imports. ``--local N`` starts N such peers here, on loopback or, with ``--netns``, each
in its own network namespace whose link is capped by tbf (bench/netns.py), all torn
down at the end. bench/README.md explains every number.

Exit status: 0 all ran and replicas agreed; 1 something failed (listed under the tables);
2 bad options, or ``--netns`` where namespaces cannot be made (not root, no ip/tc).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # p2ptrain, when not installed

import _common
import netns

NETNS_PORT = 29700
PORT_BLOCK = 100          # ports a peer uses from its --peers entry on (see _lan_peer.py)
LAUNCHER_ONLY = ("--local", "--netns", "--json", "--plots")   # options the launcher keeps to itself
QUICK = {"sizes": [0.25, 1.0], "reps": 2, "codecs": ["none", "int8"], "model_size": "20k",
         "batch_size": 64, "rounds": 30, "target_loss": 2.2, "timeout": 120.0, "stall": 30.0}
DEFAULTS = {"sizes": [1.0, 16.0, 64.0], "reps": 5, "codecs": ["none", "int8"], "model_size": "1m",
            "batch_size": 128, "rounds": 100, "target_loss": 1.0, "timeout": 900.0, "stall": 120.0}


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See bench/README.md for what each number means.")
    w = p.add_argument_group("where")
    w.add_argument("--local", type=int, metavar="N", help="start N peers on this machine")
    w.add_argument("--netns", metavar="RATE[,RATE...]", help="with --local: one emulated host per peer, "
                   "links capped at RATE (one rate, or one per host for mixed rates); needs root, ip, tc")
    w.add_argument("--peers", help="every peer, host:port, the same list on every machine (rank 0 first)")
    w.add_argument("--host", help="this machine's entry in --peers (its address as written there)")
    w.add_argument("--port", type=int, help="with --host, when several entries share the host")
    w.add_argument("--pin-cores", action="store_true", help="peer i and what it runs keep to CPU core "
                   "i mod (cores it may use): with --local, one core per emulated host, as on separate machines")
    w.add_argument("--link", type=_csv(str), metavar="RATE[,RATE...]",
                   help="nominal link rate(s), e.g. 1gbit, for 'of link' and 'of bound' (the slowest counts)")
    r = p.add_argument_group("allreduce")
    r.add_argument("--sizes", type=_csv(float), help="MiB of fp32, comma-separated (default 1,16,64)")
    r.add_argument("--reps", type=int, help="timed repetitions per size (default 5)")
    r.add_argument("--codecs", type=_csv(str), help="p2ptrain codecs (default none,int8)")
    r.add_argument("--chunk-kib", type=int, default=1024, help="p2ptrain chunk size in KiB (default 1024)")
    r.add_argument("--no-allreduce", dest="allreduce", action="store_false", help="skip the allreduce part")
    t = p.add_argument_group("training")
    t.add_argument("--train-codecs", type=_csv(str), default=["none"], help="p2ptrain codecs for training (default none)")
    t.add_argument("--staleness", type=_csv(int), default=[0], help="p2ptrain staleness bounds (default 0)")
    t.add_argument("--weight-prediction", action="store_true", help="run each p2ptrain staleness >= 1 "
                   "training run a second time with join's --weight-prediction")
    t.add_argument("--overlap", action="store_true", help="run each p2ptrain staleness 0 training run "
                   "a second time with join's --overlap (the ring starts on the gradients backward made first)")
    t.add_argument("--floor", action="store_true", help="at each N >= 2, also the same steps with no "
                   "communication (each peer a cluster of one, all at once on the same cores): columns "
                   "'no comm' and 'vs no comm', a run's time to its target over the floor's time to the same samples")
    t.add_argument("--sync-every", type=_csv(int), metavar="H[,H...]", help="also train in local-steps mode "
                   "(join --sync-every H, at each --local-staleness) per H and training codec, for the same samples per peer")
    t.add_argument("--local-staleness", type=_csv(int), default=[1], metavar="T[,T...]",
                   help="the staleness of the local-steps runs (default 1: the outer update lands a round late, "
                   "the inner steps go on meanwhile; 0: each peer waits for it), a run per value")
    t.add_argument("--outer-lr", type=float, help="local-steps runs: join --outer-lr (default: join's)")
    t.add_argument("--outer-momentum", type=float, help="local-steps runs: join --outer-momentum (default: join's)")
    t.add_argument("--model-size", help="synthetic task size (default 1m)")
    t.add_argument("--batch-size", type=int, help="samples per step per peer (default 128)")
    t.add_argument("--rounds", type=int, help="rounds (steps) per training run (default 100)")
    t.add_argument("--scaling", type=_csv(int), help="peer counts to train with (default 1..all)")
    t.add_argument("--target-loss", type=float, help="smoothed training loss for 'time to target' "
                   "(default 1.0; --quick 2.2)")
    t.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS",
                   help="extra compute delay per step on the slow peers (heterogeneity)")
    t.add_argument("--slow-ranks", type=_csv(int), help="which peers are slow (default: the last)")
    t.add_argument("--slow-busy", action="store_true", help="the slow peers' --step-delay computes (keeps a "
                   "core busy, as a slower device does) instead of sleeping (which frees the core for the others)")
    t.add_argument("--device", default="cpu", help="where each peer trains, p2ptrain and DDP alike: cpu (default), "
                   "cuda[:i], mps, auto (join's --device)")
    t.add_argument("--no-train", dest="train", action="store_false", help="skip the training part")
    o = p.add_argument_group("output and limits")
    o.add_argument("--no-gloo", dest="gloo", action="store_false", help="skip the gloo baselines")
    o.add_argument("--json", help="write every figure to this file")
    o.add_argument("--plots", metavar="DIR", help="write the PNGs here (default: beside --json)")
    o.add_argument("--quick", action="store_true", help="tiny sizes and model, a few rounds: the CI smoke run")
    o.add_argument("--threads", type=int, help="torch threads per process (default: 1 with --local, else torch's)")
    o.add_argument("--timeout", type=float, help="seconds per phase before it is killed (default 900; --quick 120)")
    o.add_argument("--stall", type=float, help="kill a training run after this many seconds without a new "
                   "round (default 120; --quick 30; 0 = never)")
    o.add_argument("--secret", default="p2ptrain-bench", help="the p2ptrain cluster secret of the runs")
    o.add_argument("--log-level", default="warning", choices=["debug", "info", "warning"],
                   help="the p2ptrain joins' log level (default warning; with --keep, their logs stay)")
    o.add_argument("--keep", action="store_true", help="keep each peer's logs and metrics (temp dir)")
    o.add_argument("--trace", action="store_true", help="each p2ptrain join also writes a Chrome trace "
                   "(train-K.trace.json beside its metrics; implies --keep): read them with bench/trace_spans.py")
    return p


def _fill_defaults(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for key, value in (QUICK if a.quick else DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    try:
        a.link_bps = min(netns.parse_rate(x) for x in a.link) if a.link else None
    except ValueError as e:
        p.error(f"--link: {e}")


def _check(p: argparse.ArgumentParser, a: argparse.Namespace, world: int) -> None:
    if world < 2:
        p.error("a LAN benchmark needs at least 2 peers")
    if a.reps < 1 or a.rounds < 2 or a.batch_size < 1 or a.timeout <= 0 or any(s <= 0 for s in a.sizes):
        p.error("--reps, --batch-size and --sizes must be positive, --rounds at least 2, --timeout > 0")
    if a.scaling and any(not 1 <= n <= world for n in a.scaling):
        p.error(f"--scaling values must be 1..{world}")
    if any(s < 0 for s in a.staleness) or a.step_delay < 0:
        p.error("--staleness and --step-delay must be >= 0")
    if any(tau < 0 for tau in a.local_staleness):
        p.error("--local-staleness values must be >= 0")
    if any(h < 1 for h in a.sync_every or []):
        p.error("--sync-every values must be >= 1 (inner steps per round)")
    from p2ptrain.codecs import parse_codec
    from p2ptrain.errors import ConfigError

    try:
        for c in a.codecs + a.train_codecs:
            parse_codec(c)
    except ConfigError as e:
        p.error(str(e))


# ------------------------------------------------------------------ one peer (every machine)

def run_peer(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    from p2ptrain.net.discovery import parse_host_port
    from p2ptrain.errors import ConfigError

    peers = [x.strip() for x in a.peers.split(",") if x.strip()]
    try:
        parsed = [parse_host_port(x) for x in peers]
    except ConfigError as e:
        p.error(str(e))
    if len(set(peers)) != len(peers):
        p.error("--peers lists an entry twice")
    if a.host is None:
        p.error("pass --host: this machine's address as written in --peers")
    mine = [i for i, (h, port) in enumerate(parsed) if h == a.host and a.port in (None, port)]
    if len(mine) != 1:
        p.error(f"--host {a.host}" + (f" --port {a.port}" if a.port else "")
                + f" matches {len(mine)} entries of --peers {a.peers}: it must match exactly one")
    a.peer_list = peers
    a.scaling = a.scaling or list(range(1, len(peers) + 1))
    a.slow_ranks = a.slow_ranks if a.slow_ranks is not None else [len(peers) - 1]
    a.threads = a.threads or 0
    if a.pin_cores:
        pin_to_core(mine[0])
    _check(p, a, len(peers))
    import _lan_peer

    return _lan_peer.Peer(a, peers, mine[0]).run()


def pin_to_core(rank: int) -> int:
    """Keep this process, and every process it starts from now on, to one CPU core: the
    rank-th, mod the cores it may use. A peer emulating a machine of its own then cannot take
    another peer's core, and the ones it runs inherit it. Returns the core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


# ------------------------------------------------------------------ --local: N peers here

def _peer_argv(argv: list[str]) -> list[str]:
    """The user's options minus the launcher's own (``--opt value`` and ``--opt=value``)."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok.split("=", 1)[0] in LAUNCHER_ONLY:
            skip = "=" not in tok
        else:
            out.append(tok)
    return out


def _free_block(n: int) -> int:
    """A base port below 32768 with n * PORT_BLOCK ports free on loopback right now."""
    for _ in range(50):
        base = random.randrange(20000, 32768 - n * PORT_BLOCK)
        try:
            for port in range(base, base + n * PORT_BLOCK):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise SystemExit("lan: no block of free ports below 32768 on 127.0.0.1")


def launch_local(p: argparse.ArgumentParser, a: argparse.Namespace, argv: list[str]) -> int:
    n = a.local
    _check(p, a, n)
    rates = None
    if a.netns:
        rates = a.netns.split(",")
        rates = rates * n if len(rates) == 1 else rates
        if len(rates) != n:
            p.error(f"--netns gives {len(rates)} rates for --local {n}: give one, or one per host")
        try:
            for r in rates:
                netns.parse_rate(r)
        except ValueError as e:
            p.error(str(e))
        ok, reason = netns.netns_available()
        if not ok:
            print(f"lan: --netns: {reason}", file=sys.stderr)
            return 2
    rest = _peer_argv(argv)
    if a.threads is None:
        rest += ["--threads", "1"]  # N processes share this machine's cores: no thread pool fights
    if rates and a.link is None:
        rest += ["--link", ",".join(rates)]
    extra0 = (["--json", str(Path(a.json).resolve())] if a.json else []) + \
             (["--plots", str(Path(a.plots).resolve())] if a.plots else [])
    with netns.EmulatedLan(n, rates) if rates else nullcontext() as lan:
        if lan is not None:
            hosts, ports = [h.addr for h in lan.hosts], [NETNS_PORT] * n
        else:
            base = _free_block(n)
            hosts, ports = ["127.0.0.1"] * n, [base + i * PORT_BLOCK for i in range(n)]
        peers = ",".join(f"{h}:{port}" for h, port in zip(hosts, ports))
        cmds = [[sys.executable, str(Path(__file__).resolve()), "--peers", peers, "--host", hosts[i],
                 "--port", str(ports[i]), *rest, *(extra0 if i == 0 else [])] for i in range(n)]
        return _run_peers(cmds, lan, budget=a.timeout * 60)


def _run_peers(cmds: list[list[str]], lan, budget: float) -> int:
    """Start every peer (rank 0 on our terminal, the others into logs), wait, kill all in ``finally``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    with ExitStack() as stack:
        logs = [None] + [stack.enter_context(tempfile.TemporaryFile(mode="w+", prefix=f"lan-peer{i}-"))
                         for i in range(1, len(cmds))]
        try:
            for i, (cmd, log) in enumerate(zip(cmds, logs)):
                kw = {"stdout": log, "stderr": subprocess.STDOUT if log else None, "text": True}
                if lan is not None:
                    procs.append(lan.popen(i, cmd, env=lan.env(i, env), **kw))
                else:
                    procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, **kw))
            codes = _wait_all(procs, budget)
            for i, (code, log) in enumerate(zip(codes, logs)):
                if code not in (0, None) and log is not None:
                    log.seek(0)
                    print(f"lan: peer {i} exited with {code}:\n{log.read()[-3000:]}", file=sys.stderr)
            if any(c is None for c in codes):
                print("lan: killing the peers still running", file=sys.stderr)
                return 1
            return next((c for c in codes if c != 0), 0)
        finally:
            for pr in procs:
                if pr.poll() is None:
                    try:
                        os.killpg(pr.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pr.kill()
                    pr.wait()


def _wait_all(procs: list[subprocess.Popen], budget: float) -> list[int | None]:
    """Wait until all exit, ``budget`` s pass, or 5 s after one failed (the others would
    otherwise wait for it until their own timeouts); the exit codes, None for the running."""
    deadline = time.monotonic() + budget
    failed_at = None
    while any(pr.poll() is None for pr in procs) and time.monotonic() < deadline:
        if failed_at is None and any(pr.returncode not in (None, 0) for pr in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 5:
            break
        time.sleep(0.1)
    return [pr.poll() for pr in procs]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser()
    a = p.parse_args(argv)
    _fill_defaults(p, a)
    _common.finally_on_sigterm()  # (stopped, it still kills its peers)
    if a.local is not None:
        if a.peers or a.host:
            p.error("give --local N or --peers/--host, not both")
        return launch_local(p, a, argv)
    if a.netns:
        p.error("--netns goes with --local N")
    if not a.peers:
        p.error("give --local N (peers on this machine) or --peers and --host (this machine in a LAN)")
    return run_peer(p, a)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
