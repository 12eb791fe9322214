"""vLLM test setup: CPU platform (HMA supported), offline, private cache root.

Every test in this directory is marked ``vllm``. If vLLM is not importable the directory is
ignored ONLY when the run deselects the marker (``-m "not vllm"``); otherwise collection fails
loudly (CI installs vLLM with scripts/install_vllm.sh).
"""
import importlib.util
import os
import tempfile

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # without it HMA is silently off
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "hmacore-vllm-cache"))
os.environ.setdefault("PYTHONHASHSEED", "0")
# Real-NIXL tests (test_pd_nixl.py): UCX traffic stays on loopback.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# a real vllm package (tests/vllm itself is importable as a namespace package named vllm
# once tests/ is on sys.path: it has no origin)
_VLLM_SPEC = importlib.util.find_spec("vllm")
_HAVE_VLLM = _VLLM_SPEC is not None and _VLLM_SPEC.origin is not None


def pytest_ignore_collect(collection_path, config):
    markexpr = (config.option.markexpr or "").replace(" ", "")
    if not _HAVE_VLLM and "notvllm" in markexpr:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)
