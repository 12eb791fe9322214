"""Tier 3, store path across engines: engine A computes prompts and saves their KV to a real
Mooncake store; engine B (another process, empty local cache) loads them from the store
(external tokens > 0) and produces A's greedy tokens; a corrupted loaded block changes B's
output. Runs tests/engine/mooncake_engines.py inside ``unshare -n`` (loopback only)."""
import json
import os
import signal
import subprocess
import sys

import pytest

import engine_harness as E

pytestmark = pytest.mark.mooncake
BLOCK = 32


def test_second_engine_loads_from_mooncake(tmp_path):
    cmd = ["unshare", "-n", "--", sys.executable, os.path.join(E.HERE, "mooncake_engines.py"),
           "50071", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mooncake engines overran 600 s:\n{err[-3000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    r = json.loads(lines[-1])
    assert r["a"]["external_tokens"] == [0] * len(E.LENGTHS)
    assert r["b"]["external_tokens"] == [((n - 1) // BLOCK) * BLOCK for n in E.LENGTHS]
    assert r["b"]["tokens"] == r["a"]["tokens"]
    assert sum(r["b_corrupt"]["external_tokens"]) > 0
    assert r["b_corrupt"]["tokens"] != r["a_corrupt"]["tokens"]
    for b in r["blocks"]:
        assert b["drained"] and b["free"] == b["total"] - 1 and b["groups"] == 2, b
