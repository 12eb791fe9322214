"""The version seam: ``_compat`` accepts vLLM 0.32.0 and 0.33.0 and refuses any other
version at import with a message naming both (a real import in a child process)."""
import os
import subprocess
import sys

import pytest
import vllm

from hmacore.integrations.vllm import _compat as C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_installed_version_is_supported():
    assert C.SUPPORTED_VLLM_VERSIONS == ("0.32.0", "0.33.0")
    assert C.VLLM_RELEASE in C.SUPPORTED_VLLM_VERSIONS
    assert C.AT_LEAST_033 == (C.VLLM_RELEASE == "0.33.0")
    assert C.VLLM_VERSION == vllm.__version__


@pytest.mark.parametrize("text,release", [("0.33.0", "0.33.0"), ("0.32.0+cpu", "0.32.0"),
                                          ("0.33.0rc1.dev4+g1234", "0.33.0"),
                                          ("unknown", None)])
def test_release_of_a_version_string(text, release):
    assert C._release(text) == release


@pytest.mark.parametrize("fake,allowed", [("0.31.2", False), ("0.34.0", True)])
def test_other_versions_are_refused_unless_allowed(fake, allowed):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("HMACORE_ALLOW_VLLM_VERSION", None)
    if allowed:
        env["HMACORE_ALLOW_VLLM_VERSION"] = "1"
    code = ("import vllm; vllm.__version__ = %r\n"
            "import hmacore.integrations.vllm._compat as C\n"
            "print('rules', C.AT_LEAST_033)" % fake)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    if allowed:      # an unknown version gets the newest supported rules
        assert r.returncode == 0, r.stderr
        assert "rules True" in r.stdout
    else:
        assert r.returncode != 0
        assert (f"supports vLLM 0.32.0 and 0.33.0, found {fake}" in r.stderr
                and "HMACORE_ALLOW_VLLM_VERSION=1" in r.stderr), r.stderr[-2000:]
