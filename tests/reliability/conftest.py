"""Reliability suite: tests/ on sys.path (oracles live there), the `reliability` marker, and
a per-family Hypothesis budget (HMACORE_REL_EXAMPLES, default 300; the sanitizer short run
uses fewer)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.dirname(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)


def pytest_configure(config):
    config.addinivalue_line("markers", "reliability: reliability suite (tests/reliability)")
