"""Shared pieces of the real-inference tests: ports, model directories, engine start-up."""
from __future__ import annotations

import os
import socket
import zlib
from pathlib import Path

from hmacore.integrations.vllm.engine_driver import EngineProcess, make_prompts
from hmacore.integrations.vllm.tiny_model import write_tiny_model

HERE = os.path.dirname(os.path.abspath(__file__))
# 10 and 37 tokens fit in the 64-token window; 100 and 150 do not; 150 also takes 3 prefill
# steps on a producer with a 64-token budget.
LENGTHS = [10, 100, 150, 37]
MAX_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(root: Path, family: str) -> Path:
    return write_tiny_model(root / f"tiny-{family}", family, window=64, seed=0)


def start(model: Path, ktc: dict | None, logdir: Path, name: str, **kw) -> EngineProcess:
    """Start one engine child (not waiting for it: start several, then wait_ready each)."""
    env = {"PYTHONPATH": HERE}
    return EngineProcess(model, ktc, logdir / f"{name}.log", env=env, **kw)


def prompt_sets(names: list[str]) -> dict[str, list[list[int]]]:
    """A distinct prompt set per round (no round hits another round's prefix cache)."""
    return {n: make_prompts(LENGTHS, seed=zlib.crc32(n.encode())) for n in names}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
