"""Every guarded bad input raises a named error and changes nothing (no crash, no write)."""
import numpy as np
import pytest

from hmacore._fast import _plan
from hmacore.errors import BlockTableError, LayoutError
from hmacore.demo.paged_memory import allocate_paged_kv
from hmacore.plan import Region, TransferPlan
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout


@pytest.fixture
def plan():
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)),
                              GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("b",), sliding_window=32)))
    return TransferPlan(layout, [Region(i * 10**6, 64, 64, 100, 2, -1, False, ("a", "b"))
                                 for i in range(3)])


@pytest.mark.parametrize("table, match", [
    (([1],), "groups"),
    (([1], [2], [3]), "groups"),
    ((), "groups"),
    (([-1], [2]), r"block_ids\[0\]\[0\] = -1 is out of range"),
    (([1], [0]), r"null block"),
    (([1], [100]), r"block_ids\[1\]\[0\] = 100 is out of range \[1, 100\)"),
    (([1.0], [2]), "integers"),
    ((["x"], [2]), "integers"),
    (([True], [2]), "integers"),
    (([1, True], [2]), r"block_ids\[0\]\[1\]: block ids must be integers, not bools"),
    (([1], (2, False)), r"block_ids\[1\]\[1\].*bools"),
    (([np.bool_(True), 2], [2]), r"block_ids\[0\]\[0\].*bools"),
    ((iter([3, True]), [2]), r"block_ids\[0\]\[1\].*bools"),
    (([1, None], [2]), "integers"),
    (([1, 2.0], [2]), "integers"),
    ((np.array([[1, 2]]), [2]), "1-D"),
    ((np.arange(10)[::2], [2]), "C-contiguous"),
    (([2**31], [2]), "int32"),
    ((np.array([-2**31 - 1]), [2]), "int32"),
    ((np.array([2**40], np.int64), [2]), "int32"),
    (([[1, 2]], [2]), "flat"),
    (("ab", [2]), "integers"),
    (None, "sequence"),
    ("xy", "sequence"),
])
def test_bad_block_ids(plan, table, match):
    buf = np.full(64, -5, np.int64)
    with pytest.raises(BlockTableError, match=match):
        plan.desc_ids(table, out=buf)
    assert (buf == -5).all()


def test_bad_id_carries_group_and_index(plan):
    with pytest.raises(BlockTableError) as ei:
        plan.desc_ids(([1, 2], [3, 4, 500]))
    assert ei.value.group == 1 and ei.value.block_index == 2


def test_kernel_ids_range(plan):
    assert plan.desc_ids(([2, 3], []), kernel_ids=True).tolist() == [2, 3, 202, 203, 402, 403]
    with pytest.raises(BlockTableError, match="null"):
        plan.desc_ids(([1], []), kernel_ids=True)
    with pytest.raises(BlockTableError, match=r"\[2, 200\)"):
        plan.desc_ids(([200], []), kernel_ids=True)


@pytest.mark.parametrize("out, match", [
    (np.zeros(3, np.int64), "room for 3"),
    (np.zeros(64, np.int32), "int64"),
    (np.zeros(64, np.float64), "int64"),
    (np.zeros((8, 8), np.int64), "1-D"),
    (np.zeros(128, np.int64)[::2], "C-contiguous"),
    ([0] * 64, "int64"),
])
def test_bad_out(plan, out, match):
    snapshot = np.array(out, copy=True)
    with pytest.raises(BlockTableError, match=match):
        plan.desc_ids(([1, 2], [3]), out=out)
    assert np.array_equal(np.asarray(out), snapshot)


def test_readonly_out(plan):
    out = np.zeros(64, np.int64)
    out.flags.writeable = False
    with pytest.raises(BlockTableError, match="writeable"):
        plan.desc_ids(([1], [2]), out=out)


def test_empty_everything(plan):
    assert plan.desc_ids(([], [])).dtype == np.int64
    assert plan.desc_ids((np.empty(0, np.int32), np.empty(0, np.int64))).size == 0
    assert plan.desc_ids(([], []), out=np.empty(0, np.int64)).size == 0
    assert plan.count_desc_ids(([], [])) == 0


def test_group_without_regions():
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)), GroupSpec(GroupKind.MAMBA, 16, ("m",))))
    p = TransferPlan(layout, [Region(0, 64, 64, 10, 1, -1, False, ("a",))])
    assert p.desc_ids(([1], [])).tolist() == [1]
    with pytest.raises(BlockTableError, match="no region serves group 1"):
        p.desc_ids(([1], [2]))


