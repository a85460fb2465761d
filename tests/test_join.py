"""``python -m p2ptrain join`` as a user runs it: real subprocesses on loopback."""

import errno
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import finish, ports, reaped

pytestmark = pytest.mark.timeout(180)

# Peers sharing this machine's cores get one torch thread each, as on machines of their own:
# torch's thread pools spin while they wait, and join divides the cores among its local peers
# only once it has built and checked the task (measured: 3 default-task peers on 2 cores took
# 39 s to start with torch's default threads, 4 s with one).
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")
REPO = Path(__file__).resolve().parents[1]


def join(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "p2ptrain", "join", *args], env={**ONE_THREAD, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records(path):
    return [json.loads(line) for line in open(path)]


def test_the_metrics_show_identical_replicas_at_staleness_2(tmp_path):
    """At staleness 2 rounds commit before they are applied, and some carry nothing: each record's
    checksum is of the parameters as its round left them, or null, never another round's (before,
    two identical replicas showed different checksums for most rounds)."""
    mine = ports(2)
    procs = [join("--peers", f"127.0.0.1:{mine[1 - i]}", "--no-discovery", "--port", str(port), "--min-peers", "2",
                  "--max-rounds", "60", "--staleness", "2", "--task", "synthetic", "--model-size", "100k",
                  "--secret", "s",
                  "--eval-every", "0", "--metrics", str(tmp_path / f"m{i}.jsonl"), "--checksum-every", "1")
             for i, port in enumerate(mine)]
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], [e[-1500:] for _, e in outs]
    runs = [records(tmp_path / f"m{i}.jsonl") for i in range(2)]
    assert runs[0][-1]["param_checksum"] == runs[1][-1]["param_checksum"]  # (the summaries)
    by_round = [{r["round"]: r["param_checksum"] for r in run if "event" not in r and r["param_checksum"]}
                for run in runs]
    shared = set(by_round[0]) & set(by_round[1])
    assert len(shared) >= 5, by_round  # (8 to 39 of 40 rounds in runs here: the rest were null on one side)
    assert [r for r in sorted(shared) if by_round[0][r] != by_round[1][r]] == []


