"""Which network interfaces this machine has, and which one discovery should use.

``list_interfaces()`` reads the IPv4 addresses of every interface (I/O: ``getifaddrs``
through ctypes on Linux and macOS, a best-effort guess elsewhere). ``pick_address`` and
``usable_interfaces`` are pure, so the rules are tested on made-up lists:

- ``--interface NAME|ADDR`` wins; naming nothing is a ConfigError listing what exists;
- otherwise wired beats Wi-Fi beats virtual (container bridges, VPN tunnels, VM nets),
  a DHCP-less link-local 169.254.x address comes last in its kind, and loopback is used
  only when nothing else is up.

The kind is a guess from names and, on Linux, sysfs (``/sys/class/net/IF/wireless``);
on macOS from ``networksetup`` (en0 is Wi-Fi on laptops, Ethernet on desktops).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import ipaddress
import logging
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass

from p2ptrain.errors import ConfigError

log = logging.getLogger(__name__)

WIRED, WIFI, VIRTUAL = "wired", "wifi", "virtual"
_KIND_RANK = {WIRED: 0, WIFI: 1, VIRTUAL: 2}

# Names of interfaces that are not a LAN uplink: loopback, container and VM bridges,
# VPN tunnels, Apple's peer-to-peer links.
_VIRTUAL = re.compile(
    r"^(lo\d*$|docker|br-|veth|virbr|vmnet|vboxnet|utun|tun|tap|cni|flannel|cali|kube|weave|"
    r"podman|lxcbr|lxdbr|zt|tailscale|wg|awdl|llw|bridge|gif|stf|anpi|ipsec)")


@dataclass(frozen=True)
class Interface:
    """One IPv4 address of one interface (an interface with two addresses appears twice)."""

    name: str
    address: str
    netmask: str | None = None
    broadcast: str | None = None  # the subnet's broadcast address, when the link has one
    up: bool = True
    loopback: bool = False
    can_broadcast: bool = True
    multicast: bool = True
    kind: str = WIRED  # wired | wifi | virtual (loopback is virtual)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.address}, {'loopback' if self.loopback else self.kind})"


def guess_kind(name: str, *, loopback: bool = False, wifi: bool = False) -> str:
    """Wired, wifi or virtual, from the name and what the OS said about Wi-Fi."""
    if loopback or _VIRTUAL.match(name):
        return VIRTUAL
    if wifi or name.startswith(("wl", "ath")) or re.search(r"wi-?fi|wlan|wireless", name, re.I):
        return WIFI
    return WIRED


def _rank(iface: Interface) -> tuple:
    link_local = iface.address.startswith("169.254.")
    natural = [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", iface.name)]
    return (iface.loopback, _KIND_RANK.get(iface.kind, 2), link_local, natural, iface.address)


def _listing(ifaces: list[Interface]) -> str:
    return ", ".join(i.label for i in ifaces) or "none"


def pick_address(ifaces: list[Interface], override: str | None = None) -> Interface:
    """The interface discovery sends multicast on (and announces). Raises ConfigError when
    ``override`` (a name or an IPv4 address) names no interface, or when nothing is up."""
    if override:
        named = [i for i in ifaces if override in (i.name, i.address)]
        if not named:
            raise ConfigError(f"--interface {override!r} names no interface with an IPv4 address; "
                              f"pick one of: {_listing(ifaces)}")
        up = [i for i in named if i.up]
        if not up:
            raise ConfigError(f"interface {override!r} is down: bring it up, or pick one of: "
                              f"{_listing([i for i in ifaces if i.up])}")
        return min(up, key=_rank)
    up = [i for i in ifaces if i.up]
    if not up:
        raise ConfigError("no network interface with an IPv4 address is up: connect to a network, "
                          "or run every peer on this machine")
    return min(up, key=_rank)


def usable_interfaces(ifaces: list[Interface], override: str | None = None) -> list[Interface]:
    """Where discovery listens (joins the group) and broadcasts: the override's interface
    only, else every up non-loopback interface, else loopback. Best ones first."""
    if override:
        chosen = pick_address(ifaces, override)
        return [i for i in ifaces if i.name == chosen.name and i.up]
    real = sorted((i for i in ifaces if i.up and not i.loopback), key=_rank)
    return real or sorted((i for i in ifaces if i.up), key=_rank)


# -- reading the OS's interface list (I/O) ------------------------------------------------

_IFF_UP, _IFF_BROADCAST, _IFF_LOOPBACK, _IFF_RUNNING = 0x1, 0x2, 0x8, 0x40
_IFF_MULTICAST = 0x1000 if sys.platform.startswith("linux") else 0x8000  # BSD and macOS


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_Ifaddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.c_void_p),
    ("ifa_netmask", ctypes.c_void_p),
    ("ifa_broadaddr", ctypes.c_void_p),  # a union with the point-to-point destination
    ("ifa_data", ctypes.c_void_p),
]


def _ipv4(ptr: int | None) -> str | None:
    """The address in a ``struct sockaddr *`` if it is AF_INET (both sockaddr layouts)."""
    if not ptr:
        return None
    raw = ctypes.string_at(ptr, 8)
    family = int.from_bytes(raw[0:2], sys.byteorder) if sys.platform.startswith("linux") else raw[1]
    return socket.inet_ntoa(raw[4:8]) if family == socket.AF_INET else None


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)  # this process's symbols: libc on Linux and macOS
    if not hasattr(libc, "getifaddrs"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)  # find_library spawns ldconfig
    return libc


def _getifaddrs() -> list[tuple[str, int, str, str | None, str | None]]:
    libc = _libc()
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out = []
    try:
        node = head
        while node:
            ifa = node.contents
            addr = _ipv4(ifa.ifa_addr)
            if addr is not None:
                bcast = _ipv4(ifa.ifa_broadaddr) if ifa.ifa_flags & _IFF_BROADCAST else None
                out.append((ifa.ifa_name.decode(errors="replace"), ifa.ifa_flags, addr,
                            _ipv4(ifa.ifa_netmask), bcast))
            node = ifa.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out


@functools.lru_cache(maxsize=1)
def _macos_wifi_devices() -> frozenset[str]:
    """Device names of the Wi-Fi hardware ports (macOS), e.g. {'en0'}; en0 when unknown."""
    try:
        text = subprocess.run(["networksetup", "-listallhardwareports"], capture_output=True,
                              text=True, timeout=3, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset({"en0"})
    found = re.findall(r"Hardware Port: (?:Wi-Fi|AirPort)\s*\nDevice: (\S+)", text)
    return frozenset(found) if found else frozenset({"en0"})


def _is_wifi(name: str) -> bool:
    if sys.platform.startswith("linux"):
        return any(os.path.exists(f"/sys/class/net/{name}/{p}") for p in ("wireless", "phy80211"))
    if sys.platform == "darwin":
        return name in _macos_wifi_devices()
    return False


def _fallback() -> list[Interface]:
    """Best effort without getifaddrs (Windows): the address the OS would route the group
    through (a UDP connect sends nothing) and the host name's addresses; limited broadcast."""
    addrs: list[str] = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("239.255.77.77", 9))
        addrs.append(probe.getsockname()[0])
    except OSError:
        pass
    finally:
        probe.close()
    try:
        addrs += [ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    out = [Interface("lo", "127.0.0.1", "255.0.0.0", None, loopback=True, can_broadcast=False, kind=VIRTUAL)]
    for i, a in enumerate(dict.fromkeys(a for a in addrs if not a.startswith(("127.", "0.")))):
        out.append(Interface(f"if{i}", a, None, "255.255.255.255"))
    return out


def list_interfaces() -> list[Interface]:
    """Every IPv4 address of every interface, up or not. Never raises: degrades to a guess."""
    try:
        entries = _getifaddrs()
    except (OSError, AttributeError, TypeError) as exc:
        log.debug("getifaddrs unavailable (%s): guessing interfaces", exc)
        return _fallback()
    out = []
    for name, flags, addr, mask, bcast in entries:
        loop = bool(flags & _IFF_LOOPBACK) or ipaddress.IPv4Address(addr).is_loopback
        out.append(Interface(
            name=name, address=addr, netmask=mask, broadcast=bcast,
            up=bool(flags & _IFF_UP) and bool(flags & _IFF_RUNNING), loopback=loop,
            can_broadcast=bool(flags & _IFF_BROADCAST) and bcast is not None,
            multicast=bool(flags & _IFF_MULTICAST),
            kind=guess_kind(name, loopback=loop, wifi=not loop and _is_wifi(name))))
    return out
