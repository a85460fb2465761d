"""``python -m p2ptrain peers``: who is announcing itself on this LAN, like avahi-browse.

Listens for discovery beacons for a few seconds and prints one line per peer heard. It
sends no beacon of its own, so it never joins or disturbs a cluster. Exits 0 even when
nobody is heard (then it says why that may be).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from p2ptrain.net import wire
from p2ptrain.net.discovery import DEFAULT_GROUP, DEFAULT_UDP_PORT, Discovery, likely_causes
from p2ptrain.commands import options
from p2ptrain.commands.cli import secret_option
from p2ptrain.errors import ConfigError
from p2ptrain.identity import new_peer_id

HELP = "list the peers announcing themselves on this LAN (listens for a few seconds, sends nothing)"
MAX_SECONDS = 3600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default="default", help="cluster to list (default: default)")
    p.add_argument("--all-clusters", action="store_true",
                   help="list the peers of every cluster (with a secret: those that share it)")
    p.add_argument("--secret", help="shared secret of the cluster (default: $P2PTRAIN_SECRET)")
    p.add_argument("--secret-file", help="read the shared secret from this file")
    p.add_argument("--seconds", type=options.number(above=0), default=3.0, help="how long to listen (default: 3)")
    p.add_argument("--interface", help="listen on this interface (a name or an IPv4 address)")
    p.add_argument("--group", default=DEFAULT_GROUP, help=f"discovery multicast group (default: {DEFAULT_GROUP})")
    p.add_argument("--discovery-port", type=options.port(1), default=DEFAULT_UDP_PORT,
                   help=f"discovery UDP port (default: {DEFAULT_UDP_PORT})")


def format_table(rows: list[tuple]) -> list[str]:
    """Left-aligned columns, the header first."""
    header = ("ID", "HOST", "PORT", "DEVICE", "ROUND", "STATE", "CLUSTER", "VERSION")
    table = [header, *[tuple(str(c) for c in r) for r in rows]]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]


async def _listen(args: argparse.Namespace, secret: bytes | None) -> int:
    cluster = None if args.all_clusters else args.cluster
    disc = Discovery(cluster, new_peer_id(), 0, secret, group=args.group, udp_port=args.discovery_port,
                     interface=args.interface, send_beacons=False, silence_warning_after=None)
    logger = logging.getLogger("p2ptrain.net.discovery")
    level = logger.level
    if args.log_level != "debug":  # this command prints its own summary of what discovery logs
        logger.setLevel(logging.ERROR)
    try:
        async with disc:
            where = ", ".join(i.label for i in disc.interfaces)
            print(f"listening for {args.seconds:g} s on {where} (UDP {args.group}:{args.discovery_port}) ...",
                  flush=True)
            await asyncio.sleep(args.seconds)
            heard = disc.heard()
    finally:
        logger.setLevel(level)
    flt = disc.filter
    heard.sort(key=lambda p: (p.beacon.cluster, p.beacon.peer_id))
    rows = [(p.beacon.peer_id, p.ip, p.beacon.port, p.beacon.device, p.beacon.round, p.beacon.state,
             p.beacon.cluster, p.beacon.version) for p in heard]
    for line in format_table(rows) if rows else []:
        print(line)
    drops = flt.describe_drops()
    if drops:
        hints = []
        if flt.counts["bad_tag"]:
            hints.append("a bad tag means another --secret, or none")
        if flt.counts["other_cluster"]:
            hints.append("--all-clusters shows other clusters")
        if flt.counts["other_version"]:
            hints.append(f"version {flt.last_other_version} came from {flt.last_other_version_from}, "
                         f"this p2ptrain speaks {wire.PROTOCOL_VERSION}")
        print(drops + (f"; {'; '.join(hints)}" if hints else ""))
    if not rows:
        scope = "any cluster" if cluster is None else f"cluster {cluster!r}"
        print(f"no peer of {scope} heard in {args.seconds:g} s; {likely_causes(args.discovery_port)}")
    else:
        print(f"{len(rows)} peer{'s' if len(rows) != 1 else ''} heard")
    return 0


def run(args: argparse.Namespace) -> int:
    if not 0 < args.seconds <= MAX_SECONDS:
        raise ConfigError(f"--seconds must be in (0, {MAX_SECONDS:g}], got {args.seconds:g}")
    secret = secret_option(args.secret, args.secret_file)
    return asyncio.run(_listen(args, secret))
