"""A test engine with TP ranks: the real vLLM Scheduler here (SCHEDULER-role connector), one
process per TP rank (tp_rank.py: vLLM's TP group initialized, WORKER-role connector, CPU KV
tensors), and vLLM's own KVOutputAggregator folding the ranks' connector outputs into the
one the scheduler sees, as vLLM's multiproc executor does. Every rank process is bounded
(each reply within ``timeout`` s) and killed by PID on close."""
import base64
import glob
import json
import os
import pickle
import selectors
import subprocess
import sys
import tempfile
import time
import uuid

import harness as H
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

import tp_cases
from ports import free_ports

from hmacore.regrain import token_ranges

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_rank.py")



STARTUP_TIMEOUT_S = 600.0   # a rank's first reply (vLLM import + connector registration)


class RankProc:
    """One tp_rank.py process (or another ``script`` speaking its protocol, e.g.
    push_peer_proc.py); :meth:`call` sends a command and reads one JSON reply."""

    def __init__(self, args: dict, timeout: float = 120.0, script: str = RANK):
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"tp-rank{args['rank']}-",
                                               suffix=".log", delete=False)
        case = tp_cases.CASES.get(args.get("case", ""))
        env = dict(os.environ, NIXL_LOG_LEVEL="WARN", UCX_NET_DEVICES="lo",
                   PYTHONPATH=os.pathsep.join([os.path.dirname(RANK)] + sys.path),
                   **(case.env if case is not None else {}))
        self.proc = subprocess.Popen([sys.executable, script, json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, text=True)
        self.timeout = timeout

    def read(self, timeout: float | None = None) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=timeout or self.timeout):
            log = self.tail()
            self.kill()
            raise RuntimeError(f"rank sent nothing within {timeout or self.timeout} s; log: {log}")
        while True:
            text = self.proc.stdout.readline()
            if not text:
                code, log = self.proc.wait(5), self.tail()
                self.kill()
                raise RuntimeError(f"rank exited early ({code}); log: {log}")
            if text.startswith("{"):
                return json.loads(text)

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        out = self.read()
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def log_text(self) -> str:
        """Everything the rank process wrote to stderr so far (its log)."""
        with open(self.log.name) as f:
            return f.read()

    def tail(self) -> str:
        try:
            with open(self.log.name) as f:
                return f.read()[-3000:]
        except OSError:
            return "(log gone)"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.close()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)


