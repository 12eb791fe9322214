"""`hmacore demo` end to end (real NIXL, two processes): its verification and its figures."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hmacore.demo.decode import expected_blocks
from hmacore.demo.scenario import Scenario
from hmacore.grain import cdiv
from hmacore.presets import get_preset

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.nixl


def run_demo(tmp_path, *args, timeout=240):
    out = tmp_path / "demo.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "hmacore", "demo", "--quiet", "--json", str(out),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    rep = json.loads(out.read_text()) if out.exists() else None
    return proc, rep


@pytest.mark.parametrize("preset", ["gpt-oss-120b", "deepseek-v4", "qwen3-next-80b"])
def test_demo_moves_exactly_the_clipped_blocks_and_verifies_every_byte(tmp_path, preset):
    proc, rep = run_demo(tmp_path, "--preset", preset, "--requests", "3", "--tokens", "2600")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verification: OK" in proc.stdout
    v = rep["verification"]
    assert v["ok"] and v["mismatched_pages"] == 0 and v["errors"] == []
    layout = get_preset(preset)
    sc = Scenario(preset, None, 3, 2600, 1024)
    want = [0] * layout.num_groups
    for n in sc.request_lengths():
        for g, b in enumerate(expected_blocks(layout, n)):
            want[g] += b
    page = rep["page_bytes"]
    for g, fig in enumerate(rep["groups"]):
        assert fig["blocks"] == want[g], (g, fig)
        assert fig["bytes"] == fig["blocks"] * fig["layers"] * page
    assert v["pages_checked"] == sum(f["blocks"] * f["layers"] for f in rep["groups"])
    assert v["bytes_checked"] == rep["hma"]["bytes"]
    # non-HMA: one group at the lcm block size, every layer moves every block covering the
    # request, each layer keeping its bytes per token (page / its own block size)
    lcm = layout.scheduler_block_size
    non = sum(len(s.layer_names) * cdiv(n, lcm) * lcm * page // s.block_size
              for n in sc.request_lengths() for s in layout.groups)
    assert rep["non_hma"]["bytes"] == non
    assert rep["hma"]["bytes"] < rep["non_hma"]["bytes"]
    assert rep["prefill"]["free_blocks_after"] == rep["prefill"]["num_blocks"] - 1  # all released
    # the transfer next to a memcpy of the same bytes, by wall clock and per CPU-second
    t, c = rep["transfer"], rep["transfer"]["on_cpu"]
    assert "memcpy of the same bytes" in proc.stdout and "on CPU: transfer" in proc.stdout
    assert t["seconds"] > 0 and t["memcpy_seconds"] > 0
    assert 0 < c["transfer_thread_cpu_seconds"] <= c["transfer_cpu_seconds"] + 0.01
    assert c["longest_transfer_seconds"] <= t["seconds"]
    p = rep["posting"]
    assert 0 < p["descriptors_posted"] <= p["per_block_descriptors"] == rep["hma"]["descriptors"]


def test_demo_fails_when_a_byte_differs(tmp_path):
    proc, rep = run_demo(tmp_path, "--requests", "2", "--tokens", "700", "--inject-corruption")
    assert proc.returncode == 1
    assert "verification: FAILED" in proc.stdout
    assert rep["verification"]["mismatched_pages"] == 1


def test_demo_accepts_a_layout_file_and_draws_the_plot(tmp_path):
    layout = tmp_path / "model.toml"
    layout.write_text(
        '[[groups]]\nkind = "full"\nblock_size = 16\nnum_layers = 2\nname = "full"\n\n'
        '[[groups]]\nkind = "sliding_window"\nblock_size = 16\nsliding_window = 64\n'
        'num_layers = 2\nname = "swa"\n')
    png = tmp_path / "bytes.png"
    proc, rep = run_demo(tmp_path, "--layout", str(layout), "--requests", "2", "--tokens", "500",
                         "--plot", str(png))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # 500 tokens: cdiv(64, 16) + 1 = 5 window blocks; 463 tokens: only 4 are live
    assert [g["blocks"] for g in rep["groups"]] == [32 + 29, 5 + 4]
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_demo_rejects_bad_arguments_before_starting_peers(tmp_path):
    proc, _ = run_demo(tmp_path, "--preset", "no-such-model")
    assert proc.returncode == 2 and "preset must be one of" in proc.stderr
    proc, _ = run_demo(tmp_path, "--page-bytes", "10")
    assert proc.returncode == 2 and "page_bytes" in proc.stderr


@pytest.mark.parametrize("preset", ["deepseek-v4", "qwen3-next-80b", "gemma-3-27b"])
def test_demo_store_path_hits_loads_and_verifies(tmp_path, preset):
    proc, rep = run_demo(tmp_path, "--store", "embedded", "--preset", preset, "--requests", "2",
                         "--tokens", "3000")
    assert proc.returncode == 0, proc.stderr[-2000:]
    layout = get_preset(preset)
    align = layout.scheduler_block_size
    for r in rep["requests"]:
        # the hit is the longest aligned prefix short of the whole prompt (last token recomputed)
        assert r["hit_tokens"] == (r["tokens"] - 1) // align * align
    assert rep["verification"]["ok"] and rep["verification"]["pages_checked"] > 0
    for g, fig in zip(layout.groups, rep["groups"]):
        assert fig["blocks_loaded"] > 0, fig   # every group took part in the hit
