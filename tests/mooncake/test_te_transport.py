"""Mooncake Transfer Engine transport (hmacore.transport.mooncake_te) between two real
processes over the engine's TCP transport, inside ``unshare -n`` with only ``lo`` up
(tests/mooncake/te_scenario.py runs the processes and checks the bytes)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from hmacore.transport.base import TRANSPORTS, KvTransport, check_transport
from hmacore.transport.mooncake_te import TE_SLICE_BYTES, split_calls

SCENARIO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "te_scenario.py")


def run_te(mode: str, timeout_s: float = 300.0) -> dict:
    """``te_scenario.py netns <mode>`` as the top process of a new network namespace; its
    process group is killed by id if it overruns."""
    proc = subprocess.Popen(["unshare", "-n", "--", sys.executable, SCENARIO, "netns", mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"te scenario {mode} overran {timeout_s} s:\n{err[-3000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"te scenario {mode} failed (rc {proc.returncode}):\n"
                             f"{out[-2000:]}\n{err[-3000:]}")
    return json.loads(lines[-1])


@pytest.mark.mooncake
@pytest.mark.timeout(400)
def test_every_group_kind_byte_exact_reads_and_writes():
    """Full, sliding-window, MLA and Mamba groups (gemma-3, qwen3-next, deepseek-v4):
    fresh, eviction-order and scattered tables, as runs and per block, READ and WRITE; all
    of both sides' KV memory equals the reference (pattern where moved, zeros elsewhere)."""
    r = run_te("exact")
    assert set(r) == {"gemma-3-27b", "qwen3-next-80b", "deepseek-v4"}
    for preset, res in r.items():
        assert res["read_bad_bytes"] == 0 and res["write_bad_bytes"] == 0, preset
        assert len(res["reads"]) == len(res["writes"]) == 6
        for t in res["reads"] + res["writes"]:
            assert t["state"] == "DONE", (preset, t)
            if t["posting"] == "blocks":
                assert t["descriptors"] == t["block_descriptors"]
            else:
                assert t["descriptors"] <= t["block_descriptors"]
        fresh = [t for t in res["reads"] if t["posting"] == "auto" and t["kind"] == "fresh"]
        assert fresh[0]["descriptors"] * 5 <= fresh[0]["block_descriptors"], preset
        assert res["peer_notifs"] == {"w5": ["written"]}      # rode the last WRITE
        assert res["echo_same"] is True                      # every byte value, alone
        assert res["echo_from"] == [["te-peer", "who"]]     # the sender's agent name
        assert res["peer_rc"] == 0


@pytest.mark.mooncake
@pytest.mark.timeout(400)
def test_peer_killed_mid_transfer_fails_bounded_and_survivor_serves():
    r = run_te("kill")
    assert r["outcome"] == "failed", r
    assert 0 < r["arrived_fraction"] < 1, r                  # killed while bytes were landing
    assert "te-victim" in r["error"] and r["failure_recorded"] is True
    assert r["valid_after_failure"] is False
    assert r["fail_s"] < 60                                  # the engine's own bound: 10 s
    assert r["again"] == "failed" and r["again_s"] < 60
    assert r["after_state"] == "DONE" and r["after_mismatches"] == 0


@pytest.mark.mooncake
@pytest.mark.timeout(400)
def test_bad_arguments_are_refused_and_agent_stays_usable():
    r = run_te("badargs")
    assert "unknown peer 'nobody'" in r["unknown_peer"]
    assert r["block_out_of_range"].startswith("TransferError") and "out of range" in \
        r["block_out_of_range"]
    assert "out of range" in r["negative_block"]
    assert "per-group block counts differ" in r["unequal_counts"]
    assert "has 1 groups" in r["wrong_groups"]
    assert "without ':'" in r["colon_request"]
    assert "notif must be bytes" in r["str_notif"]
    assert "expired" in r["expired"]
    assert r["bad_posting"].startswith("ValueError: posting must be one of ['auto', 'dynamic', "
                                       "'prepped', 'blocks']")
    assert "transfer_timeout_s must be an int >= 5" in r["bad_timeout"]
    assert r["bad_name"].startswith("ValueError: name must be")
    assert r["nixl_payload"].startswith("HandshakeError") and "not a Mooncake TE endpoint" \
        in r["nixl_payload"]
    assert r["pair"].startswith("HandshakeError") and "do not fit our layout" in r["pair"]
    assert r["notify_same"] == "te-peer"     # kept as a transfer peer: the READ after works
    assert r["failures_recorded"] == ["a", "b", "c", "d", "e", "i"]
    assert r["after_state"] == "DONE" and r["after_bad_bytes"] == 0
    assert r["closed"] == "TransferError: the agent is closed"


