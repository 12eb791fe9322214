"""`hmacore plan` / `hmacore presets`: output, JSON figures, layout files, errors."""
import json

import pytest

from hmacore.cli import main
from hmacore.presets import get_preset, preset_names


@pytest.mark.parametrize("preset", preset_names())
def test_plan_prints_groups_and_plan_for_every_preset(capsys, preset):
    assert main(["plan", "--preset", preset, "--tokens", "32768"]) == 0
    out = capsys.readouterr().out
    layout = get_preset(preset)
    assert f"hash block: {layout.hash_block_size} tokens" in out
    assert f"scheduler block: {layout.scheduler_block_size} tokens" in out
    for spec in layout.groups:
        assert spec.name in out
    assert "transfer plan:" in out and "non-HMA:" in out


def test_plan_json_matches_the_layout(capsys):
    assert main(["plan", "--preset", "deepseek-v4", "--tokens", "32768", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    layout = get_preset("deepseek-v4")
    assert doc["blocks_held"] == list(layout.blocks_for_tokens(32768, clipped=False))
    assert doc["blocks_moved"] == [128, 3, 3, 3, 17]
    assert doc["hash_block_size"] == 4 and doc["scheduler_block_size"] == 256
    assert doc["plan"]["hma"]["descriptors"] < doc["plan"]["non_hma"]["descriptors"]


def test_plan_reads_a_layout_file(tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"groups": [
        {"kind": "full", "block_size": 32, "num_layers": 2, "page_bytes": 1024, "name": "fa"},
        {"kind": "mamba", "block_size": 32, "num_layers": 2, "page_bytes": 1024, "name": "ssm"}]}))
    assert main(["plan", "--layout", str(f), "--tokens", "1000"]) == 0
    out = capsys.readouterr().out
    assert "fa" in out and "mamba/align" in out


def test_plan_errors_name_the_rule(tmp_path, capsys):
    assert main(["plan", "--preset", "nope"]) == 2
    assert "preset must be one of" in capsys.readouterr().err
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"groups": [{"kind": "cross_attention", "block_size": 16}]}))
    assert main(["plan", "--layout", str(f)]) == 2
    assert "cross-attention is not supported" in capsys.readouterr().err


def test_presets_lists_every_preset(capsys):
    assert main(["presets"]) == 0
    assert capsys.readouterr().out.split() == preset_names()
