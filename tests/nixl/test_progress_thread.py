"""NIXL's UCX progress thread, as hmacore configures it (hmacore.transport.new_nixl_agent).

NIXL 1.5.1's Python binding runs the thread with a zero poll delay, so an idle agent spins a
core. hmacore's agents sleep on the UCX event fds instead. Measured in CPU-seconds of this
process's threads (a count of work done, not a wall-clock speed claim), against NIXL's own
setting in the same run, so the test can fail. Transfers that need the thread (a READ of an
agent that makes no NIXL call itself) are covered by test_nixl_agent.py's in-process pair.
"""
import os
import time

import pytest

from hmacore.transport import new_nixl_agent

pytestmark = pytest.mark.nixl
IDLE_S = 1.5


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _idle_cpu(idle_s: float = IDLE_S, **kw) -> float:
    agent = new_nixl_agent(f"idle-{kw}", ["UCX"], **kw)
    try:
        time.sleep(0.2)                       # let the progress thread start
        c0 = _cpu_seconds()
        time.sleep(idle_s)
        return _cpu_seconds() - c0
    finally:
        del agent


def test_idle_agent_does_not_spin():
    # On a loaded machine the spinning baseline gets only a share of a core: measure longer
    # (bounded) until it has burnt enough CPU to compare against; every window measures all
    # three settings, so the comparison stays within one window.
    for idle_s in (IDLE_S, 4 * IDLE_S, 12 * IDLE_S):
        ours = _idle_cpu(idle_s)                                # default: 1 ms poll delay
        nixl = _idle_cpu(idle_s, progress_delay_us=0)           # NIXL's own: never sleeps
        none = _idle_cpu(idle_s, progress_thread=False)
        print(f"\nidle CPU-seconds over {idle_s} s: hmacore {ours:.3f}, NIXL default "
              f"{nixl:.3f}, no thread {none:.3f}")
        if nixl > 0.5:
            break
    assert nixl > 0.5, "the spinning baseline did not spin: the test cannot tell"
    assert ours < 0.15 * nixl


def test_negative_delay_is_refused():
    with pytest.raises(ValueError, match="progress_delay_us must be >= 0"):
        new_nixl_agent("bad-delay", ["UCX"], progress_delay_us=-5)
