"""Run a tests/mooncake/scenario.py mode inside ``unshare -n`` (only ``lo``), bounded in time.

The namespace's top process is killed with its whole process group (by that group's id,
which this helper created) if it overruns; it kills what it started itself otherwise.
Inside the namespace, :func:`start_master` starts ``mooncake_master`` for the scenarios.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

SCENARIO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenario.py")


def master_log(stem: str):
    """``$HMACORE_MC_LOGDIR/<stem>_<pid>.log`` (default directory /tmp), opened for writing."""
    logdir = os.environ.get("HMACORE_MC_LOGDIR", "/tmp")
    return open(os.path.join(logdir, f"{stem}_{os.getpid()}.log"), "w")


def start_master(port: int, log, *flags: str) -> subprocess.Popen:
    """``mooncake_master`` (next to this Python) on 127.0.0.1: RPC on ``port``, metrics on
    ``port + 1``, two RPC threads, logging to ``log`` (an open file); ``flags`` are added.
    Not waited for (``wait_for_port``); the caller stops it by PID."""
    binary = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return subprocess.Popen([binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                             "--metrics_host=127.0.0.1", f"--metrics_port={port + 1}",
                             "--rpc_thread_num=2", *flags, "--logtostderr"],
                            stdout=log, stderr=log)


def run_scenario(mode: str, port: int = 50051, timeout_s: float = 240.0) -> dict:
    cmd = ["unshare", "-n", "--", sys.executable, SCENARIO, "netns", mode, str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"scenario {mode} overran {timeout_s} s; stderr tail:\n{err[-3000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"scenario {mode} failed (rc {proc.returncode}):\n{out[-2000:]}\n"
                             f"{err[-3000:]}")
    return json.loads(lines[-1])
