"""``python -m p2ptrain doctor``: check what usually breaks a first run, and say what to do.

    python -m p2ptrain doctor                  # the defaults that join and peers use
    python -m p2ptrain doctor --port 7100 --interface eth1

One line per check, ``ok``, ``warn`` (works, but read the advice) or ``FAIL`` (a first
run will not work until it is fixed), in this order: versions; the interface peers will
reach this machine on, and why that one; discovery beacons sent to the multicast group and
to each interface's broadcast address, and whether they come back to our own receiving
socket on the discovery port (this proves the local stack and firewall pass them, not that
a Wi-Fi access point forwards them: ``peers`` on another machine tells that); a TCP
listener on the join port, reached through the chosen address; the accelerator and a
rough GFLOP/s figure. torch is imported only by that last check, so the others answer
even when torch is broken. Everything is bounded: about 1 s of beacons, 2 s of TCP.

Exit status: 0 when no check FAILed (warnings allowed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import importlib.util
import ipaddress
import itertools
import os
import platform
import select
import shutil
import socket
import sys
import time
from dataclasses import dataclass

from p2ptrain import __version__
from p2ptrain.commands import options
from p2ptrain.net.beacon import Beacon, BeaconFilter, encode_beacon
from p2ptrain.net.discovery import DEFAULT_GROUP, DEFAULT_UDP_PORT
from p2ptrain.errors import ConfigError
from p2ptrain.identity import new_peer_id
from p2ptrain.net.interfaces import (
    VIRTUAL,
    WIFI,
    Interface,
    list_interfaces,
    pick_address,
    usable_interfaces,
)

HELP = "check this machine for a first run: versions, interfaces, beacons, TCP port, accelerator"
EPILOG = ("Prints one line per check: ok, warn (works; read the advice) or FAIL (fix it first). "
          "Exit status: 0 when no check FAILed, 1 otherwise.")

OK, WARN, FAIL = "ok", "warn", "FAIL"
DOCTOR_CLUSTER = "p2ptrain-doctor"  # real peers drop these beacons silently: another cluster
SEND_ROUNDS = 3  # beacons per destination, at most
SEND_GAP = 0.25  # seconds between two rounds of beacons
LISTEN_SECONDS = 1.0  # how long to wait for them to come back (less once all have)
TCP_TIMEOUT = 2.0
SPEED_SECONDS = 0.2
_TOKEN = b"p2ptrain-doctor"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    status: str  # OK | WARN | FAIL
    name: str
    detail: str

    def line(self) -> str:
        return f"  {self.status:<6}{self.name}: {self.detail}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("--port", "--tcp-port", dest="port", type=options.port(), default=options.env("port", "7000"),
                   help="TCP port join will listen on (default 7000, as join; 0 = any free port)")
    p.add_argument("--interface", help="check this interface (a name or an IPv4 address) instead of the best one")
    p.add_argument("--group", default=DEFAULT_GROUP, help=f"discovery multicast group (default: {DEFAULT_GROUP})")
    p.add_argument("--discovery-port", type=options.port(1), default=DEFAULT_UDP_PORT,
                   help=f"discovery UDP port (default: {DEFAULT_UDP_PORT})")
    p.add_argument("--device", default=options.env("device", "auto"),
                   help="device to check: auto|cpu|cuda[:i]|mps|xpu (default: auto, as join)")


# -- versions ---------------------------------------------------------------------------------

def _version(dist: str) -> str | None:
    """The installed version of ``dist`` without importing it; '?' when installed without metadata."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?" if importlib.util.find_spec(dist) is not None else None


def check_versions() -> list[Check]:
    py = platform.python_version()
    found = {name: _version(name) for name in ("torch", "numpy", "msgpack", "zstandard")}
    parts = [f"python {py}", f"p2ptrain {__version__}"] + [f"{n} {v}" for n, v in found.items() if v]
    checks = []
    if sys.platform == "win32":
        parts.append("uvloop not used on Windows")
    elif _version("uvloop"):
        parts.append(f"uvloop {_version('uvloop')}")
    else:
        checks.append(Check(WARN, "uvloop", "not installed: asyncio's own event loop works, a little slower. "
                                            "pip install uvloop"))
    checks.insert(0, Check(OK, "versions", ", ".join(parts)))
    for name, v in found.items():
        if v is None:
            checks.append(Check(FAIL, name, f"not installed: pip install {name}"))
    torch_v = _release(found["torch"])  # (a torch that cannot hand tensors to numpy: the accelerator line)
    if torch_v and torch_v < OLDEST_TORCH:
        checks.append(Check(WARN, "torch", f"{found['torch']} is older than any torch p2ptrain was tried with "
                                           f"({'.'.join(map(str, OLDEST_TORCH))}): pip install -U torch"))
    return checks


