"""Under scripts/sanitize.sh (HMACORE_SANITIZED=1): prove the run can fail. A child process
with the same LD_PRELOAD does a heap use-after-free and must die with an ASan report, and the
loaded kernels must be the instrumented build. Skipped outside the sanitizer run (there is
nothing to prove then)."""
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.reliability,
              pytest.mark.skipif(os.environ.get("HMACORE_SANITIZED") != "1",
                                 reason="only meaningful inside scripts/sanitize.sh")]

UAF = ("import ctypes; libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; "
       "p = libc.malloc(64); libc.free(ctypes.c_void_p(p)); ctypes.memset(p, 1, 64)")


def test_asan_catches_use_after_free_in_child():
    r = subprocess.run([sys.executable, "-c", UAF], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "AddressSanitizer" in r.stderr and "use-after-free" in r.stderr


def test_loaded_kernels_are_instrumented():
    from hmacore._fast import _hits, _plan, _tables, _windows
    for mod in (_hits, _plan, _tables, _windows):
        with open(mod.__file__, "rb") as f:
            blob = f.read()
        assert b"__asan_init" in blob and b"__ubsan_handle" in blob, mod.__file__
