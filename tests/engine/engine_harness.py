"""Shared pieces of the real-inference tests: ports, model directories, engine start-up."""
from __future__ import annotations

import os
import sys
import zlib
from contextlib import contextmanager
from collections.abc import Callable
from pathlib import Path

from hmacore.demo.engine_driver import EngineProcess, make_prompts
from hmacore.demo.tiny_model import write_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: shared helpers
from ports import free_port  # noqa: E402,F401  (E.free_port: the engines' ports)

HERE = os.path.dirname(os.path.abspath(__file__))
# 10 and 37 tokens fit in the 64-token window; 100 and 150 do not; 150 also takes 3 prefill
# steps on a producer with a 64-token budget.
LENGTHS = [10, 100, 150, 37]
MAX_TOKENS = 24


def model_dir(root: Path, family: str) -> Path:
    return write_tiny_model(root / f"tiny-{family}", family, window=64, seed=0)


def start(model: Path, ktc: dict | None, logdir: Path, name: str, **kw) -> EngineProcess:
    """Start one engine child (not waiting for it: start several, then wait_ready each)."""
    env = {"PYTHONPATH": HERE}
    return EngineProcess(model, ktc, logdir / f"{name}.log", env=env, **kw)


@contextmanager
def reference_run(engines: dict[str, EngineProcess], rounds: dict[str, list[list[int]]]):
    """Wait for every engine (started, not waited: they boot in parallel), generate the
    reference tokens of every round's prompts on ``engines["single"]`` in one call, close that
    engine, and yield ``{round: reference token lists}``. Every engine is closed (by PID) on
    exit, whatever happened."""
    try:
        for e in engines.values():
            e.wait_ready()
        flat = [p for prompts in rounds.values() for p in prompts]
        ref = engines["single"].generate(flat, MAX_TOKENS, timeout=300)["tokens"]
        engines["single"].close()
        refs, i = {}, 0
        for name, prompts in rounds.items():
            refs[name], i = ref[i:i + len(prompts)], i + len(prompts)
        yield refs
    finally:
        for e in engines.values():
            e.close()


def prompt_sets(names: list[str]) -> dict[str, list[list[int]]]:
    """A distinct prompt set per round (no round hits another round's prefix cache)."""
    return {n: make_prompts(LENGTHS, seed=zlib.crc32(n.encode())) for n in names}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_pd_round(pd: dict, name: str, prompts: list[list[int]], *, decoder: str,
                 fault_on: str, fault: dict | None, p_params: list | None = None,
                 d_params: list | None = None, timeout: float = 180.0,
                 drain_timeout: float = 120.0, drained_timeout: float = 150.0,
                 extra: Callable[[], dict] | None = None) -> dict:
    """One P/D round between ``pd["engines"]["p"]`` and ``pd["engines"][decoder]``, memoised
    in ``pd["results"][name]``.

    ``fault`` is set on engine ``fault_on`` for the round. P prefills ``prompts`` (1 token,
    KV kept for D, ``p_params`` merged into each request's ``kv_transfer_params``), then keeps
    stepping (``drain``) while D decodes ``MAX_TOKENS``. D's ``kv_transfer_params``: ``d_params``,
    in which case D's request is sent first (push: D registers with P and waits); None: the
    ones P returned (pull: D reads from P after P's prefill). ``extra()`` adds fields read
    after the round. Timeouts in seconds: ``timeout`` for each generate, ``drain_timeout``
    P's drain, ``drained_timeout`` waiting for its answer.
    """
    if name in pd["results"]:
        return pd["results"][name]
    eng = pd["engines"]
    d = eng[decoder]
    eng[fault_on].call({"cmd": "fault", "spec": fault})

    def decode(params: list) -> None:
        d.send({"cmd": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS,
                "kv_transfer_params": params, "remote_decode": False})

    d_first = d_params is not None
    if d_first:
        decode(d_params)
    pre = eng["p"].generate(prompts, 1, kv_transfer_params=p_params, remote_decode=True,
                            timeout=timeout)
    params = pre["kv_transfer_params"]
    if not d_first:
        assert all(p and p["do_remote_prefill"] for p in params), params
    eng["p"].send({"cmd": "drain", "timeout": drain_timeout})   # P serves D meanwhile
    if not d_first:
        decode(params)
    out = d.result(timeout)
    drained = eng["p"].result(drained_timeout)
    eng[fault_on].call({"cmd": "fault", "spec": None})
    res = {"tokens": out["tokens"], "external": out["external_tokens"],
           "computed": out["computed_tokens"], "params": params, "p_tokens": pre["tokens"],
           "p_drained": drained, "ref": pd["refs"][name]}
    if extra is not None:
        res.update(extra())
    pd["results"][name] = res
    return res
