"""Interface selection rules, on made-up interface lists; and this machine's real list."""

from __future__ import annotations

import pytest

from p2ptrain.errors import ConfigError
from p2ptrain.net.interfaces import (VIRTUAL, WIFI, WIRED, Interface, guess_kind, list_interfaces, pick_address,
                                 usable_interfaces)


def iface(name: str, address: str, kind: str | None = None, **kw) -> Interface:
    loopback = kw.pop("loopback", name.startswith("lo"))
    return Interface(name, address, "255.255.255.0", None if loopback else address.rsplit(".", 1)[0] + ".255",
                     loopback=loopback, can_broadcast=not loopback,
                     kind=kind or guess_kind(name, loopback=loopback), **kw)


LO = iface("lo", "127.0.0.1")
ETH = iface("eth0", "192.168.1.20")
WLAN = iface("wlan0", "192.168.1.21", WIFI)
DOCKER = iface("docker0", "172.17.0.1")
BR = iface("br-3f2a9c1d", "172.18.0.1")
VETH = iface("veth12ab", "169.254.3.3")
VIRBR = iface("virbr0", "192.168.122.1")
TUN = iface("utun3", "10.8.0.2")
CONTAINERS = [LO, DOCKER, BR, VETH, VIRBR, TUN]


@pytest.mark.parametrize("name,kind", [
    ("eth0", WIRED), ("enp3s0", WIRED), ("en0", WIRED), ("wlan0", WIFI), ("wlp2s0", WIFI),
    ("docker0", VIRTUAL), ("br-3f2a9c1d", VIRTUAL), ("veth12ab", VIRTUAL), ("virbr0", VIRTUAL),
    ("vmnet8", VIRTUAL), ("utun3", VIRTUAL), ("tun0", VIRTUAL), ("tap0", VIRTUAL), ("cni0", VIRTUAL),
    ("flannel.1", VIRTUAL), ("lo", VIRTUAL), ("lo0", VIRTUAL), ("br0", WIRED), ("lowpan0", WIRED),
])
def test_guess_kind_from_name(name, kind):
    assert guess_kind(name) == kind


def test_guess_kind_trusts_the_os_about_wifi():
    assert guess_kind("en0", wifi=True) == WIFI
    assert guess_kind("lo", loopback=True, wifi=True) == VIRTUAL


def test_wired_beats_wifi_in_any_order():
    assert pick_address([WLAN, ETH]) == ETH
    assert pick_address([ETH, WLAN]) == ETH


def test_real_interface_beats_every_bridge_tunnel_and_loopback():
    for real in (ETH, WLAN):
        assert pick_address([*CONTAINERS, real]) == real
        assert pick_address([real, *reversed(CONTAINERS)]) == real


def test_loopback_only_when_nothing_else_is_up():
    assert pick_address([LO]) == LO
    down = iface("eth0", "192.168.1.20", up=False)
    assert pick_address([down, LO]) == LO
    assert pick_address([LO, DOCKER]) == DOCKER  # a bridge is still better than loopback


def test_link_local_address_comes_after_a_dhcp_one():
    ll = iface("eth0", "169.254.7.7")
    eth1 = iface("eth1", "10.0.0.5")
    assert pick_address([ll, eth1]) == eth1


def test_ties_broken_by_natural_name_order():
    eth10, eth2 = iface("eth10", "10.0.0.10"), iface("eth2", "10.0.0.2")
    assert pick_address([eth10, eth2]) == eth2


def test_override_by_name_and_by_address():
    ifaces = [LO, ETH, WLAN, DOCKER]
    assert pick_address(ifaces, "wlan0") == WLAN
    assert pick_address(ifaces, "172.17.0.1") == DOCKER
    assert pick_address(ifaces, "lo") == LO


def test_unknown_override_lists_the_interfaces():
    with pytest.raises(ConfigError) as err:
        pick_address([LO, ETH, WLAN], "eth9")
    msg = str(err.value)
    assert "eth9" in msg and "eth0 (192.168.1.20, wired)" in msg and "wlan0" in msg and "lo (127.0.0.1" in msg
    assert "\n" not in msg


def test_override_of_a_down_interface_says_so():
    with pytest.raises(ConfigError, match="down"):
        pick_address([LO, iface("eth0", "192.168.1.20", up=False)], "eth0")


def test_nothing_up_is_a_config_error():
    with pytest.raises(ConfigError):
        pick_address([])


def test_usable_interfaces_are_every_real_one_best_first():
    assert usable_interfaces([LO, DOCKER, WLAN, ETH]) == [ETH, WLAN, DOCKER]
    assert usable_interfaces([LO]) == [LO]
    assert usable_interfaces([LO, ETH, WLAN], "wlan0") == [WLAN]
    assert usable_interfaces([LO, ETH], "lo") == [LO]


def test_list_interfaces_on_this_machine_has_loopback():
    ifaces = list_interfaces()
    lo = [i for i in ifaces if i.loopback]
    assert lo and lo[0].address.startswith("127.") and lo[0].up and lo[0].kind == VIRTUAL
    for i in ifaces:
        assert i.name and i.address.count(".") == 3
        if i.can_broadcast:
            assert i.broadcast
    assert pick_address(ifaces).up
