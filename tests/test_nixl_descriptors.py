"""NIXL driver pieces that need no NIXL: registration ranges (DRAM and VRAM), id dtypes."""
import numpy as np

from hmacore.demo.paged_memory import allocate_paged_kv
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.transport.nixl import _nixl_ids, registration_args


def test_vram_plan_descriptors_carry_device():
    layout = get_preset("gpt-oss")
    paged = allocate_paged_kv(layout, 8, page_bytes=64)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=8, mem_type="VRAM",
                                       dev_id=3)
    ranges, mem = registration_args(plan)
    assert mem == "VRAM"
    assert sorted(ranges) == sorted((s.ctypes.data, s.nbytes, 3, "") for s in paged.storages)
    rows = plan.descriptors()
    assert (rows[:, 2] == 3).all() and rows.shape == (18 * 8, 3)


def test_dram_registration_merges_aliased_regions_once():
    layout = get_preset("qwen3-next")
    paged = allocate_paged_kv(layout, 4, page_bytes=544)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=4)
    ranges, mem = registration_args(plan)
    assert mem == "DRAM" and len(ranges) == 12  # 12 slots; attention + state views merged


def test_ids_int32_when_they_fit():
    small = np.array([1, 2**31 - 1], np.int64)
    assert _nixl_ids(small, 2**31).dtype == np.int32            # bound by the dlist: no scan
    assert (_nixl_ids(small, 2**31) == small).all()
    assert _nixl_ids(small, 2**40).dtype == np.int32            # huge dlist: scanned, fits
    big = np.array([1, 2**31], np.int64)
    assert _nixl_ids(big, 2**40).dtype == np.int64
    assert _nixl_ids(np.empty(0, np.int64), 2**40).dtype == np.int32