OLDEST_TORCH = (2, 2)  # (pyproject's floor: the oldest torch the suite ran on)


def _release(version: str | None) -> tuple[int, ...] | None:
    """The leading numbers of a version ('2.2.2+cu121' -> (2, 2, 2)); None if it has none."""
    numbers = []
    for part in (version or "").split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers) or None


# -- interfaces -------------------------------------------------------------------------------

def check_interfaces(override: str | None) -> tuple[list[Check], Interface | None, list[Interface]]:
    """The line about the chosen interface, the interface, and every usable one."""
    ifaces = list_interfaces()
    try:
        chosen = pick_address(ifaces, override)
        usable = usable_interfaces(ifaces, override)
    except ConfigError as exc:
        return [Check(FAIL, "interfaces", str(exc))], None, []
    others = [i for i in ifaces if i.up and i.name != chosen.name]
    also = f"; also up: {', '.join(i.label for i in others)}" if others else ""
    where = f"peers will reach this machine at {chosen.address} on {chosen.name} ({chosen.kind})"
    if override:
        return [Check(OK, "interfaces", f"{where}: chosen with --interface{also}")], chosen, usable
    if chosen.loopback:
        return [Check(WARN, "interfaces", f"only loopback is up ({chosen.label}): peers on other machines "
                                          "cannot reach this one. Connect to the LAN, or run every peer here")
                ], chosen, usable
    if chosen.kind == VIRTUAL:
        return [Check(WARN, "interfaces", f"{where}, a virtual link (container bridge, VPN or VM): peers on "
                                          "the LAN may not reach it. Connect a wired or Wi-Fi network, or pick "
                                          f"one with --interface{also}")], chosen, usable
    if chosen.address.startswith("169.254."):
        return [Check(WARN, "interfaces", f"{where}, a link-local address (no DHCP answer): check the "
                                          f"network's DHCP, or give every peer a static address{also}")
                ], chosen, usable
    why = "wired is preferred to Wi-Fi, then virtual links and loopback"
    if chosen.kind == WIFI:
        why = "no wired link is up (wired is faster, and some access points drop multicast)"
    return [Check(OK, "interfaces", f"{where}: {why}{also}")], chosen, usable


# -- beacons ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Probe:
    kind: str  # "multicast" | "broadcast"
    dest: tuple[str, int]
    via: str  # interface name
    peer_id: str  # each destination's beacons carry their own id, to tell which came back


def _receiver(group: str, udp_port: int, usable: list[Interface]) -> socket.socket:
    """A socket bound like discovery's: the port shared (REUSEADDR/REUSEPORT), the group joined."""
    rsock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            try:
                rsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            except OSError:
                pass
        rsock.bind(("", udp_port))
    except OSError:
        rsock.close()
        raise
    for iface in usable:
        try:
            rsock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                             socket.inet_aton(group) + socket.inet_aton(iface.address))
        except OSError:
            pass  # a second address of a joined interface; a missing join shows as silence below
    return rsock


def _sender(chosen: Interface) -> socket.socket:
    ssock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ssock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    for opt in (socket.IP_MULTICAST_TTL, socket.IP_MULTICAST_LOOP):  # TTL 1: never off the LAN
        try:
            ssock.setsockopt(socket.IPPROTO_IP, opt, 1)
        except OSError:
            ssock.setsockopt(socket.IPPROTO_IP, opt, b"\x01")  # some BSDs take a byte
    try:
        ssock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(chosen.address))
    except OSError:
        pass  # the send then goes by the routing table, and its error is reported
    return ssock


