"""Block-size remapping on real paged memory: the source's token-tagged pages are copied run by
run (memmove per descriptor) into the destination, and every destination byte is checked:
the moved token rows carry exactly the source's tags, every other byte is untouched."""
import ctypes

import numpy as np
import pytest

from regrain_scenarios import SCENARIOS, run_scenario


def memmove_runs(runs, _src, _dst):
    for (sa, n, _), (da, dn, _) in zip(runs.src.tolist(), runs.dst.tolist()):
        assert n == dn
        ctypes.memmove(da, sa, n)


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("num_tokens, trim", [(1, 0), (77, 0), (130, 0), (130, 32), (200, 64),
                                              (64, 64), (129, 16)])
def test_every_destination_byte(name, num_tokens, trim):
    got, want, runs, _ = run_scenario(name, num_tokens, trim, seed=num_tokens * 7 + trim,
                                      copy=memmove_runs)
    for k, (a, b) in enumerate(zip(got, want)):
        bad = np.flatnonzero(a != b)
        assert bad.size == 0, f"{name}: storage {k}: {bad.size} bytes differ, first at {bad[:5]}"
    assert runs.nbytes > 0 or num_tokens == trim


def test_negative_control_detects_a_shifted_copy():
    """The check can fail: copying each run one byte late is caught."""
    def shifted(runs, s, d):
        for (sa, n, _), (da, _, _) in zip(runs.src.tolist(), runs.dst.tolist()):
            ctypes.memmove(da, sa + 1, n - 1)
    got, want, _, _ = run_scenario("gemma_p16_d32", 77, 0, seed=1, copy=shifted)
    assert any((a != b).any() for a, b in zip(got, want))
