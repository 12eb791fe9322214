"""Layering: the core and the transport modules import neither nixl nor torch at import time."""
import subprocess
import sys

import pytest

from hmacore.plan import TransferPlan
from hmacore.presets import get_preset, preset_names


def test_no_nixl_or_torch_at_import():
    code = ("import sys, hmacore.plan, hmacore.paged, hmacore.transport.nixl, "
            "hmacore.transport.handshake; "
            "bad = [m for m in ('nixl', 'nixl._api', 'torch') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("preset", preset_names())
def test_describe_every_preset(preset):
    layout = get_preset(preset)
    text = TransferPlan.from_layout(layout, 65536).describe(32768)
    for spec in layout.groups:
        assert spec.name in text
    assert "HMA:" in text and "non-HMA:" in text and "saving:" in text