@pytest.mark.mooncake
@pytest.mark.timeout(400)
def test_a_stopped_peer_does_not_hold_the_caller():
    """Notifications to a peer that stops answering (SIGSTOP) return at once and stay
    pending on that peer's sender thread; a live peer is served meanwhile; the failure is
    reported afterwards (once) and the next send to the stopped peer raises."""
    r = run_te("stopped")
    assert r["echo_before"] == "before"
    assert r["pending_after_send"] == 2 and r["failures_while_pending"] == [], r
    assert r["live_echo"] == "alive"
    assert r["pending_after_live_echo"] >= 1, r    # the live peer did not wait for it
    assert [name for name, _ in r["failures"]] == ["te-frozen"], r
    assert r["pending_after_failure"] == 0           # the queued ping dropped with it
    assert r["next_send"].startswith("TransferError") and "earlier one failed" in \
        r["next_send"], r
    assert r["live_rc"] == 0


@pytest.fixture(scope="module")
def regrain_run() -> dict:
    """One run of the ``regrain`` mode for both tests below."""
    return run_te("regrain", 500)


@pytest.mark.mooncake
@pytest.mark.timeout(600)
def test_block_size_remap_byte_runs_every_byte(regrain_run):
    """A block-size remap over TE (tests/regrain_scenarios.py: gemma full + sliding, DSv4-like
    MLA, Qwen3-Next-like Mamba + full, LBHNC with kernel sub-blocks): byte runs READ by
    ``read_runs`` and WRITTEN by ``write_runs`` and by ``TeDescAgent.post_runs``; every byte
    of the destination equals the expected memory (tagged token rows where D needs them, its
    old bytes elsewhere) and the source is untouched. Control: the same runs one byte late
    differ. Notifications ride the transfer."""
    r = regrain_run
    assert list(r) == ["gemma_p16_d32", "dsv4_p1x_d4x", "qwen_next_p16_d64",
                       "lbhnc_p8_d32_kernel16"]
    for scenario, res in r.items():
        assert res["peer_regions_same"] is True, scenario
        pull = res["pull"]
        assert pull["state"] == "DONE" and pull["valid"] is True, (scenario, pull)
        assert pull["bad_bytes"] == 0 and pull["src_changed"] == 0, (scenario, pull)
        assert pull["bytes"] == pull["runs_bytes"] > 0 and pull["descriptors"] == pull["rows"]
        assert res["pull_notif"] == ["moved"], scenario
        assert res["late_bad_bytes"] > 0, scenario            # the check sees a wrong transfer
        assert res["push"] == {"state": "DONE", "bad_bytes": 0, "src_changed": 0}, scenario
        assert res["push_notif"] == ["pushed"], scenario


@pytest.mark.mooncake
@pytest.mark.timeout(600)
def test_block_size_remap_refusals_move_nothing(regrain_run):
    """Bad rows (the rest of the runs good) are refused by name with nothing posted (D's
    memory unchanged a second later) and recorded; block ids to a runs peer are refused; no
    runs: DONE with the notification alone; a peer whose engine closed fails the READ
    through ``wait`` (bounded, recorded, no valid blocks). TeDescAgent: refused before
    ``add_runs_peer``, for bad rows, no rows, a bad op and after ``remove_remote``."""
    r = regrain_run["gemma_p16_d32"]
    assert "remote runs outside registered memory" in r["bad_remote"], r["bad_remote"]
    assert "local runs outside registered memory" in r["bad_local"], r["bad_local"]
    assert "must pair up with equal lengths" in r["bad_length"], r["bad_length"]
    assert "unknown peer 'nobody'" in r["bad_unknown"]
    assert "other block sizes: post byte runs" in r["bad_blocks"], r["bad_blocks"]
    assert all(r[k].startswith("TransferError") for k in
               ("bad_remote", "bad_local", "bad_length", "bad_unknown", "bad_blocks"))
    assert r["bad_recorded"] == ["bad-b", "bad-l", "bad-n", "bad-r", "bad-u"]
    assert r["bad_moved_bytes"] == 0
    assert r["empty"] == {"state": "DONE", "valid": True, "bytes": 0}
    assert r["empty_notif"] == ["nothing"]
    assert r["closed_peer"].startswith("TransferError") and "rg-p" in r["closed_peer"], r
    assert r["closed_peer_recorded"] is True and r["closed_peer_valid"] is False
    assert r["closed_peer_s"] < 90
    d = r["desc"]
    assert "takes no byte runs (add_runs_peer)" in d["before_add"]
    assert "remote runs outside registered memory" in d["bad_remote"]
    assert "at least one row" in d["empty"]
    assert "op must be 'READ' or 'WRITE'" in d["bad_op"]
    assert d["posted_after_refusals"] == 0 and d["bad_moved_bytes"] == 0
    assert d["posted"][0] == 1 and d["posted"][1] == d["posted"][2] > 0
    assert d["last_post"][0] == d["last_post"][1] == d["last_post"][2] > 0
    assert d["bad_bytes"] == 0 and d["src_changed"] == 0 and d["read_bad_bytes"] == 0
    assert d["notifs"] == [["rgd-p", "r:L0"]]
    assert "takes no byte runs" in d["after_remove"]


