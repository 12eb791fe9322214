"""Layouts of real models, as data. Sizes follow vLLM's grouping rules (every group of a
model gets the same number of layers; see docs/architecture.md) and the model configs cited
per preset. ``page_bytes`` is bytes of one block of one layer at TP=1 in bf16 unless stated.
"""
from __future__ import annotations

import difflib
from collections.abc import Callable

from .errors import LayoutError
from .spec import GroupKind, GroupSpec, KVLayout, MambaMode

__all__ = ["PRESETS", "DEFAULT_PRESET", "get_preset", "preset_names"]


def _attn_page(block_size: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """K and V of ``block_size`` tokens for one layer."""
    return 2 * block_size * kv_heads * head_dim * dtype_bytes


def _layers(indices) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.attn" for i in indices)


def llama_3_70b(num_blocks: int = 65536) -> KVLayout:
    # meta-llama/Llama-3.1-70B config.json: 80 layers, 8 KV heads, head_dim 128. One group.
    return KVLayout(num_blocks=num_blocks, groups=(
        GroupSpec(GroupKind.FULL, 16, _layers(range(80)), page_bytes=_attn_page(16, 8, 128),
                  name="full"),
    ))


def gpt_oss_120b(num_blocks: int = 65536) -> KVLayout:
    # openai/gpt-oss-120b config.json: 36 layers alternating sliding (window 128) / full,
    # 8 KV heads, head_dim 64 -> vLLM forms 2 groups of 18 layers (vllm-hma.md §2.3, §12).
    page = _attn_page(16, 8, 64)
    return KVLayout(num_blocks=num_blocks, groups=(
        GroupSpec(GroupKind.SLIDING_WINDOW, 16, _layers(range(0, 36, 2)), sliding_window=128,
                  page_bytes=page, name="sliding"),
        GroupSpec(GroupKind.FULL, 16, _layers(range(1, 36, 2)), page_bytes=page, name="full"),
    ))


def gemma_3_27b(num_blocks: int = 65536) -> KVLayout:
    # google/gemma-3-27b-it text config: 62 layers, every 6th full attention (10 full, 52
    # sliding, window 1024), 16 KV heads, head_dim 128 -> 1 full group + 6 sliding groups of
    # 10 layers (vLLM pads the last sliding group; vllm-hma.md §12).
    page = _attn_page(16, 16, 128)
    full = [i for i in range(62) if i % 6 == 5]
    sliding = [i for i in range(62) if i % 6 != 5]
    groups = [GroupSpec(GroupKind.FULL, 16, _layers(full), page_bytes=page, name="full")]
    for k in range(6):
        groups.append(GroupSpec(GroupKind.SLIDING_WINDOW, 16, _layers(sliding[k::6]),
                                sliding_window=1024, page_bytes=page, name=f"sliding{k}"))
    return KVLayout(num_blocks=num_blocks, groups=tuple(groups))


def qwen3_next_80b(num_blocks: int = 8192) -> KVLayout:
    # Qwen/Qwen3-Next-80B-A3B config.json: 48 layers, full attention every 4th (12 full, 36
    # gated-DeltaNet), 2 KV heads x head_dim 256. vLLM inflates the attention block to match
    # the GDN state page: 16 * cdiv(state 1,097,728 B, 16 * 2,048 B/token) = 544 tokens,
    # kernel block 16 (ratio 34); Mamba groups in "align" mode share that block size.
    bs = 544
    page = _attn_page(bs, 2, 256)
    full = [i for i in range(48) if i % 4 == 3]
    linear = [i for i in range(48) if i % 4 != 3]
    groups = []
    for k in range(3):
        groups.append(GroupSpec(GroupKind.MAMBA, bs, _layers(linear[k::3]),
                                mamba_mode=MambaMode.ALIGN, page_bytes=page, name=f"gdn{k}"))
    groups.append(GroupSpec(GroupKind.FULL, bs, _layers(full), kernel_block_size=16,
                            page_bytes=page, name="full"))
    return KVLayout(num_blocks=num_blocks, groups=tuple(groups))


def deepseek_v4(num_blocks: int = 65536) -> KVLayout:
    # DeepSeek-V4-Flash as vLLM groups it (vllm-hma.md §2.3, §12; vLLM PR 42437 / LMCache PR
    # 3261): 5 groups, block sizes 256/64/64/4/8 -> hash block 4, scheduler block 256.
    # g0 compressed MLA (256), g1+g2 sliding-window MLA (64, window 128; equal specs in disjoint
    # id namespaces), g3 C4 compressor state (4, window 8), g4 C128 compressor state (8, window
    # 128). 12 layers per group (about 60 layers in total). Page sizes approximate: fp8 latent
    # 576 B/token (+ scales) for MLA; 1 KiB/token compressor states.
    return KVLayout(num_blocks=num_blocks, groups=(
        GroupSpec(GroupKind.FULL, 256, tuple(f"mla.{i}" for i in range(12)), mla=True,
                  page_bytes=256 * 656, name="mla"),
        GroupSpec(GroupKind.SLIDING_WINDOW, 64, tuple(f"swa_a.{i}" for i in range(12)),
                  sliding_window=128, mla=True, page_bytes=64 * 656, name="swa_a"),
        GroupSpec(GroupKind.SLIDING_WINDOW, 64, tuple(f"swa_b.{i}" for i in range(12)),
                  sliding_window=128, mla=True, page_bytes=64 * 656, name="swa_b"),
        GroupSpec(GroupKind.SLIDING_WINDOW, 4, tuple(f"c4.{i}" for i in range(12)),
                  sliding_window=8, mla=True, page_bytes=4 * 1024, name="c4"),
        GroupSpec(GroupKind.SLIDING_WINDOW, 8, tuple(f"c128.{i}" for i in range(12)),
                  sliding_window=128, mla=True, page_bytes=8 * 1024, name="c128"),
    ))


PRESETS: dict[str, Callable[..., KVLayout]] = {
    "gpt-oss-120b": gpt_oss_120b,
    "gemma-3-27b": gemma_3_27b,
    "qwen3-next-80b": qwen3_next_80b,
    "deepseek-v4": deepseek_v4,
    "llama-3-70b": llama_3_70b,
}
ALIASES = {"gpt-oss": "gpt-oss-120b", "gemma-3": "gemma-3-27b", "qwen3-next": "qwen3-next-80b",
           "dsv4": "deepseek-v4", "llama": "llama-3-70b"}
DEFAULT_PRESET = "gpt-oss-120b"


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str, num_blocks: int | None = None) -> KVLayout:
    """The layout of a named model (aliases: gpt-oss, gemma-3, qwen3-next, dsv4, llama)."""
    if not isinstance(name, str):
        raise LayoutError(f"preset must be a str, got {type(name).__name__} {name!r}")
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        choices = sorted(PRESETS) + sorted(ALIASES)
        near = difflib.get_close_matches(name, choices, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise LayoutError(f"preset must be one of {choices}, got {name!r}{hint}")
    return PRESETS[key]() if num_blocks is None else PRESETS[key](num_blocks=num_blocks)