def test_kernel_entry_validates_its_own_arrays():
    z64 = np.zeros(2, np.int64)
    one32 = np.ones(2, np.int32)
    g = np.zeros(1, np.int32)
    st = np.zeros(2, np.uint8)
    gs = np.zeros(1, np.uint8)
    ids = (np.array([1], np.int32),)
    ok = dict(group_major=False)
    with pytest.raises(BlockTableError, match="region_offset"):
        _plan.flatten_desc_ids(ids, np.zeros(2, np.int32), z64 + 5, one32, g - 1, st, gs, **ok)
    with pytest.raises(BlockTableError, match="region_group"):
        _plan.flatten_desc_ids(ids, z64, z64 + 5, one32, g, st, gs, **ok)
    with pytest.raises(BlockTableError, match="int32 array"):
        _plan.flatten_desc_ids((np.array([1], np.int64),), z64, z64 + 5, one32,
                               np.full(2, -1, np.int32), st, gs, **ok)
    with pytest.raises(BlockTableError, match="ratio"):
        _plan.flatten_desc_ids(ids, z64, z64 + 5, one32 * 0, np.full(2, -1, np.int32), st, gs, **ok)
    with pytest.raises(TypeError):
        _plan.flatten_desc_ids([np.array([1], np.int32)], z64, z64 + 5, one32,
                               np.full(2, -1, np.int32), st, gs, **ok)


def test_plan_construction_errors():
    layout = get_preset("gpt-oss")
    paged = allocate_paged_kv(layout, 8, page_bytes=64)
    kv = dict(paged.kv_caches)
    with pytest.raises(LayoutError, match="lacks layer"):
        TransferPlan.from_kv_caches(layout, {k: v for k, v in kv.items() if k != "model.layers.0.attn"},
                                    num_blocks=8)
    with pytest.raises(LayoutError, match="no layout group"):
        TransferPlan.from_kv_caches(layout, {**kv, "ghost": kv["model.layers.0.attn"]}, num_blocks=8)
    with pytest.raises(LayoutError, match="dim 0 must be num_blocks"):
        TransferPlan.from_kv_caches(layout, kv, num_blocks=9)
    with pytest.raises(LayoutError, match="num_blocks"):
        TransferPlan.from_kv_caches(layout, kv, num_blocks=1)
    with pytest.raises(LayoutError, match="NumPy array or a tensor"):
        TransferPlan.from_kv_caches(layout, {**kv, "model.layers.0.attn": [[0] * 64] * 8}, num_blocks=8)
    with pytest.raises(LayoutError, match="only valid for Mamba"):
        TransferPlan.from_kv_caches(layout, {**kv, "model.layers.0.attn": (kv["model.layers.0.attn"],)},
                                    num_blocks=8)
    with pytest.raises(LayoutError, match="contiguous"):
        bad = np.zeros((8, 4, 32), np.uint8)[:, :, ::2]
        TransferPlan.from_kv_caches(layout, {**kv, "model.layers.0.attn": bad}, num_blocks=8)
    with pytest.raises(LayoutError, match="kernel_block_size"):
        TransferPlan.from_kv_caches(layout, kv, num_blocks=8, kernel_block_size=5)
    with pytest.raises(LayoutError, match="mem_type"):
        TransferPlan(layout, [Region(0, 64, 64, 8, 1, -1, False, ("x",))], mem_type="GPU")
    with pytest.raises(LayoutError, match="precede"):
        TransferPlan(layout, [Region(0, 64, 64, 8, 1, -1, True, ("x",)),
                              Region(0, 64, 64, 8, 1, -1, False, ("y",))])
    with pytest.raises(LayoutError, match="malformed"):
        TransferPlan.from_region_table(layout, [{"base": 1}])


def test_torch_like_duck_typing():
    class FakeTensor:  # the torch surface the plan uses; torch itself is never imported
        def __init__(self, arr):
            self.a = arr
            self.shape = arr.shape

        def data_ptr(self):
            return self.a.ctypes.data

        def element_size(self):
            return self.a.itemsize

        def stride(self, d):
            return self.a.strides[d] // self.a.itemsize

        def dim(self):
            return self.a.ndim

        def __getitem__(self, i):
            return FakeTensor(self.a[i])

        def is_contiguous(self):
            return self.a.flags.c_contiguous

    layout = get_preset("gpt-oss")
    paged = allocate_paged_kv(layout, 8, page_bytes=64)
    as_f16 = {k: FakeTensor(v.view(np.float16)) for k, v in paged.kv_caches.items()}
    p1 = TransferPlan.from_kv_caches(layout, as_f16, num_blocks=8)
    p2 = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=8)
    assert p1.regions == p2.regions


def test_readonly_and_int64_inputs_accepted(plan):
    ro = np.array([1, 2], np.int32)
    ro.flags.writeable = False
    assert plan.desc_ids((ro, np.array([3], np.int64))).tolist() == \
        [2, 3, 4, 5, 6, 7, 202, 203, 204, 205, 206, 207, 402, 403, 404, 405, 406, 407]


def test_bool_id_carries_group_and_index(plan):
    with pytest.raises(BlockTableError) as ei:
        plan.desc_ids(([1, 2], [3, True]))
    assert ei.value.group == 1 and ei.value.block_index == 1
    with pytest.raises(BlockTableError, match="bools"):
        plan.count_desc_ids(([True, 2], []))
    # iterables of ints (not list/tuple) still work
    assert plan.desc_ids((range(1, 3), iter([4]))).tolist() == plan.desc_ids(([1, 2], [4])).tolist()