def _exchange(rsock: socket.socket, ssock: socket.socket, probes: list[_Probe],
              announce_port: int) -> tuple[set[str], dict[str, str]]:
    """Send each probe's beacon up to SEND_ROUNDS times; return the ids heard back and the
    send errors by id. Stops after LISTEN_SECONDS, or as soon as every beacon came back."""
    datagrams = {p.peer_id: encode_beacon(Beacon(cluster=DOCTOR_CLUSTER, peer_id=p.peer_id, port=announce_port,
                                                 device="-", state="doctor"), None) for p in probes}
    flt = BeaconFilter(cluster=DOCTOR_CLUSTER, peer_id=None, secret=None)
    heard: set[str] = set()
    errors: dict[str, str] = {}
    start = time.monotonic()
    deadline, next_send, rounds = start + LISTEN_SECONDS, start, 0
    while len(heard) < len(probes):
        now = time.monotonic()
        if now >= deadline:
            break
        if rounds < SEND_ROUNDS and now >= next_send:
            for p in probes:
                if p.peer_id in heard:
                    continue
                try:
                    ssock.sendto(datagrams[p.peer_id], p.dest)
                except OSError as exc:  # ENETUNREACH (no route), EPERM (a firewall), ENOBUFS
                    errors[p.peer_id] = exc.strerror or str(exc)
            rounds += 1
            next_send = now + SEND_GAP
        wake = min(deadline, next_send) if rounds < SEND_ROUNDS else deadline
        ready, _, _ = select.select([rsock], [], [], max(0.0, wake - now))
        if ready:
            try:
                data, addr = rsock.recvfrom(2048)
            except OSError:
                continue
            beacon = flt.accept(data, addr[0], now)
            if beacon is not None and beacon.peer_id in datagrams:
                heard.add(beacon.peer_id)
    return heard, errors


def check_beacons(group: str, udp_port: int, chosen: Interface | None, usable: list[Interface],
                  announce_port: int) -> list[Check]:
    if chosen is None:
        return [Check(FAIL, "beacons", "not sent: no interface to send them on (see the interfaces line)")]
    try:
        rsock = _receiver(group, udp_port, usable)
    except OSError as exc:
        return [Check(FAIL, "beacons", f"cannot listen on UDP port {udp_port} ({exc.strerror}): another program "
                                       "holds it; stop it, or pick another --discovery-port on every peer")]
    base = new_peer_id()
    probes = [_Probe("multicast", (group, udp_port), chosen.name, f"{base}-m")]
    probes += [_Probe("broadcast", (i.broadcast, udp_port), i.name, f"{base}-b{n}")
               for n, i in enumerate(usable) if i.can_broadcast and i.broadcast]
    try:
        ssock = _sender(chosen)
        try:
            heard, errors = _exchange(rsock, ssock, probes, announce_port or 1)  # a beacon's port is 1..65535
        finally:
            ssock.close()
    finally:
        rsock.close()

    checks = []
    some_back = bool(heard)
    for p in probes:
        what = f"{p.kind} beacons"
        sent = f"sent to {p.dest[0]}:{p.dest[1]} {'via' if p.kind == 'multicast' else 'on'} {p.via}"
        if p.peer_id in heard:
            tip = ""
            if chosen.kind == WIFI and p.kind == "multicast":
                tip = " (whether the Wi-Fi forwards them, `python -m p2ptrain peers` on another machine tells)"
            checks.append(Check(OK, what, f"{sent} and heard back{tip}"))
            continue
        status = WARN if some_back else FAIL
        if p.peer_id in errors:
            problem = f"cannot be {sent} ({errors[p.peer_id]})"
        else:
            problem = f"{sent} but none came back within {LISTEN_SECONDS:g} s"
        advice = ("the other kind still works, so peers can find each other" if some_back else
                  f"a firewall on this machine may block UDP port {udp_port} (on macOS, allow Python in the "
                  "firewall prompt); where discovery cannot work, give addresses with --peers host:port")
        checks.append(Check(status, what, f"{problem}: {advice}"))
    if len(probes) == 1 and not chosen.loopback:  # loopback only: the interfaces line said it
        checks.append(Check(WARN, "broadcast beacons", "none sent: no usable interface can broadcast; some Wi-Fi "
                                                       "drops multicast, and then only --peers works"))
    return checks


# -- TCP --------------------------------------------------------------------------------------