# -- no engine needed ------------------------------------------------------------------
def test_transport_names_are_validated():
    assert TRANSPORTS == ("nixl", "mooncake")
    assert check_transport("mooncake") == "mooncake"
    for bad in ("ucx", "", None, "NIXL"):
        with pytest.raises(ValueError, match="transport must be one of"):
            check_transport(bad)


def test_nixl_driver_satisfies_the_interface():
    from hmacore.transport.mooncake_te import MooncakeTeAgent
    from hmacore.transport.nixl import NixlAgent
    for cls in (NixlAgent, MooncakeTeAgent):
        missing = [m for m in ("metadata", "handshake_payload", "add_peer", "add_notify_peer",
                               "add_regrain_peer", "read_runs", "write_runs", "remove_peer",
                               "peers", "read", "write", "poll", "wait",
                               "valid_blocks", "failure", "send_notif", "notifications",
                               "notifications_from", "has_notifications",
                               "fetch_notifs", "wait_notif", "close")
                   if not hasattr(cls, m)]
        assert not missing, (cls, missing)
    assert KvTransport.__name__ == "KvTransport"


@pytest.mark.parametrize("lengths,cap", [([256] * 5000, 256 * TE_SLICE_BYTES),
                                         ([TE_SLICE_BYTES * 3 + 1] * 7, 4 * TE_SLICE_BYTES),
                                         ([1], TE_SLICE_BYTES), ([], TE_SLICE_BYTES),
                                         ([10 * TE_SLICE_BYTES, 5, 70000, 1 << 22],
                                          2 * TE_SLICE_BYTES)])
def test_split_calls_keeps_bytes_and_order_within_the_slice_cap(lengths, cap):
    rng = np.random.default_rng(len(lengths))
    la = np.cumsum([0] + lengths[:-1]).astype(np.uint64) + np.uint64(1 << 30) if lengths \
        else np.zeros(0, np.uint64)
    ra = la + np.uint64(rng.integers(1, 1 << 20) * 4096)
    calls = split_calls(la, ra, np.array(lengths, dtype=np.uint64), cap)
    # every local byte maps to the same remote byte, in order, nothing lost or added
    pieces = [(a, b, n) for c in calls for a, b, n in zip(*c)]
    assert sum(n for _, _, n in pieces) == sum(lengths)
    assert all(b - a == int(ra[0] - la[0]) for a, b, _ in pieces) or not pieces
    flat = [a for a, _, _ in pieces]
    assert flat == sorted(flat)                       # order kept (addresses ascend here)
    for a, _, n in pieces:
        assert any(int(x) <= a and a + n <= int(x) + int(m) for x, m in zip(la, lengths))
    for c in calls:
        slices = sum(-(-n // TE_SLICE_BYTES) for n in c[2])
        assert slices <= max(1, cap // TE_SLICE_BYTES)


def test_descriptor_drivers_satisfy_the_desc_interface():
    from hmacore.transport.base import DescTransport
    from hmacore.transport.mooncake_desc import TeDescAgent
    from hmacore.transport.nixl_desc import DescAgent
    names = [m for m in DescTransport.__dict__ if not m.startswith("_")
             and callable(getattr(DescTransport, m))]
    assert {"post", "state", "prep_pair", "send_notif", "notifs_by_agent"} <= set(names)
    for cls in (DescAgent, TeDescAgent):
        assert not [m for m in names + ["add_runs_peer", "post_runs"]
                    if not hasattr(cls, m)], cls


@pytest.mark.parametrize("kw,match", [
    (dict(name="a:b"), "name must be a non-empty str without ':'"),
    (dict(name=""), "name must be a non-empty str"),
    (dict(posting="per-run"), "posting must be one of"),
    (dict(transfer_timeout_s=2), "transfer_timeout_s must be an int >= 5"),
    (dict(workers=0), "workers must be an int >= 1"),
    (dict(mem_type="VRAM"), "mem_type must be 'DRAM'"),
])
def test_te_desc_agent_refuses_bad_arguments_before_starting_an_engine(kw, match):
    from hmacore.transport.mooncake_desc import TeDescAgent
    args = {"name": "p", "ranges": [(1 << 20, 4096, 0)], **kw}
    with pytest.raises(ValueError, match=match):
        TeDescAgent(args.pop("name"), args.pop("ranges"), **args)


def test_make_desc_transport_validates_the_transport_name():
    from hmacore.transport.base import make_desc_transport
    with pytest.raises(ValueError, match="transport must be one of"):
        make_desc_transport("ucx", "p", [])
