"""The kernel's cross-process copy that UCX's single-host READ uses (CMA:
``process_vm_readv``), called directly on the same run rows NIXL is given: the transfer
without NIXL or UCX, the physical bound of that path (Linux only)."""
from __future__ import annotations

import ctypes
import os

import numpy as np

IOV_MAX = 1024      # Linux's UIO_MAXIOV: iovecs per call

_libc = ctypes.CDLL(None, use_errno=True)
_readv = _libc.process_vm_readv
_readv.restype = ctypes.c_ssize_t
_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                   ctypes.c_ulong, ctypes.c_ulong]


def iovecs(rows: np.ndarray) -> np.ndarray:
    """M x 2 uint64 ``(base, len)`` (struct iovec on 64-bit Linux) from ``(addr, bytes, dev)``
    rows."""
    return np.ascontiguousarray(np.asarray(rows, np.uint64)[:, :2])


def read_runs(pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """Copy every remote row of process ``pid`` into the paired local row (``iovecs`` of
    equal lengths row by row); returns the bytes copied. Raises OSError on a short copy."""
    total = 0
    for i in range(0, local.shape[0], IOV_MAX):
        lo, re = local[i:i + IOV_MAX], remote[i:i + IOV_MAX]
        want = int(lo[:, 1].sum())
        got = _readv(pid, lo.ctypes.data, lo.shape[0], re.ctypes.data, re.shape[0], 0)
        if got != want:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv copied {got} of {want} bytes: "
                               f"{os.strerror(err) if got < 0 else 'short copy'}")
        total += got
    return total
