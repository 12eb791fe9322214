"""Real ``vllm serve`` processes and the example proxy, driven over HTTP (test-only helper).

Each server is a child in its own session (process group), logs to a file, and is bounded:
``wait_ready`` gives up after ``start_timeout`` seconds, ``close`` sends SIGTERM to the group,
then SIGKILL. vLLM runs its default multiprocess engine (API server + EngineCore + worker), so
everything a connector shares between its scheduler and worker sides must cross processes.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_CLI = Path(sys.executable).parent / "vllm"
MODEL_NAME = "tiny"
MAX_TOKENS = 24


class ServerError(RuntimeError):
    pass


def _env(extra: dict | None) -> dict:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               VLLM_HOST_IP="127.0.0.1", TOKENIZERS_PARALLELISM="false",
               NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"),
               UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                        if p)
    env.update(extra or {})
    return env


class Server:
    """A child HTTP server (``argv``) on 127.0.0.1:``port``, ready when ``GET /health`` is 200."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, *,
                 env: dict | None = None, start_timeout: float = 420.0,
                 listening_is_ready: bool = False, host: str = "127.0.0.1",
                 check_wrapper: list[str] | None = None) -> None:
        self.name, self.port, self.log_path = name, port, log_path
        # a server in another network namespace is checked from inside it
        self.check_wrapper = list(check_wrapper or [])
        self.listening_is_ready = listening_is_ready
        self.url = f"http://{host}:{port}"
        self.start_timeout = start_timeout
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=_env(env), cwd=str(ROOT),
                                     start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(f"{self.name} exited (rc={self.proc.returncode})\n"
                                  f"{self.log_tail()}")
            if self.healthy(timeout=2.0) or (self.listening_is_ready and self._answers()):
                return
            time.sleep(1.0)
        raise ServerError(f"{self.name} not ready within {self.start_timeout:.0f} s\n"
                          f"{self.log_tail()}")

    def _status(self, path: str, timeout: float) -> int | None:
        """HTTP status of ``GET path`` run inside ``check_wrapper``; None: no answer."""
        code = ("import sys, urllib.request, urllib.error\n"
                "try:\n    r = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))\n"
                "    print(r.status)\n"
                "except urllib.error.HTTPError as e:\n    print(e.code)\n"
                "except OSError:\n    print(0)\n")
        try:
            r = subprocess.run([*self.check_wrapper, sys.executable, "-c", code,
                                self.url + path, str(timeout)], capture_output=True, text=True,
                               timeout=timeout + 30)
            status = int(r.stdout.strip() or 0)
        except (subprocess.TimeoutExpired, ValueError):
            return None
        return status or None

    def healthy(self, timeout: float = 5.0) -> bool:
        if self.check_wrapper:
            return self._status("/health", timeout) == 200
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _answers(self) -> bool:
        if self.check_wrapper:
            return self._status("/", 2.0) is not None
        try:
            urllib.request.urlopen(self.url + "/", timeout=2.0).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, not a shutdown)."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=60)

    def close(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        if self.alive():
            self.kill()
        else:   # children left behind by a dead parent
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()


def vllm_serve(name: str, model: Path, port: int, logdir: Path, ktc: dict | None, *,
               env: dict | None = None, extra_args: list[str] | None = None,
               wrapper: list[str] | None = None, host: str = "127.0.0.1") -> Server:
    """``wrapper`` (e.g. ``ip netns exec NS``) runs the server on another host; its health is
    then checked from inside that host too."""
    """``vllm serve`` of the tiny model in float32 (greedy tokens do not depend on batching),
    tokenizer-less (token-id prompts), small KV cache, eager mode."""
    argv = [*(wrapper or []), str(VLLM_CLI), "serve", str(model), "--served-model-name",
            MODEL_NAME, "--host", host, "--port", str(port), "--skip-tokenizer-init",
            "--load-format", "safetensors", "--dtype", "float32", "--max-model-len", "512",
            "--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes",
            str(64 << 20), "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
            "--seed", "0", "--uvicorn-log-level", "warning"]
    if ktc is not None:
        argv += ["--kv-transfer-config", json.dumps(ktc)]
    argv += list(extra_args or [])
    env = dict(env or {})
    env.setdefault("VLLM_CACHE_ROOT", str(logdir / "vllm-cache"))
    return Server(name, argv, port, logdir / f"{name}.log", env=env, host=host,
                  check_wrapper=wrapper)


def proxy(name: str, port: int, logdir: Path, prefill: str, decode: str,
          args: list[str] | None = None, wrapper: list[str] | None = None,
          host: str = "127.0.0.1") -> Server:
    """docs/examples/pd_proxy.py, as a user starts it."""
    argv = [*(wrapper or []), sys.executable, str(ROOT / "docs" / "examples" / "pd_proxy.py"),
            "--host", host, "--port", str(port), "--prefill", prefill, "--decode", decode,
            *(args or [])]
    # ready once it answers HTTP at all; its /health (engines up) is checked by the tests
    return Server(name, argv, port, logdir / f"{name}.log", start_timeout=60.0,
                  listening_is_ready=True, host=host, check_wrapper=wrapper)


def complete(client, prompt: list[int], *, max_tokens: int = MAX_TOKENS,
             extra: dict | None = None) -> list[int]:
    """Greedy completion of a token-id prompt through the ``openai`` client; its token ids
    (``max_tokens`` of them: EOS does not stop it)."""
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0.0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True,
                                                 **(extra or {})})
    ids = resp.choices[0].model_extra.get("token_ids")
    if not isinstance(ids, list):
        raise ServerError(f"no token_ids in the response: {resp}")
    return ids


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfa]+)$")


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """``GET /metrics``: every sample ``name{labels}`` -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def total(samples: dict[str, float], name: str) -> float:
    """Sum of a series over its labels (engines, groups)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def post_json(url: str, body: dict, timeout: float = 300.0) -> tuple[dict, dict]:
    """``(headers, decoded JSON answer)`` of one POST."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(r.headers), json.loads(r.read())


def router_score(url: str, prompt: list[int]) -> dict[str, int]:
    """docs/examples/kv_router.py's predicted hit per engine for ``prompt``."""
    return post_json(url + "/router/score", {"prompt": prompt}, timeout=30)[1]


def wait_router_score(url: str, prompt: list[int], engine: str, pred,
                      wait_s: float = 120.0) -> dict[str, int]:
    """KV events arrive after the answer: wait (bounded) until the router's index shows
    them (``pred`` of ``engine``'s score), or the bound passes; the last scores."""
    deadline = time.monotonic() + wait_s
    while True:
        s = router_score(url, prompt)
        if pred(s[engine]) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)
