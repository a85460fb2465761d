"""``python -m p2ptrain doctor``, run for real as a subprocess, always inside an emulated LAN the
test builds (bench/netns.py): the doctor sends beacons to the multicast group and to every
interface's broadcast address, which a test must never send onto this machine's own network.
Its checks one by one, with a port taken, and with another host hearing its beacons."""

import random
import re
import subprocess
import sys

import pytest
from p2ptrain.device import pick_device
from netns_util import REPO, TCP_ECHO, make_lan, py, requires_netns, wait_line  # noqa: F401  (make_lan is a fixture)

pytestmark = pytest.mark.timeout(90)

CHECKS = ("versions", "interfaces", "multicast beacons", "broadcast beacons", "TCP port", "accelerator")
LINE = re.compile(r"^  (ok|warn|FAIL) +(.+?): (.+)$")


def doctor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The doctor's options parsed and refused: it exits before sending anything, so it may run here."""
    p = subprocess.Popen([sys.executable, "-m", "p2ptrain", "doctor", *args], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def lines(stdout: str) -> dict[str, tuple[str, str]]:
    """Check name (up to its number, for 'TCP port 7000') -> (status, detail)."""
    found = {}
    for line in stdout.splitlines():
        m = LINE.match(line)
        if m:
            name = re.sub(r" \d+$", "", m.group(2))
            found.setdefault(name, (m.group(1), m.group(3)))
    return found


def free_udp_port() -> int:
    return random.randrange(20000, 29000)  # below the ephemeral range; not the default, which tests share


@requires_netns
def test_every_check_has_a_line_and_exit_code_follows_them(make_lan):  # noqa: F811  (the fixture)
    lan = make_lan(1)
    out = lan.run(0, [sys.executable, "-m", "p2ptrain", "doctor", "--port", "0", "--discovery-port",
                      str(free_udp_port())], cwd=REPO, timeout=60)
    found = lines(out.stdout)
    assert set(CHECKS) <= set(found), out.stdout + out.stderr
    versions = found["versions"][1]
    for part in ("python 3.", "p2ptrain 0.1.0", "torch 2."):
        assert part in versions
    assert "uvloop" in out.stdout  # its version, or a warn line that it is missing
    assert re.search(r"\d+ GFLOP/s", found["accelerator"][1]), found["accelerator"]
    # The device ``join --device auto`` would train on here (cpu without an accelerator,
    # cuda:0 on a GPU machine), named by the same rule the doctor uses, and its own name.
    expected = str(pick_device("auto"))
    assert found["accelerator"][1].startswith(expected), (expected, found["accelerator"])
    assert found["accelerator"][1].split(",")[0].split(" ")[0] in {"cpu", "mps", "xpu"} | {
        f"cuda:{i}" for i in range(8)} | {"cuda"}, found["accelerator"]
    assert found["TCP port"][0] == "ok", out.stdout
    failed = [name for name, (status, _) in found.items() if status == "FAIL"]
    assert out.returncode == (1 if failed else 0), out.stdout
    assert "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("torch_v, numpy_v, expect", [
    ("2.13.0+cpu", "2.4.6", {}),
    ("2.2.2+cu121", "1.26.4", {}),
    ("2.1.0", "1.26.4", {"torch": "warn"}),
    ("2.3.0", "2.0.0", {}),
])
def test_a_torch_older_than_any_tried_is_said(monkeypatch, torch_v, numpy_v, expect):
    from p2ptrain.commands import doctor as doctor_module

    installed = {"torch": torch_v, "numpy": numpy_v, "msgpack": "1.0", "zstandard": "0.25", "uvloop": "0.19"}
    monkeypatch.setattr(doctor_module, "_version", installed.get)
    found = {c.name: c for c in doctor_module.check_versions()}
    assert {name: c.status for name, c in found.items() if name != "versions"} == expect
    for name in expect:
        assert "pip install" in found[name].detail and torch_v in found[name].detail


