"""A second process attached to an engine's shared store (spawned by test_store_events.py):
on command it puts keys of random digests into the engine's key namespace, each one page,
which evicts the engine's own keys. Imports no vLLM (a spawned child starts fast)."""
from __future__ import annotations

import numpy as np

from hmacore.transport.shared_store import SharedStore
from hmacore.transport.store import OK

TIMEOUT = 120      # seconds a command is waited for: a bound, never a speed claim


def churn(name: str, cap: int, page: int, prefixes: list[str], width: int, to_parent,
          from_parent) -> None:
    st = SharedStore(name, cap, page)
    value = np.arange(page, dtype=np.uint8)
    st.register(value.ctypes.data, value.nbytes)
    rng = np.random.default_rng(len(name))
    to_parent.put(("ready", st.created))
    while True:
        cmd = from_parent.get(timeout=TIMEOUT)
        if cmd[0] == "close":
            break
        n = int(cmd[1])
        keys = [f"{prefixes[i % len(prefixes)]}@{rng.bytes(width).hex()}" for i in range(n)]
        ev0 = st.evictions
        codes = st.batch_put(keys, [[(value.ctypes.data, page)]] * n)
        to_parent.put(("put", codes.count(OK), st.evictions - ev0))
    st.close()
