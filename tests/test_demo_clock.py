"""hmacore.demo.clock: the split of a section's wall time the demo and bench_transfer report."""
import numpy as np
import pytest

from hmacore.demo.clock import Clock, runqueue_wait_s


def test_sections_accumulate_and_split_consistently():
    c = Clock()
    a, b = np.ones(1 << 22, np.uint8), np.zeros(1 << 22, np.uint8)
    for _ in range(3):
        with c:
            np.copyto(b, a)
    assert c.sections == 3 and (b == 1).all()
    assert 0 < c.longest <= c.wall
    assert 0 < c.thread_cpu <= c.cpu + 0.01       # this thread's CPU is part of the process's
    rq = runqueue_wait_s()
    assert (c.runq is None) == (rq is None)
    assert c.runq is None or 0 <= c.runq <= c.wall


def test_exit_without_enter_is_an_error():
    with pytest.raises(RuntimeError, match="without being entered"):
        Clock().__exit__(None, None, None)
