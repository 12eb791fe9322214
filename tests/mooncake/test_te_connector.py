"""HmaNixlConnector with ``"transport": "mooncake"``: tests/vllm/test_pd_nixl.py (vLLM's real
Scheduler + SCHEDULER- and WORKER-role connectors of two engines, pull mode) run again over
the Mooncake Transfer Engine, inside ``unshare -n`` with only ``lo`` up: the right bytes for
gemma (full + sliding), qwen3-next (Mamba + full) and deepseek-v4 (MLA) shaped requests, dead
and restarted prefill peers, sync loads, aborts, stats; plus the start-up refusals."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.mooncake
@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_pull_connector_over_mooncake_te():
    env = {**os.environ, "HMACORE_TEST_TRANSPORT": "mooncake", "GLOG_minloglevel": "2",
           "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    script = (f"ip link set lo up && cd {ROOT} && exec {sys.executable} -m pytest -q "
              "-p no:cacheprovider tests/vllm/test_pd_nixl.py")
    proc = subprocess.Popen(["unshare", "-n", "--", "bash", "-c", script], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=1100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"overran:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and "failed" not in out and "skipped" not in out, out[-3000:]
