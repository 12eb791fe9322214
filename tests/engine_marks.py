"""Collection hooks shared by the real-engine test directories (tests/engine, tests/serve):
skip collecting them when vLLM is absent and ``-m "not vllm"`` / ``"not engine"`` asks for
it, and mark every test in the directory (test-only helper)."""
from __future__ import annotations

import importlib.util

import pytest

# a real vllm package (tests/vllm itself is importable as a namespace package named vllm
# once tests/ is on sys.path: it has no origin)
_VLLM_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _VLLM_SPEC is not None and _VLLM_SPEC.origin is not None


def ignore_without_vllm(config) -> bool | None:
    markexpr = (config.option.markexpr or "").replace(" ", "")
    if not HAVE_VLLM and ("notvllm" in markexpr or "notengine" in markexpr):
        return True
    return None


def mark_directory(items, directory: str, *names: str) -> None:
    for item in items:
        if str(item.fspath).startswith(directory):
            for name in names:
                item.add_marker(getattr(pytest.mark, name))
