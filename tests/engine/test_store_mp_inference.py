"""Tier 3, store path under vLLM's default multiprocess engine (issue 17, item 4).

``VLLM_ENABLE_V1_MULTIPROCESSING`` unset: vLLM runs the engine core (scheduler side of the
connector) and the CPU worker (worker side) in two processes of their own. The embedded
store's default scope (``auto``) is then the shared-memory store: the second run of the same
prompts, after the local prefix cache was reset, must load from it (external tokens = the
longest aligned hit, short of the last prompt token) and give the same greedy tokens; the
segment exists while the engine runs and is gone once it shut down.

Control: the same engine with ``store_scope: "process"`` (one in-process store per process,
the behaviour before the shared store) never hits, which is what this test would see if the
shared store did not work.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import engine_harness as E
from hmacore.demo.engine_driver import store_config

BLOCK = 32
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT = 900          # seconds: start-up (two processes), two runs and shut-down, loaded host


def _run_child(model: Path, ktc: dict, prompts: list[list[int]], out: Path, log: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")]),
               VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1",
               TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL="INFO")
    env.setdefault("VLLM_CACHE_ROOT", str(out.parent / "vllm-cache"))
    argv = [sys.executable, str(HERE / "store_mp_run.py"), str(model), json.dumps(ktc),
            json.dumps(prompts), str(E.MAX_TOKENS), str(out)]
    with open(log, "wb") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:                     # the child's whole session, by PID
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(60)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert rc == 0, f"engine child failed (rc={rc})\n{tail}"
    res = json.loads(out.read_text())
    res["log"] = log.read_text(errors="replace")
    return res


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return E.model_dir(tmp_path_factory.mktemp("store-mp-model"), "gemma3")


def test_shared_store_reloads_in_the_multiprocess_engine(model, tmp_path):
    prompts = E.prompt_sets(["store-mp"])["store-mp"]
    ktc = store_config("kv_both", store_capacity_bytes=64 << 20)
    res = _run_child(model, ktc, prompts, tmp_path / "out.json", tmp_path / "engine.log")
    assert res["backend"] == "mp" and len(res["engine_pids"]) >= 2, res["engine_pids"]
    assert res["segment_while_running"]
    assert "shared store /dev/shm/hmacore-kv-" in res["log"]
    assert res["first"]["cached"] == [0] * len(prompts)             # nothing stored yet
    assert res["second"]["cached"] == [((n - 1) // BLOCK) * BLOCK for n in E.LENGTHS]
    assert res["second"]["tokens"] == res["first"]["tokens"], \
        [E.first_divergence(a, b) for a, b in zip(res["second"]["tokens"], res["first"]["tokens"])]
    assert not res["segment_after_shutdown"] and res["leftover"] == []


def test_control_in_process_store_never_hits_across_processes(model, tmp_path):
    prompts = E.prompt_sets(["store-mp-control"])["store-mp-control"]
    ktc = store_config("kv_both", store_scope="process", store_capacity_bytes=64 << 20)
    res = _run_child(model, ktc, prompts, tmp_path / "out.json", tmp_path / "engine.log")
    assert res["backend"] == "mp" and not res["segment_while_running"]
    assert 'store_scope "process" while vLLM runs the scheduler and the workers' in res["log"]
    assert res["second"]["cached"] == [0] * len(prompts)
    assert res["second"]["tokens"] == res["first"]["tokens"]