def test_peers_train_the_default_task_to_identical_replicas(tmp_path):
    n = 3  # (three, not two: a ring of three routes chunks through a peer that neither made nor keeps them)
    rounds = 15  # (the loss falls by more than 1 in 15 rounds; the test asks for 0.5)
    mine = ports(n)
    # Each is given one address, as DDP's users give one: the third links to the second only
    # through what the first tells it (``mesh``: keepalives carry the peers' addresses).
    procs = [join("--peers", f"127.0.0.1:{mine[1] if port == mine[0] else mine[0]}", "--no-discovery",
                  "--port", str(port), "--min-peers", str(n), "--max-rounds", str(rounds), "--compression", "int8",
                  "--secret", "s", "--eval-every", "0", "--metrics", str(tmp_path / f"m{port}.jsonl"), "--checksum-every", "1",
                  "--trace", str(tmp_path / f"t{port}.json"), env={"P2PTRAIN_RAW_CHUNKS": "0"})
             for port in mine]  # (every chunk encoded, as asked: loopback is quicker raw otherwise)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0] * n, [e[-1500:] for _, e in outs]
    runs = [[r for r in records(tmp_path / f"m{port}.jsonl") if r.get("event") != "training"] for port in mine]
    summaries = [r.pop() for r in runs]
    assert all(s["event"] == "summary" and s["rounds"] == rounds for s in summaries)
    assert len({s["param_checksum"] for s in summaries}) == 1  # the replicas end bit-identical
    assert all([r["param_checksum"] for r in run] == [r["param_checksum"] for r in runs[0]] for run in runs)
    ra = runs[0]
    first, last = sum(r["loss"] for r in ra[:5]) / 5, sum(r["loss"] for r in ra[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert all(r["samples"] == 32 * n and r["members"] == n for r in ra)  # 32 per peer, all counted
    assert ra[-1]["wire_bytes"] < ra[-1]["raw_bytes"] / 3  # int8 on the wire
    assert "summary" in outs[0][0] and "sample:" in outs[0][0]
    # the Chrome trace: every activity on its track, one span per round applied, chunks inside rounds
    trace = json.load(open(tmp_path / f"t{mine[0]}.json"))["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    names = {e["name"].split()[0] for e in spans}
    assert {"compute", "step", "encode", "send", "receive", "reduce", "decode", "apply", "round"} <= names
    assert sum(e["name"].startswith("round ") for e in spans) == rounds
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    # ... and the round messages, a mark each: the first peer (the smallest id leads, or not) sent
    # and heard those of a round's two phases
    marks = {e["name"] for e in spans if e["name"][:2] in ("> ", "< ")}
    assert {"commit", "propose", "start"} <= {m[2:] for m in marks}, marks
    assert {m[0] for m in marks} == {">", "<"} and all(e["args"]["peer"] for e in spans if e["name"] in marks)


def test_alone_with_a_task_file_and_environment_options(tmp_path):
    env_port = str(ports(1)[0])
    # (no discovery: no beacons on the machine's real network)
    env = dict(os.environ, P2PTRAIN_MAX_ROUNDS="15", P2PTRAIN_PORT=env_port, P2PTRAIN_NO_DISCOVERY="1")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--task", os.path.join(repo, "examples", "task_template.py"),
                        "--metrics", str(tmp_path / "m.jsonl")], env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-1500:]
    assert f"listening on port {env_port}" in p.stderr and "discovery on" not in p.stderr
    rounds = records(tmp_path / "m.jsonl")
    assert rounds[0]["event"] == "training" and rounds[0]["time"] <= rounds[1]["time"]  # (its first batch)
    assert len(rounds) == 17 and rounds[-1]["event"] == "summary" and rounds[-1]["rounds"] == 15


@pytest.mark.parametrize("args, message", [
    (["--compression", "int9"], "choose one of none"),
    (["--peers", "nonsense"], "not host:port"),
    (["--min-peers", "0"], "at least 1"),
    (["--staleness", "-1"], "at least 0"),
    (["--port", "70000"], "0..65535"),
    (["--max-rounds", "0"], "at least 1"),
    (["--device", "cuda:7"], "available here"),
    (["--task", "/nonexistent/task.py"], "task.py"),
    (["--secret", "a", "--secret-file", "b"], "not both"),
    (["--batch-size", "many"], "--batch-size: 'many': expected an integer, at least 1"),
    (["--target-batch-size", "256"], "needs --staleness 1 or more"),
    (["--weight-prediction"], "--weight-prediction needs --staleness 1 or more"),
    (["--overlap", "--staleness", "1"], "--overlap is for --staleness 0 in gradient mode"),
    (["--overlap", "--sync-every", "8"], "--overlap is for --staleness 0 in gradient mode"),
    (["--reconcile-every", "-1"], "at least 0"),
    (["--peer-timeout", "2"], "--peer-timeout: '2': expected a number, at least 5"),
    (["--data-rank", "-1"], "--data-rank: '-1': expected an integer, at least 0"),
    # (a folder: a traceback at the start for --metrics, and for --trace at the end, the trace lost)
    (["--metrics", tempfile.gettempdir()], "a folder, not a file; give a file's path in it"),
    (["--trace", tempfile.gettempdir()], "a folder, not a file; give a file's path in it"),
    (["--checkpoint-dir", __file__], "a file, not a folder; give a folder's path"),  # (it said "File exists")
])
def test_bad_options_exit_2_with_one_line(args, message):
    p = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--max-rounds", "1", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-800:])
    assert message in p.stderr
    assert "Traceback" not in p.stderr
    # one name for the command on every such line, the parser's and the checks' after it alike
    assert p.stderr.strip().splitlines()[-1].startswith("python -m p2ptrain join: error: "), p.stderr[-800:]


def test_missing_peer_exits_3_naming_it():
    """And one whose --peers names only itself says so (it said "not reached: " its own address)."""
    a, b, c = ports(3)
    procs = [join("--peers", peers, "--no-discovery", "--port", str(port), "--min-peers", "2", "--connect-timeout",
                  "2", "--max-rounds", "1", "--task", "synthetic", "--model-size", "100k")  # (not the default
             for peers, port in ((f"127.0.0.1:{b}", a), (f"127.0.0.1:{c}", c))]     # task: seconds to build)
    (_, missing), (_, itself) = finish(procs)
    assert [p.returncode for p in procs] == [3, 3], (missing[-800:], itself[-800:])
    assert f"not reached: 127.0.0.1:{b}" in missing and "Traceback" not in missing
    last = itself.strip().splitlines()[-1]
    assert last.endswith("--peers lists only this peer's own address: add the other peers' addresses"), last


def test_an_empty_secret_file_is_refused_not_an_open_cluster(tmp_path):
    empty = tmp_path / "secret"
    empty.write_text("\n")
    p = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--secret-file", str(empty), "--max-rounds", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "secret is empty" in p.stderr


def test_resumes_from_the_newest_checkpoint_after_kill_9(tmp_path):
    ckpt, port = tmp_path / "ckpt", str(ports(1)[0])
    args = [sys.executable, "-m", "p2ptrain", "join", "--task", "synthetic", "--model-size", "100k", "--port", port,
            "--no-discovery", "--eval-every", "0", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20"]
    first = subprocess.Popen([*args, "--max-rounds", "100000", "--metrics", str(tmp_path / "first.jsonl")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(ckpt.glob("ckpt-r*.pt"))) < 2:  # at least two checkpoints, then kill it mid-flight
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-1500:] if first.poll() else ""
            time.sleep(0.1)
        first.kill()
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    before = [r for r in records(tmp_path / "first.jsonl") if "event" not in r]
    second = subprocess.run([*args, "--max-rounds", "10", "--metrics", str(tmp_path / "second.jsonl")],
                            capture_output=True, text=True, timeout=150)
    assert second.returncode == 0, second.stderr[-1500:]
    assert "resuming from" in second.stderr
    after = [r for r in records(tmp_path / "second.jsonl") if "event" not in r]
    summary = records(tmp_path / "second.jsonl")[-1]
    assert len(after) == 10 and summary["event"] == "summary"
    assert summary["rounds"] == 10 and summary["version"] >= 49  # this run's rounds; the cluster's update count
    assert after[0]["round"] >= 39  # it went on from a checkpoint of round 39 or later, not from round 0
    assert after[0]["loss"] < before[0]["loss"] - 0.3  # with the trained parameters, not the initial ones
    assert len(list(ckpt.glob("ckpt-r*.pt"))) <= 3 and not list(ckpt.glob(".ckpt-*"))  # kept 3; no temp left


def test_a_diverged_run_writes_no_checkpoint_over_the_good_ones(tmp_path):
    """Alone (no replica to compare a sketch with), with a learning rate that takes the model to
    NaN: each checkpoint written pushed out a good one, until a resume had nothing but NaN to
    resume from. Now the run stops with exit 3 at its first checkpoint, and the good ones stay.
    (And ``--lr`` given on resuming is the learning rate: the checkpoint's optimizer state had
    set its own, silently, so the advice to resume at a lower one could not be followed.)"""
    ckpt, port = tmp_path / "ckpt", str(ports(1)[0])
    args = [sys.executable, "-m", "p2ptrain", "join", "--task", "synthetic", "--model-size", "100k", "--port", port,
            "--no-discovery", "--eval-every", "0", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"]
    # (a step of 20 ms: alone, a peer commits its rounds a tick at a time, and 30 fast rounds are one tick)
    good = subprocess.run([*args, "--max-rounds", "30", "--step-delay", "0.02"], capture_output=True, text=True,
                          timeout=150)
    assert good.returncode == 0, good.stderr[-1500:]
    kept = {f.name: f.read_bytes() for f in ckpt.glob("ckpt-r*.pt")}
    assert len(kept) >= 2
    bad = subprocess.run([*args, "--max-rounds", "20", "--lr", "1e30"], capture_output=True, text=True, timeout=150)
    assert bad.returncode == 3, bad.stderr[-1500:]
    assert "learning rate 1e+30 from --lr (the checkpoint's was " in bad.stderr
    last = bad.stderr.strip().splitlines()[-1]
    assert "the model diverged:" in last and "holds NaN or inf at update" in last and "Traceback" not in bad.stderr
    assert {f.name: f.read_bytes() for f in ckpt.glob("ckpt-r*.pt")} == kept


def test_a_disk_full_during_the_run_stops_no_training(tmp_path, monkeypatch, caplog, capfd):
    """A checkpoint the disk refuses mid-run (full, by hand on a small tmpfs: a traceback then,
    and the run's state gone with the process) is said once; training goes on, the next
    checkpoints try again, and the last one lands once there is room."""
    import torch

    from p2ptrain.commands import cli
    from p2ptrain.net import transport

    monkeypatch.setattr(transport, "install_uvloop", lambda: False)  # (no process-wide loop policy)
    save, refused = torch.save, []

    def full_for_a_while(obj, f):
        if len(refused) < 3:
            refused.append(obj["round"])
            try:  # (as torch's zip writer reports it: its own error, the disk's as its context)
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        save(obj, f)

    monkeypatch.setattr(torch, "save", full_for_a_while)
    ckpt = tmp_path / "ckpt"
    threads = torch.get_num_threads()
    try:
        code = cli.main(["join", "--task", "synthetic", "--model-size", "100k", "--no-discovery", "--port", "0",
                         "--max-rounds", "40", "--step-delay", "0.02", "--eval-every", "0", "--log-level", "warning",
                         "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capfd.readouterr().err[-1500:]
    assert len(refused) == 3
    said = [r.getMessage() for r in caplog.records if "cannot write checkpoint" in r.getMessage()]
    assert [r.levelname for r in caplog.records if "cannot write checkpoint" in r.getMessage()][0] == "WARNING"
    assert "No space left on device" in said[0] and "training goes on" in said[0]
    assert sum(r.levelname == "WARNING" for r in caplog.records if "cannot write checkpoint" in r.getMessage()) == 1
    assert (ckpt / "ckpt-r00000039.pt").exists()  # the run's end is on disk


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux), a file every write to fails")
def test_a_metrics_file_on_a_full_disk_stops_no_training(monkeypatch, caplog, capfd):
    """``--metrics`` on a disk that fills: join ended in a traceback (a small tmpfs, by hand).
    Now one warning, and the run goes on to its end and summary without records."""
    import torch

    from p2ptrain.commands import cli
    from p2ptrain.net import transport

    monkeypatch.setattr(transport, "install_uvloop", lambda: False)  # (no process-wide loop policy)
    threads = torch.get_num_threads()
    try:
        code = cli.main(["join", "--task", "synthetic", "--model-size", "100k", "--no-discovery", "--port", "0",
                         "--max-rounds", "10", "--eval-every", "0", "--log-level", "warning", "--metrics", "/dev/full"])
    finally:
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    assert code == 0 and "Traceback" not in err, err[-1500:]
    said = [r for r in caplog.records if "--metrics" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"]
    assert "/dev/full (No space left on device)" in said[0].getMessage()
    assert "summary" in out and "updates 10 in this run" in out


def test_a_join_shares_the_cores_with_the_other_joins_of_its_machine(monkeypatch, caplog):
    """Two joins on one machine that found each other by discovery (nothing says where a peer
    runs) each ran torch on every core: a 40-round run of the default task took 44-126 s on two
    cores, 16 s with a core each. A join counts the others running here (``neighbours``)."""
    import torch

    from p2ptrain.commands import cli
    from p2ptrain.commands.neighbours import Neighbours
    from p2ptrain.net import transport

    monkeypatch.setattr(transport, "install_uvloop", lambda: False)  # (no process-wide loop policy)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # (set, it is the user's choice: kept)
    other = Neighbours()  # another join of this machine, as it appears to this one
    threads = torch.get_num_threads()
    caplog.set_level("INFO", logger="p2ptrain.join")
    try:
        code = cli.main(["join", "--task", "synthetic", "--model-size", "100k", "--no-discovery", "--port", "0",
                         "--max-rounds", "5", "--eval-every", "0"])
    finally:
        other.close()
        torch.set_num_threads(threads)
    assert code == 0
    split = [r.getMessage() for r in caplog.records if "peers run on this machine" in r.getMessage()]
    assert split, "no split of the cores"
    here = int(split[0].split()[0])
    assert here >= 2 and split[0].endswith(f"{max(1, (os.cpu_count() or 1) // here)} torch thread(s) each")


def wait_for_rounds(path, n, alive, timeout=60.0):
    """Until ``n`` round records are in the metrics file at ``path`` (that peer trains)."""
    deadline = time.monotonic() + timeout
    while not (os.path.exists(path) and sum("event" not in r for r in records(path)) >= n):
        assert alive(), f"the peer writing {path} stopped"
        assert time.monotonic() < deadline, f"no {n} rounds in {path} within {timeout} s"
        time.sleep(0.05)


def test_peers_started_at_different_moments_end_at_the_same_round_with_the_same_parameters(tmp_path, monkeypatch,
                                                                                             capfd):
    """No --min-peers: the first trains alone, the others join it one after the other while it
    runs (a step takes 0.05 s: 200 rounds are at least 10 s). --max-rounds is the cluster's:
    all three leave at its round 200, with the same parameters, and nobody trains on alone.
    The three are `join` commands run in this process, each on its own thread and event loop
    (cli.main, as `python -m p2ptrain` runs it): as subprocesses, a start on a loaded machine
    (torch's import) took longer than a whole run."""
    import collections
    import logging
    import threading

    import torch

    from p2ptrain.commands import cli
    from p2ptrain.net import transport

    monkeypatch.setattr(transport, "install_uvloop", lambda: False)  # (no process-wide loop policy)
    threads_before = torch.get_num_threads()  # (join divides the cores among its local peers)
    lines = collections.defaultdict(list)  # each join's own log lines, by the thread that runs it
    handler = logging.Handler()
    handler.emit = lambda record: lines[record.threadName].append(record.getMessage())
    logging.getLogger("p2ptrain.join").addHandler(handler)
    level_before = logging.getLogger("p2ptrain.join").level
    logging.getLogger("p2ptrain.join").setLevel(logging.INFO)  # (the status lines: pytest's root logger warns only)
    mine, runners, codes = ports(3), [], {}
    paths = [tmp_path / f"m{port}.jsonl" for port in mine]
    try:
        for port, path in zip(mine, paths):
            argv = ["join", "--task", "synthetic", "--model-size", "100k", "--no-discovery", "--port", str(port),
                    "--peers", ",".join(f"127.0.0.1:{q}" for q in mine if q != port), "--max-rounds", "200",
                    "--step-delay", "0.05", "--secret", "s", "--eval-every", "0", "--metrics", str(path)]
            runner = threading.Thread(target=lambda a=argv, p=port: codes.__setitem__(p, cli.main(a)), daemon=True,
                                      name=f"join-{port}")
            runner.start()
            runners.append(runner)
            wait_for_rounds(path, 1, runner.is_alive)  # it trains (alone, or with those before it)
            time.sleep(0.5)
        left = 200 - sum("event" not in r for r in records(paths[0]))
        assert left > 20, f"the joiners started with {left} rounds of the run left"
        for runner in runners:
            runner.join(120)
    finally:
        torch.set_num_threads(threads_before)
        logging.getLogger("p2ptrain.join").removeHandler(handler)
        logging.getLogger("p2ptrain.join").setLevel(level_before)
    out = capfd.readouterr().out
    assert codes == {port: 0 for port in mine}
    runs = [records(path) for path in paths]
    summaries = [r[-1] for r in runs]
    assert all(s["event"] == "summary" for s in summaries)
    ends = {(s["end"]["round"], s["end"]["version"], s["param_checksum"]) for s in summaries}
    assert len(ends) == 1 and summaries[0]["end"]["version"] == 200, summaries
    for run, summary in zip(runs, summaries):  # each one's last round applied is the cluster's last
        assert [r for r in run if "event" not in r][-1]["round"] == summary["end"]["round"]
    assert all(any(r.get("event") == "loaded" for r in run) for run in runs[1:])  # they joined a running cluster
    assert out.count("the cluster's run ended at update 200") == 3
    assert out.count("all bit-identical") == 2  # the members compared (one kind: bit-identical, and said so)
    # Counted as the cluster's: every summary says its update count; a joiner's rounds are those
    # it applied, and its status lines show the cluster's round numbers, from the one it loaded on.
    assert {s["version"] for s in summaries} == {200}
    for run, summary, port in zip(runs[1:], summaries[1:], mine[1:]):
        assert summary["rounds"] == len([r for r in run if "event" not in r and r["samples"]]) < 200
        loaded = min(r["version"] for r in run if r.get("event") == "loaded")
        shown = [int(m) for m in re.findall(r"^update (\d+)/200  eta ", "\n".join(lines[f"join-{port}"]), re.M)]
        assert shown and all(v >= loaded for v in shown), (loaded, shown)


def test_ctrl_c_while_the_task_is_built_exits_130_at_once_saying_so(tmp_path):
    """A Ctrl-C before the peer runs (here, while its task is built) ends the command there:
    exit 130 and one line. It printed "leaving the cluster (Ctrl-C again to quit at once)" and
    exited 130 with nothing more (asyncio's own Ctrl-C cancelled the start-up, and the
    handler installed later saw the same Ctrl-C again)."""
    task = tmp_path / "interrupted_task.py"
    task.write_text(
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(REPO / 'examples')!r})\n"
        "import task_template\n"
        "def make_task(options):\n"
        "    made = task_template.make_task(options)\n"
        "    os.kill(os.getpid(), signal.SIGINT)  # (the user's Ctrl-C, as the task is built)\n"
        "    return made\n")
    p = join("--task", str(task), "--no-discovery", "--port", str(ports(1)[0]), "--max-rounds", "50")
    [(out, err)] = finish([p], timeout=120)
    assert p.returncode == 130, err[-1500:]
    assert err.rstrip().endswith("p2ptrain join: interrupted"), err[-1500:]
    assert "leaving the cluster" not in err and "listening on port" not in err and "Traceback" not in err, err[-1500:]


def test_ctrl_c_while_the_peer_opens_leaves_politely(tmp_path):
    """Once the task is built a Ctrl-C is join's own, even before the peer has opened: it
    opens, leaves, and the run ends with its summary and exit 0."""
    import signal

    opening_slowly = (
        "import asyncio, sys\n"
        "from p2ptrain.trainer import peer\n"
        "opened = peer.AsyncPeer._open\n"
        "async def slow_open(self):\n"
        "    print('opening', file=sys.stderr, flush=True)\n"
        "    await asyncio.sleep(2.0)\n"
        "    await opened(self)\n"
        "peer.AsyncPeer._open = slow_open\n"
        "from p2ptrain.commands import cli\n"
        "sys.exit(cli.main(sys.argv[1:]))\n")
    p = subprocess.Popen([sys.executable, "-c", opening_slowly, "join", "--task", "synthetic", "--model-size", "100k",
                          "--no-discovery", "--port", str(ports(1)[0]), "--metrics", str(tmp_path / "m.jsonl")],
                         env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with reaped(p):
        said = ""
        while "opening" not in said and p.poll() is None:
            said += p.stderr.readline()
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (said + err)[-1500:]
    assert "leaving the cluster" in err and "interrupted" not in err, (said + err)[-1500:]
    assert records(tmp_path / "m.jsonl")[-1]["event"] == "summary"


def test_stopped_alone_every_applied_batch_has_its_record(tmp_path):
    """Ctrl-C or SIGTERM: the summary's own samples are the records' (a peer alone applies each
    batch at once and its round is committed after, at the latest as it leaves: those last
    rounds' records were missing, one batch or more short of the summary's count)."""
    import signal

    metrics = tmp_path / "m.jsonl"
    # (the synthetic task: what is checked is the records, and the default task's start-up
    # and steps cost this test three times the CPU)
    p = join("--task", "synthetic", "--model-size", "100k", "--no-discovery", "--port", str(ports(1)[0]),
             "--eval-every", "0", "--metrics", str(metrics))
    with reaped(p):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 20):
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-1500:]
    run = [r for r in records(metrics) if r.get("event") != "training"]
    summary = run.pop()
    assert summary["event"] == "summary" and len(run) >= 20, err[-1500:]
    assert summary["unapplied"] == 0  # (alone, every batch stepped is applied at once)
    assert sum(r["own_samples"] for r in run) + summary["dropped"] == summary["own_samples"], summary
    assert summary["rounds"] == len(run) == summary["version"]


@pytest.mark.parametrize("rank", [0, 1])
def test_data_rank_n_trains_on_the_batches_ddps_rank_n_reads(tmp_path, rank):
    """A peer alone applies each batch as the plain loop would, so after six steps on stream N its
    parameters are those of the plain loop over ``train_batches(N, ...)`` (DDP's rank N), and
    not those of the other stream."""
    import torch
    from p2ptrain.tasks import load_task, param_checksum

    options = {"seed": 0, "model_size": "20k", "batch_size": 8, "data": None, "device": "cpu"}
    expected, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # (as the join's: a matmul's sums are rounded by how the cores split them)
    for stream in (0, 1):
        task = load_task("synthetic", options)
        model = task.model
        optimizer = task.make_optimizer(model.parameters(), task.default_lr)
        batches = task.train_batches(stream, 1, 8, 0)
        for _ in range(6):
            task.loss(model, next(batches), torch.device("cpu")).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        expected[stream] = param_checksum(model)
    torch.set_num_threads(threads)
    assert expected[0] != expected[1]
    p = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--task", "synthetic", "--model-size", "20k",
                        "--batch-size", "8", "--data-rank", str(rank), "--max-rounds", "6", "--no-discovery",
                        "--port", "0", "--device", "cpu", "--metrics", str(tmp_path / "m.jsonl")],
                       env=ONE_THREAD, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-1500:]
    summary = records(tmp_path / "m.jsonl")[-1]
    assert summary["event"] == "summary" and summary["param_checksum"] == expected[rank]


def test_sigterm_before_the_first_round_with_a_checkpoint_dir_exits_0_with_a_summary(tmp_path):
    """A peer waiting for a second member (--min-peers 2) is stopped before any round: it exits
    0 with its summary, and writes no checkpoint (its state is the start's). It exited 2 ("state
    ['round'] is -1 but the checkpoint is for round 0") with no summary."""
    import signal

    p = join("--task", "synthetic", "--model-size", "100k", "--no-discovery", "--port", str(ports(1)[0]),
             "--min-peers", "2", "--checkpoint-dir", str(tmp_path / "ck"))
    with reaped(p):
        said = ""
        while "listening on port" not in said and p.poll() is None:
            said += p.stderr.readline()
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (said + err)[-1500:]
    assert "summary" in out and "left before the cluster's run was over" in out, out
    assert "no round ran in this run: no checkpoint to write" in err, err[-1500:]
    assert not list((tmp_path / "ck").glob("ckpt-*"))