class TpEngine:
    """Scheduler + TP rank processes of one engine (``tp`` ranks) for a tp_cases case."""

    def __init__(self, case: str, tp: int, name: str, *, load_failure_policy: str = "fail",
                 extra: dict | None = None):
        self.case = tp_cases.CASES[case]
        self.tp = tp
        self.port = free_ports(tp)
        self.engine_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.extra = dict(extra or {})
        self.push = self.extra.get("transfer_mode") == "push"
        self.vc = tp_cases.engine_config(self.case, tp=tp, port=self.port,
                                         engine_id=self.engine_id, extra=self.extra)
        self.vc.kv_transfer_config.kv_load_failure_policy = load_failure_policy
        self.kcc = self.case.kcc(tp)
        self.s = H.make_scheduler(self.vc, self.kcc)
        self.agg = KVOutputAggregator(expected_finished_count=tp)
        dist_port = free_ports(1)
        self.dist_ident = f"hmacore-tp-{uuid.uuid4().hex[:12]}"
        self.ranks = [RankProc(dict(case=case, tp=tp, rank=r, port=self.port, dist_port=dist_port,
                                    dist_ident=self.dist_ident, engine_id=self.engine_id,
                                    extra=self.extra))
                      for r in range(tp)]
        self.names: list[str] = []
        self.metas: list = []
        self.outputs: list = []

    def wait_ready(self) -> "TpEngine":
        """Wait for every rank's connector to be registered (start several engines first,
        then wait: the ranks import vLLM concurrently)."""
        try:
            # Start-up is the slowest reply: every rank imports vLLM, several engines at once.
            # At load 40-50 on 2 cores five ranks took over 240 s; the bound stays finite.
            ready = [r.read(timeout=STARTUP_TIMEOUT_S) for r in self.ranks]
            self.names = [m["ready"] for m in ready]
            # the driver each rank's connector built is the configured transport's
            te = os.environ.get("HMACORE_TEST_TRANSPORT") == "mooncake"
            want = ("TeDescAgent" if te else "DescAgent") if self.push else \
                ("MooncakeTeAgent" if te else "NixlAgent")
            assert all(m["agent"] == want for m in ready), (want, ready)
            if self.case.state is not None:   # vLLM's own reading of the conv layout
                assert all(m["conv_layout"] == self.case.state[1] for m in ready), ready
        except Exception:
            self.close()
            raise
        return self

    def call_all(self, op: str, **kw) -> list[dict]:
        return [r.call(op, **kw) for r in self.ranks]

    @property
    def layout(self):
        return self.s.connector.scheduler.layout

    def step(self, fill: bool = False):
        """schedule -> every rank's worker step -> vLLM's aggregation -> update_from_output.

        Push engines run the forward pass (``save_kv_layer`` per layer) when tokens were
        scheduled; with ``fill`` it writes the pattern into the scheduled requests' blocks
        (P computing them). The ranks run the step concurrently (as vLLM's workers do)."""
        so = self.s.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        blob = base64.b64encode(pickle.dumps(meta)).decode()
        kw = dict(meta=blob, finished=sorted(so.finished_req_ids))
        if self.push and so.total_num_scheduled_tokens:
            kw["forward"] = True
            if fill:      # the block positions holding tokens computed so far (incl. now)
                kw["fill"] = {}
                for rid in so.num_scheduled_tokens:
                    req = self.s.requests[rid]
                    end = min(req.num_computed_tokens, req.num_prompt_tokens)
                    kw["fill"][rid] = [
                        list(map(int, g[:-(-end // grp.kv_cache_spec.block_size)]))
                        for g, grp in zip(self.s.kv_cache_manager.get_block_ids(rid),
                                          self.kcc.kv_cache_groups)]
        for r in self.ranks:                 # send to every rank first: they run together
            r.proc.stdin.write(json.dumps({"op": "step", **kw}) + "\n")
            r.proc.stdin.flush()
        replies = [r.read() for r in self.ranks]
        for out in replies:
            if "error" in out:
                raise RuntimeError(out["error"])
        results = [pickle.loads(base64.b64decode(out["result"])) for out in replies]
        outs = [H.runner_output(so, self.s, **res) for res in results]
        self.outputs.append(self.s.update_from_output(so, self.agg.aggregate(outs, 0)))
        return so

    def check_loaded(self, rid: str, loaded: list[list[int]], *, control: bool,
                     state_pad: int = 0) -> None:
        """Every rank: each block of ``loaded[g]`` holds the pattern of its position in the
        request's table for that rank's heads, every byte counted, nothing else written.
        ``control``: reading rank 0's blocks as rank 1's must differ (the heads differ).
        ``state_pad``: the byte expected in state pages' padding (tp_cases.state_page)."""
        table = [list(map(int, g)) for g in self.s.kv_cache_manager.get_block_ids(rid)]
        want = sum(len(loaded[g]) * grp.kv_cache_spec.page_size_bytes * len(grp.layer_names)
                   for g, grp in enumerate(self.kcc.kv_cache_groups))
        for r, got in enumerate(self.call_all("check", table=table, loaded=loaded,
                                              state_pad=state_pad)):
            assert got == {"bad": 0, "checked": want, "stray": 0}, (self.engine_id, r, got)
        if control:
            assert self.ranks[0].call("check", table=table, loaded=loaded, as_rank=1,
                                      state_pad=state_pad)["bad"] > 0

    def run_out(self, timeout: float = 60.0) -> None:
        """Step until the scheduler holds no request (bounded)."""
        deadline = time.monotonic() + timeout
        while self.s.requests:
            assert time.monotonic() < deadline, f"requests still held: {list(self.s.requests)}"
            self.step()

    def finished_params(self) -> dict:
        return H.finished_params(self.outputs)

    def close(self) -> None:
        for r in self.ranks:
            try:
                if r.proc.poll() is None:
                    r.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    r.proc.stdin.flush()
                    r.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
            r.kill()
        # vLLM's CPU communicator does not unlink its shared memory (8 MiB a rank) at exit
        for path in glob.glob(f"/dev/shm/{glob.escape(self.dist_ident)}-*"):
            try:
                os.unlink(path)
            except OSError:
                pass


def engine_pool(prefix: str = "", extra: dict | None = None,
                pools: dict[str, tuple[tuple[str, str, int], ...]] | None = None):
    """Body of a module-scoped fixture: per case, three engines (TP 1, TP 2, a second TP 2)
    started together and reused by that case's tests (``get(case)`` -> {"tp1", "tp2",
    "tp2b"}); a case's engines are closed when the next case starts, the rest at the end.
    ``pools``: other engine sets by name, ``(key, tp_cases case, TP size)`` each (engines of
    other block sizes in one start-up), optionally a fourth item: more ``extra`` keys of that
    engine (e.g. push mode for some sets of the pool)."""
    live: dict[str, dict[str, TpEngine]] = {}

    def get(case: str) -> dict[str, TpEngine]:
        if case not in live:
            for old in live.pop(next(iter(live), None), {}).values() if live else ():
                old.close()
            started = {}
            default = (("tp1", case, 1), ("tp2", case, 2), ("tp2b", case, 2))
            try:
                for key, which, tp, *more in (pools or {}).get(case, default):
                    started[key] = TpEngine(which, tp, f"{prefix}{case}-{key}",
                                            extra={**(extra or {}), **(more[0] if more else {})})
                live[case] = {k: e.wait_ready() for k, e in started.items()}
            except Exception:
                for e in started.values():
                    e.close()
                raise
        return live[case]
    yield get
    for group in live.values():
        for e in group.values():
            e.close()


#: (P TP, D TP) -> the engine keys of an engine_pool case playing P and D
PAIRS = {(2, 1): ("tp2", "tp1"), (1, 2): ("tp1", "tp2"), (2, 2): ("tp2", "tp2b")}


def zeroed(P, D, salt: tuple[int, int, int], tp_p: int, tp_d: int, shift: int = 0) -> list[int]:
    """Zero every rank's KV of P and D; a prompt of P's case length whose tokens depend on
    ``salt`` and the TP pair (distinct per test, so no request hits another's prefix)."""
    for eng in (P, D):
        eng.call_all("zero")
    a, b, c = salt
    return [1 + (i * a + shift + tp_p * b + tp_d * c) % 900
            for i in range(P.case.prompt_tokens)]


def pair(get, case: str, tp_p: int, tp_d: int, salt: tuple[int, int, int]):
    """``(P, D, prompt)``: the engines of ``case`` playing P and D for a TP pair (PAIRS),
    zeroed, and :func:`zeroed`'s prompt."""
    e = get(case)
    P, D = (e[k] for k in PAIRS[(tp_p, tp_d)])
    return P, D, zeroed(P, D, salt, tp_p, tp_d)


def run_out_both(P, D) -> None:
    """Both engines run their requests out and hold no block (P frees last: once every D
    rank's done, or every P rank's push end, reached it)."""
    D.run_out()
    H.assert_no_leak(D.s)
    P.run_out()
    H.assert_no_leak(P.s)


def check_loaded_bytes(D, req_id: str, end: int, start: int, state=None,
                       control: bool = True) -> dict:
    """Every byte of every D rank for tokens ``[start, end)`` of ``req_id``'s blocks (its
    table read from D's KV cache manager) is P's, nothing outside them is written; with
    ``state`` = (D's state slot, P's state position) each Mamba group's slot is checked too.
    With ``control`` and D at TP 2, rank 0's bytes read as rank 1's must differ (the check can
    fail). Returns the ``check_tokens`` arguments for further checks."""
    lo, hi = token_ranges(D.layout, end, start)
    table = [list(map(int, g)) for g in D.s.kv_cache_manager.get_block_ids(req_id)]
    kw: dict = dict(table=table, lo=list(lo), hi=list(hi))
    if state is not None:
        mamba = [g for g, sp in enumerate(D.layout.groups) if sp.kind.name == "MAMBA"]
        assert mamba and all(table[g][state[0]] for g in mamba), (table, state)
        kw["state"] = list(state)
    for r, got in enumerate(D.call_all("check_tokens", **kw)):
        assert got["bad"] == 0 and got["stray"] == 0 and got["checked"] > 0 \
            and (state is None or got["states"] > 0), (r, got)
    if control and D.tp == 2:
        assert D.ranks[0].call("check_tokens", as_rank=1, **kw)["bad"] > 0
    return kw
