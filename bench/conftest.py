"""Benchmarks import the oracle from tests/; NIXL benches leave through os._exit (see
tests/nixl/conftest.py: NIXL 1.5.1's bundled libnl-route segfaults in its exit finalizer)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

_STATUS = {}


def pytest_sessionfinish(session, exitstatus):
    _STATUS["code"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if "nixl._api" in sys.modules and "code" in _STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_STATUS["code"])