def check_tcp(port: int, chosen: Interface | None) -> list[Check]:
    """Listen like join (every address, SO_REUSEADDR off Windows) and connect through the chosen address."""
    name = f"TCP port {port}" if port else "TCP port"
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if os.name != "nt":
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("0.0.0.0", port))
            listener.listen(1)
        except OSError as exc:
            in_use = exc.errno in (errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", errno.EADDRINUSE))
            advice = ("another program (a running join?) holds it: stop it, or give this peer another --port"
                      if in_use else "use a port from 1024 to 65535 that nothing else holds (--port)")
            if in_use and sys.platform == "darwin" and port in (5000, 7000):
                advice = ("on macOS the AirPlay Receiver often holds it: turn that off (System Settings, AirDrop & Handoff), "
                          "or give every peer another --port")
            return [Check(FAIL, name, f"cannot listen ({exc.strerror or exc}): {advice}")]
        bound = listener.getsockname()[1]
        name = f"TCP port {bound}"
        host = chosen.address if chosen is not None else "127.0.0.1"
        listener.settimeout(TCP_TIMEOUT)
        try:
            with socket.create_connection((host, bound), timeout=TCP_TIMEOUT) as client:
                conn, _ = listener.accept()
                with conn:
                    client.sendall(_TOKEN)
                    conn.settimeout(TCP_TIMEOUT)
                    got = conn.recv(len(_TOKEN))
            if got != _TOKEN:
                raise OSError(f"{len(got)} of {len(_TOKEN)} test bytes arrived")
        except OSError as exc:
            why = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
            return [Check(FAIL, name, f"listening, but connecting to {host}:{bound} failed ({why}): a firewall on "
                                      f"this machine may block TCP port {bound}; allow it")]
        any_port = " (a free port, as --port 0 asked)" if port == 0 else ""
        return [Check(OK, name, f"listening on 0.0.0.0:{bound} and reached at {host}:{bound}{any_port}")]
    finally:
        listener.close()


# -- accelerator (imports torch) --------------------------------------------------------------

def _nvidia_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def check_accelerator(spec: str) -> list[Check]:
    try:
        import torch

        from p2ptrain.device import device_kind, pick_device, quick_speed
    except Exception as exc:  # noqa: BLE001 - a broken torch install raises anything
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        return [Check(FAIL, "accelerator", f"torch cannot be imported ({first}): reinstall it, pip install torch")]
    try:
        device = pick_device(spec)
    except ConfigError as exc:
        return [Check(FAIL, "accelerator", str(exc))]
    kind = device_kind(device)
    try:
        gflops = quick_speed(device, SPEED_SECONDS)
    except Exception as exc:  # noqa: BLE001 - CUDA/MPS runtime errors have many types
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        return [Check(FAIL, "accelerator", f"{device} fails a matmul ({first}): check its driver, or use "
                                           "--device cpu")]
    what = str(device)
    if kind == "cuda":
        what += f" ({torch.cuda.get_device_name(device)})"
    cuda = (f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available()
            else f"CUDA {torch.version.cuda} built, no GPU visible" if torch.version.cuda
            else "no CUDA in this torch build")
    mps_backend = getattr(torch.backends, "mps", None)
    mps = ("MPS available" if mps_backend is not None and mps_backend.is_available()
           else "MPS built, not available" if mps_backend is not None and mps_backend.is_built()
           else "no MPS")
    detail = f"{what}, {gflops:.0f} GFLOP/s float32 matmul (torch {torch.__version__}; {cuda}; {mps})"
    if kind == "cpu" and spec.strip().lower() in ("auto", ""):
        if torch.version.cuda and _nvidia_present():
            return [Check(WARN, "accelerator", f"{detail}: an NVIDIA GPU is here but torch cannot use it; "
                                               "check the driver with nvidia-smi")]
        if not torch.version.cuda and _nvidia_present():
            return [Check(WARN, "accelerator", f"{detail}: an NVIDIA GPU is here but this torch is a CPU-only "
                                               "build; install a CUDA build (pytorch.org, Get Started)")]
        if sys.platform == "darwin" and platform.machine() == "arm64":
            return [Check(WARN, "accelerator", f"{detail}: Apple silicon without MPS; upgrade macOS (12.3 or "
                                               "newer) and torch")]
    return [Check(OK, "accelerator", detail)]


# -- the command ------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    try:
        if not ipaddress.IPv4Address(args.group).is_multicast:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--group {args.group!r} is not an IPv4 multicast address (224.0.0.0/4)") from None

    print("p2ptrain doctor: checking this machine for a first run (a few seconds)", flush=True)
    results: list[Check] = []

    def report(checks: list[Check]) -> None:
        for c in checks:
            print(c.line(), flush=True)
        results.extend(checks)

    report(check_versions())
    iface_checks, chosen, usable = check_interfaces(args.interface)
    report(iface_checks)
    report(check_beacons(args.group, args.discovery_port, chosen, usable, args.port))
    report(check_tcp(args.port, chosen))
    report(check_accelerator(args.device))

    fails = sum(c.status == FAIL for c in results)
    warns = sum(c.status == WARN for c in results)
    if fails:
        print(f"{fails} check(s) FAILed, {warns} warning(s): fix the FAIL lines first; a first run will not work "
              "until they pass")
        return 1
    print(f"no check failed ({warns} warning(s)): `python -m p2ptrain join` on every machine" if warns
          else "all checks passed: run `python -m p2ptrain join` on every machine")
    return 0
