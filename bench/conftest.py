"""Collect ``bench_*.py`` here (pytest's default only collects ``test_*.py``); the benchmarks
import the oracle from tests/. NIXL traffic stays on loopback."""
import os
import sys

import pytest

from hmacore.transport import configure_ucx_env

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
configure_ucx_env()


def pytest_collect_file(file_path, parent):
    # files named on the command line are collected by pytest itself
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") \
            and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
