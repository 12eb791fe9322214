"""One vLLM engine with vLLM's default multiprocess engine (EngineCore and the CPU worker in
their own processes) and HmaStoreConnector; run by test_store_mp_inference.py as a child.

``python store_mp_run.py MODEL KV_TRANSFER_CONFIG_JSON PROMPTS_JSON MAX_TOKENS OUT_JSON``

Runs the prompts, resets the local prefix cache, runs them again, shuts the engine down, and
writes to OUT_JSON: ``tokens`` / ``cached`` (vLLM's ``num_cached_tokens``: with the local
prefix cache reset, what the connector loaded) of both runs, the executor backend, the PIDs
of this process and of the engine's processes, and whether the shared store's segment
existed while the engine ran and after it shut down (waiting at most 60 s).
"""
from __future__ import annotations

import json
import os
import sys
import time


def _children(pid: int) -> list[int]:
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            out = [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out + [g for c in out for g in _children(c)]


def main() -> int:
    model, ktc_json, prompts_json, max_tokens, out_path = sys.argv[1:6]
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = json.loads(ktc_json)
    prompts = json.loads(prompts_json)
    llm = LLM(model=model, tokenizer=model, skip_tokenizer_init=True, load_format="safetensors",
              dtype="float32", max_model_len=512, block_size=32, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, max_num_seqs=8, max_num_batched_tokens=512,
              seed=0, enable_prefix_caching=True, kv_transfer_config=KVTransferConfig(**ktc))
    vc = llm.llm_engine.vllm_config
    engine_id = vc.kv_transfer_config.engine_id
    segment = f"/dev/shm/hmacore-kv-{engine_id}"
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)

    def run() -> dict:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [int(o.num_cached_tokens or 0) for o in outs]}

    first = run()
    assert llm.reset_prefix_cache(), "the local prefix cache was not reset"
    second = run()
    result = {"first": first, "second": second, "engine_id": engine_id,
              "backend": vc.parallel_config.distributed_executor_backend,
              "pid": os.getpid(), "engine_pids": _children(os.getpid()),
              "segment_while_running": os.path.exists(segment)}
    # vLLM ends the engine core and the worker (SIGKILL if they are slow to exit): the
    # segment goes with its last process (its shutdown, or the sentinel when it was killed)
    llm.llm_engine.engine_core.shutdown()
    deadline = time.monotonic() + 60
    while os.path.exists(segment) and time.monotonic() < deadline:
        time.sleep(0.1)
    result["segment_after_shutdown"] = os.path.exists(segment)
    result["leftover"] = sorted(f for f in os.listdir("/dev/shm") if engine_id in f)
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
