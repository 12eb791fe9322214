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


def test_describe_layout_plan_for_cli():
    from hmacore.plan import describe_layout_plan
    from hmacore.spec import GroupKind, GroupSpec, KVLayout
    text, doc = describe_layout_plan(get_preset("gpt-oss"), 131072)
    assert doc["hma"]["descriptors"] == 18 * (9 + 8192) and doc["non_hma"]["descriptors"] == 36 * 8192
    assert "non-HMA" in text
    unknown = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a", "b")),
                               GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("c", "d"), sliding_window=32)))
    text, doc = describe_layout_plan(unknown, 100)
    assert doc["hma"]["bytes"] is None and doc["groups"][1]["blocks"] == 3
    assert doc["hma"]["descriptors"] == 2 * (7 + 3)
