"""Store faults: a store that fills up (NO_SPACE: saves skipped, nothing wrong marked
stored, every key that exists holds exactly its block's bytes, null blocks never put) and a
real Mooncake master killed and restarted (misses while down, hits again after restart and
re-store, every loaded byte compared)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from hmacore.errors import StoreError
from hmacore.hits import HitFinder
from invariants import CheckedStore, null_ranges
from hmacore.keys import KeyBuilder
from hmacore.presets import get_preset
from hmacore.transport.store import (NO_SPACE, EmbeddedStore, GroupSegments, load_blocks,
                                     lookup_hit, save_blocks)
from hits_scenarios import make_hashes

pytestmark = pytest.mark.reliability
HERE = os.path.dirname(os.path.abspath(__file__))


class FullingStore:
    """EmbeddedStore that answers NO_SPACE (Mooncake's behaviour) instead of evicting once
    ``limit`` bytes are used; every other call is passed through."""

    def __init__(self, limit):
        self.inner = EmbeddedStore(1 << 30)
        self.limit = limit
        self.refused = 0

    def batch_put(self, keys, parts):
        out = []
        for k, p in zip(keys, parts):
            size = sum(s for _, s in p)
            if self.inner.used_bytes + size > self.limit:
                out.append(NO_SPACE)
                self.refused += 1
            else:
                out.extend(self.inner.batch_put([k], [p]))
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _memory(layout, nb, seed):
    rng = np.random.default_rng(seed)
    arrays = [[rng.integers(0, 256, (nb, 8 * s.block_size), dtype=np.uint8) for _ in range(2)]
              for s in layout.groups]
    return arrays, [GroupSegments.from_arrays(a) for a in arrays]


@pytest.mark.parametrize("preset", ["gpt-oss-120b", "deepseek-v4"])
def test_store_full_skips_saves_and_marks_nothing_wrong(preset):
    nb = 4096
    layout = get_preset(preset, num_blocks=nb)
    finder = HitFinder(layout)
    keys = KeyBuilder("m")
    src, segs = _memory(layout, nb, 1)
    dst, dsegs = _memory(layout, nb, 2)
    per_block = sum(s.nbytes_per_block() for s in segs) // len(segs)
    full = FullingStore(limit=per_block * 60)
    store = CheckedStore(full, null_ranges(segs))       # a null-block put raises
    for arrs in src + dst:
        for a in arrs:
            store.register(a.ctypes.data, a.nbytes)
    figures = {"requests": 0, "no_space": 0, "written": 0, "bytes_checked": 0}
    rng = np.random.default_rng(4)
    nxt = 1
    for r in range(8):
        sb = finder.scheduler_block_size
        T = int(rng.integers(1, 4 if sb >= 128 else 25)) * sb + int(rng.integers(0, 9))
        hashes = make_hashes(T // finder.hash_block_size, 32, 100 + r)
        tables = []
        for g, bs in enumerate(finder.block_sizes):
            n = -(-T // bs)
            ids = list(range(nxt, nxt + n))
            nxt += n
            w = layout.groups[g].sliding_window
            if w and (n - 2) * bs > w:
                ids[0] = 0                                 # an out-of-window null head
            tables.append(ids)
        rep = save_blocks(finder, keys, store, hashes, T, tables, segs)
        figures["requests"] += 1
        figures["no_space"] += int(rep.no_space)
        figures["written"] += rep.written
        assert rep.failed == 0
        if rep.no_space:                   # named, and nothing refused is stored
            with pytest.raises(StoreError, match=f"request 'r{r}'") as ei:
                rep.raise_for_failures(f"r{r}")
            assert ei.value.keys == rep.refused_keys and store.batch_exists(rep.refused_keys) \
                == [0] * len(rep.refused_keys)
        else:
            rep.raise_for_failures(f"r{r}")
        # whatever the lookup finds must load and be byte-identical to the source
        hit = lookup_hit(finder, keys, store, hashes, T)
        dst_t = [[b + 0 for b in range(nb - len(t), nb)] for t in tables]
        assert load_blocks(finder, keys, store, hashes, hit, dst_t, dsegs)
        for g in finder.group_ids:
            for i in np.flatnonzero(hit.masks[g]):
                assert tables[g][i] != 0
                for s, d in zip(src[g], dst[g]):
                    assert np.array_equal(s[tables[g][i]], d[dst_t[g][i]])
                    figures["bytes_checked"] += s[tables[g][i]].nbytes
    assert figures["no_space"] > 0 and full.refused > 0 and figures["written"] > 0
    assert full.inner.used_bytes <= full.limit
    assert figures["bytes_checked"] > 0        # some hits were loaded and compared
    print(f"\nstore full ({preset}): {figures}, refused puts {full.refused}")


def _run_netns(script, port):
    """Run tests/reliability/<script> as the top process of ``unshare -n``; its JSON line."""
    cmd = ["unshare", "-n", "--", sys.executable, os.path.join(HERE, script), str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)      # the group this test created, by its id
        out, err = proc.communicate()
        raise AssertionError(f"{script} overran 240 s:\n{err[-3000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    err = "\n".join(ln for ln in err.splitlines() if not re.match(r"[IWE]\d{4} ", ln))  # glog noise
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.mooncake
@pytest.mark.timeout(300)
def test_real_mooncake_store_full():
    """Mooncake's smallest segment (16 MiB) filled by 12 DeepSeek-V4 requests (mc_full.py)."""
    r = _run_netns("mc_full.py", 50131)
    reqs = r["requests"]
    short = [q for q in reqs if q["refused"] or q["skipped"] or q["failed"]]
    print(f"\nmooncake store full: { {k: v for k, v in r.items() if k != 'requests'} }; "
          f"per request (written, refused, skipped): "
          f"{[(q['written'], q['refused'], q['skipped']) for q in reqs]}")
    assert short, "the 16 MiB pool never filled up"
    assert reqs[0]["refused"] == 0 and reqs[0]["written"] > 0
    for q in reqs:                         # a short save is a StoreError naming request and key
        if q in short:
            assert q["no_space"] and q["error_names_request"] and q["error_names_key"], q
        else:
            assert q["error"] is None, q
    assert r["refused_total"] > 0 and r["refused_present"] == 0      # nothing refused exists
    assert r["present_beyond_written"] == 0 and r["exists_errors"] == 0
    assert r["hit_bad_keys"] == 0                  # no hit includes a block whose put failed
    assert r["loads_ok"] and r["compared"] > 0 and r["mismatched"] == 0
    assert r["removed"] > 0 and r["removed_still_present"] == 0
    a = r["after_removal"]                         # the store keeps serving
    assert a["written"] > 0 and a["refused"] == 0 and a["failed"] == 0
    assert a["hit"] == 3 * 256 and a["hit"] > a["hit_before"]
    assert a["loaded"] and a["compared"] > 0 and a["mismatched"] == 0


@pytest.mark.mooncake
@pytest.mark.timeout(300)
def test_mooncake_master_killed_and_restarted():
    r = _run_netns("mc_restart.py", 50071)
    print(f"\nmooncake restart: {r}")
    assert r["written"] > 0 and r["hit_before"] == 3 * 256
    assert len(r["cycles"]) == 2
    for c in r["cycles"]:
        assert c["hit_down"] == 0 and c["down_lookup_s"] < 5          # a miss, fail-fast
        assert c["down_save_written"] == 0 and c["down_save_failed"] > 0 and c["down_save_s"] < 5
        assert c["suspect_while_down"] is True
        assert c["hit_after_restart"] == 0                            # new master: nothing stale
        assert c["old_keys_present"] == 0 and c["old_keys_asked"] > 0
        assert c["restarted_lookup_s"] < 12                           # bounded recovery
        assert c["suspect_after_restart"] is False                    # the same client recovered
        assert c["load_of_old_hit"] is True                           # a 0-token hit loads nothing
        assert c["restore_written"] > 0 and c["restore_failed"] == 0 and not c["restore_no_space"]
        assert c["hit_final"] == 3 * 256                              # hits again after re-store
        assert c["loaded"] is True and c["compared"] > 0 and c["mismatched"] == 0
    assert r["recovery"]["recovered"] >= 2
    # cycle 2 asks at once after the restart: the client waited for its segment's re-mount
    assert r["recovery"]["probe_waits"] > r["cycles"][1]["probe_waits_before"]
