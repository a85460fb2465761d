"""``p2ptrain.integrations``: optional; ``import p2ptrain`` never needs the frameworks, and a
missing one is named with what to install."""

import subprocess
import sys

import pytest


def test_core_and_ddp_hook_import_no_framework():
    code = ("import sys, p2ptrain, p2ptrain.integrations, p2ptrain.integrations.ddp, p2ptrain.integrations.buffers; "
            "print([m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize("module, framework, extra", [("transformers", "transformers", "transformers"),
                                                      ("lightning", "lightning", "lightning")])
def test_a_missing_framework_says_what_to_install(module, framework, extra):
    code = (f"import sys; sys.modules[{framework!r}] = None\n"  # (as if not installed)
            f"import p2ptrain.integrations.{module}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f'pip install "p2ptrain[{extra}]"' in out.stderr.strip().splitlines()[-1]
