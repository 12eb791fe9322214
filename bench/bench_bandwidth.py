"""Descriptor ids at 128k tokens next to the machine's memory-write bandwidth, same run:
hmacore's ``plan.desc_ids(table, out=buf)`` vs NumPy filling an int64 buffer of the same
size (``buf.fill``: a pure streaming write, the floor for producing that many int64). ratio
= fill time / desc-id time (target: within 2x, i.e. ratio >= 0.5)."""
import numpy as np
import pytest

from hmacore.plan import TransferPlan
from hmacore.presets import get_preset

from bench_plan import request_table

PRESETS = ["llama-3-70b", "gpt-oss-120b", "gemma-3-27b"]


@pytest.mark.parametrize("impl", ["hmacore", "memwrite"])
@pytest.mark.parametrize("preset", PRESETS)
def test_desc_ids_vs_bandwidth(benchmark, preset, impl):
    plan = TransferPlan.from_layout(get_preset(preset, num_blocks=65536))
    table = request_table(plan, 131072)
    want = plan.desc_ids(table)
    out = np.empty(want.size, np.int64)
    assert np.array_equal(plan.desc_ids(table, out=out), want)
    benchmark.group = f"desc_ids_bw-{preset}-131072"
    benchmark.extra_info["impl"] = impl
    benchmark.extra_info["bytes"] = int(out.nbytes)
    if impl == "hmacore":
        benchmark(plan.desc_ids, table, out=out)
    else:
        benchmark(out.fill, 7)
        benchmark.extra_info["write_GBps"] = out.nbytes / benchmark.stats.stats.median / 1e9
