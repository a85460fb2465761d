"""``python -m p2ptrain tls-init DIR --hosts mac,pc,box``: a CA and a certificate per machine, for ``join``'s TLS.

Writes, with the ``openssl`` command (macOS and Linux ship one; no Python package is needed):

    DIR/ca.key          the CA's private key: it stays on this machine, copied nowhere (it makes members)
    DIR/ca.pem          the CA's certificate
    DIR/HOST/HOST.pem   HOST's certificate (CN=HOST, for both ends of a link), signed by the CA
    DIR/HOST/HOST.key   its private key (mode 0600)
    DIR/HOST/ca.pem     a copy of the CA's certificate, so that DIR/HOST is all HOST needs

and prints the ``join`` flags for each machine. Keys are EC P-256 (a handshake costs about a
millisecond). Run it again with new names to add machines: an existing ``DIR/ca.key`` signs
them, and a host that already has files is refused rather than overwritten. A machine that must
leave for good needs a new CA (TLS here has no revocation): a new DIR, and every machine's files.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
import tempfile

from p2ptrain.errors import ConfigError

HELP = "make a CA and a certificate per machine for join's --tls-cert, --tls-key, --tls-ca"
DEFAULT_DAYS = 3650
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,62}")
OPENSSL_TIMEOUT = 30.0  # seconds one openssl command may take

# The extensions OpenSSL's strict checks (X509_STRICT) want: a CA that says it is one and may only
# sign, and a leaf for both ends of a TLS connection (each end is a client and a server).
CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = p2ptrain
[ca]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[host]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "python -m p2ptrain tls-init DIR --hosts NAME,NAME,... [--days N]"
    p.add_argument("dir", metavar="DIR", help="folder for the CA and one subfolder per machine (made if missing)")
    p.add_argument("--hosts", required=True, metavar="A,B,...", help="the machines' names (letters, digits, . -)")
    p.add_argument("--days", type=int, default=DEFAULT_DAYS, metavar="N", help=f"validity ({DEFAULT_DAYS})")


def run(args: argparse.Namespace) -> int:
    hosts = host_names(args.hosts)
    if not 1 <= args.days <= 36500:
        raise ConfigError(f"--days {args.days}: give 1 to 36500")
    made = make(args.dir, hosts, args.days, openssl_command())
    print(f"tls-init: {'a new' if made else 'the existing'} CA in {args.dir}, certificates for {', '.join(hosts)} "
          f"(valid {args.days} days)")
    print(f"Keep {os.path.join(args.dir, 'ca.key')} on this machine only: whoever has it can make members. Copy "
          "each machine's own folder (never ca.key) to it, and run join there with its flags:")
    for host in hosts:
        folder = os.path.join(args.dir, host)
        print(f"  {host}: --tls-cert {os.path.join(folder, host + '.pem')} --tls-key "
              f"{os.path.join(folder, host + '.key')} --tls-ca {os.path.join(folder, 'ca.pem')}")
    return 0


def host_names(text: str) -> list[str]:
    """``--hosts``: names, each once, fit for a file name and a certificate."""
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    bad = [h for h in hosts if not HOST_NAME.fullmatch(h) or h in ("ca", ".", "..")]
    if not hosts or bad:
        raise ConfigError(f"--hosts {text!r}: give machine names separated by commas, each of letters, digits, "
                          f"'.' and '-' (not 'ca'){'; bad: ' + ', '.join(map(repr, bad)) if bad else ''}")
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"--hosts {text!r}: a name given twice")
    return hosts


def openssl_command() -> str:
    found = shutil.which("openssl")
    if found is None:
        raise ConfigError("tls-init needs the openssl command, not found on PATH: install it (apt install openssl, "
                          "brew install openssl; on Windows Git for Windows has one), or run tls-init on a machine "
                          "that has it and copy the folders")
    return found


def make(folder: str, hosts: list[str], days: int, openssl: str) -> bool:
    """The CA (made unless ``folder`` has one) and each host's files; True if the CA is new.
    Raises ConfigError (nothing of that host written) for a host that has files already."""
    ca_key, ca_pem = os.path.join(folder, "ca.key"), os.path.join(folder, "ca.pem")
    taken = [h for h in hosts if os.path.exists(os.path.join(folder, h))]
    if taken:
        raise ConfigError(f"{folder}: {', '.join(taken)} already made (a folder each): pick other names, or remove "
                          "those folders to make them again")
    if os.path.exists(ca_key) != os.path.exists(ca_pem):
        raise ConfigError(f"{folder}: has one of ca.key and ca.pem but not the other: remove it, or give another DIR")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot create it ({exc.strerror})") from None
    new_ca = not os.path.exists(ca_key)
    with tempfile.TemporaryDirectory() as scratch:
        config = os.path.join(scratch, "openssl.cnf")
        with open(config, "w") as f:
            f.write(CONFIG)
        if new_ca:
            _key(openssl, ca_key)
            _openssl(openssl, "req", "-x509", "-new", "-key", ca_key, "-config", config, "-extensions", "ca",
                     "-days", str(days), "-subj", f"/CN=p2ptrain CA {os.path.basename(os.path.abspath(folder))}",
                     "-out", ca_pem)
        for host in hosts:
            out = os.path.join(folder, host)
            os.makedirs(out)
            key, csr = os.path.join(out, f"{host}.key"), os.path.join(scratch, f"{host}.csr")
            _key(openssl, key)
            _openssl(openssl, "req", "-new", "-key", key, "-config", config, "-subj", f"/CN={host}", "-out", csr)
            _openssl(openssl, "x509", "-req", "-in", csr, "-CA", ca_pem, "-CAkey", ca_key, "-set_serial",
                     f"0x{secrets.token_hex(16)}", "-days", str(days), "-extfile", config, "-extensions", "host",
                     "-out", os.path.join(out, f"{host}.pem"))
            shutil.copyfile(ca_pem, os.path.join(out, "ca.pem"))
    return new_ca


def _key(openssl: str, path: str) -> None:
    """An EC P-256 private key at ``path``, readable by this user only (from the start: made
    empty with that mode, then written by openssl)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    _openssl(openssl, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", path)


def _openssl(openssl: str, *argv: str) -> None:
    try:
        done = subprocess.run([openssl, *argv], capture_output=True, text=True, timeout=OPENSSL_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"openssl {argv[0]} failed to run ({exc})") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ConfigError(f"openssl {argv[0]} failed (exit {done.returncode}): {last}")
