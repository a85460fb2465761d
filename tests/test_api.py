"""The public surface: what ``import p2ptrain`` offers, and the command's front door."""

import subprocess
import sys

import p2ptrain


def test_exports_are_pinned():
    assert sorted(p2ptrain.__all__) == sorted([
        "__version__", "Group", "AsyncPeer", "Peer", "DistributedOptimizer",
        "P2PTrainError", "ConfigError", "RemoteProtocolError", "FrameError", "CodecError",
        "HandshakeError", "LinkError", "GroupError", "ClosedError", "FingerprintError", "SettingsError",
        "CheckpointError", "NotFiniteError", "DivergedError",
    ])
    for name in p2ptrain.__all__:
        assert getattr(p2ptrain, name) is not None


def test_every_error_has_one_root():
    for name in p2ptrain.__all__:
        obj = getattr(p2ptrain, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, p2ptrain.P2PTrainError)
    assert issubclass(p2ptrain.ConfigError, ValueError)
    assert issubclass(p2ptrain.CodecError, p2ptrain.RemoteProtocolError)
    assert issubclass(p2ptrain.NotFiniteError, p2ptrain.ConfigError)  # (a value the caller gave)


def test_import_does_not_load_torch():
    code = "import sys, p2ptrain, p2ptrain.commands.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_help_and_no_command():
    ok = subprocess.run([sys.executable, "-m", "p2ptrain", "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "join" in ok.stdout and "peers" in ok.stdout
    bare = subprocess.run([sys.executable, "-m", "p2ptrain"], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2
    bad = subprocess.run([sys.executable, "-m", "p2ptrain", "jion"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