def test_a_torch_that_cannot_hand_tensors_to_numpy_fails_the_accelerator_line(monkeypatch):
    """torch 2.2 (built against numpy 1) beside numpy 2: the check ``join``, ``Peer`` and
    ``Group`` make (``device.check_numpy_bridge``) is the doctor's too, with the pip line."""
    import torch

    from p2ptrain import device
    from p2ptrain.commands import doctor as doctor_module

    def broken(self):
        raise RuntimeError("Numpy is not available")

    device.check_numpy_bridge.cache_clear()
    monkeypatch.setattr(torch.Tensor, "numpy", broken)
    try:
        [check] = doctor_module.check_accelerator("auto")
    finally:
        monkeypatch.undo()
        device.check_numpy_bridge.cache_clear()
    assert check.status == "FAIL" and 'cannot hand tensors to numpy' in check.detail
    assert 'pip install "numpy<2"' in check.detail


@requires_netns
def test_a_port_in_use_fails_naming_it_and_what_to_do(make_lan):  # noqa: F811  (the fixture)
    lan = make_lan(1)
    port = random.randrange(20000, 29000)  # a fresh namespace: every port is free until the listener takes one
    taken = lan.popen(0, py(TCP_ECHO, "0.0.0.0", port, 60), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)  # (killed by the LAN when the test ends)
    wait_line(taken, "READY", timeout=20)
    out = lan.run(0, [sys.executable, "-m", "p2ptrain", "doctor", "--port", str(port), "--discovery-port",
                      str(free_udp_port())], cwd=REPO, timeout=60)
    status, detail = lines(out.stdout)["TCP port"]
    assert status == "FAIL", out.stdout
    assert f"TCP port {port}: cannot listen" in out.stdout
    assert "--port" in detail and "in use" in detail.lower()
    assert out.returncode == 1
    assert "FAILed" in out.stdout.splitlines()[-1]


def test_tcp_port_alias_and_bad_options():
    bad = doctor("--tcp-port", "70000")
    assert bad.returncode == 2 and "--port" in bad.stderr and "0..65535" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    group = doctor("--group", "10.0.0.1")
    assert group.returncode == 2 and "multicast" in group.stderr


def test_help_says_the_exit_status_without_importing_torch():
    out = subprocess.run([sys.executable, "-m", "p2ptrain", "doctor", "--help"], check=False, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "Exit status: 0 when no check FAILed, 1 otherwise" in " ".join(out.stdout.split())
    assert "--discovery-port" in out.stdout and "--tcp-port" in out.stdout
    code = "import sys; from p2ptrain.commands.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    probe = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True,
                           timeout=60)
    assert probe.stdout.strip() == "False", probe.stderr


@requires_netns
def test_in_a_lan_beacons_come_back_and_reach_another_host(make_lan):  # noqa: F811  (the fixture)
    lan = make_lan(2)
    # peers lists who it heard in the last 5 s (beacon.HEARD_TTL): listening 4.5 s, it cannot forget the doctor
    listener = lan.popen(1, [sys.executable, "-m", "p2ptrain", "peers", "--all-clusters", "--seconds", "4.5"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_line(listener, "listening for", timeout=20)
        out = lan.run(0, [sys.executable, "-m", "p2ptrain", "doctor"], cwd=REPO, timeout=60)  # the defaults
        heard, _ = listener.communicate(timeout=30)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.communicate()
    found = lines(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    assert found["interfaces"][0] == "ok" and "10.77.0.10 on eth0 (wired)" in found["interfaces"][1]
    assert found["multicast beacons"] == ("ok", "sent to 239.255.77.77:29477 via eth0 and heard back")
    assert found["broadcast beacons"] == ("ok", "sent to 10.77.0.255:29477 on eth0 and heard back")
    assert "TCP port 7000: listening on 0.0.0.0:7000 and reached at 10.77.0.10:7000" in out.stdout
    assert re.search(r"10\.77\.0\.10 +7000 +- +0 +doctor +p2ptrain-doctor", heard), heard

    lan.set_link(0, False)  # the cable pulled: only loopback is left
    alone = lan.run(0, [sys.executable, "-m", "p2ptrain", "doctor", "--port", "0"], cwd=REPO, timeout=60)
    status, detail = lines(alone.stdout)["interfaces"]
    assert status == "warn" and "only loopback is up" in detail and "Connect to the LAN" in detail, alone.stdout
