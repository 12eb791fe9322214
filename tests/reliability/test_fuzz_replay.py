"""Replay the committed coverage-guided fuzz corpora (fuzz/corpus/<family>/) through their
Atheris harnesses: every input once (libFuzzer ``-runs=0``), one subprocess per family.

Under scripts/sanitize.sh the subprocesses inherit the ASan+UBSan preload and import the
instrumented kernels (CI's sanitize-short); in a plain pytest they replay against the normal
build. Either way every harness check applies (oracle comparisons, HmacoreError-only errors),
so an input that once found a bug keeps guarding its fix. `make fuzz-replay` does the same
against its own ASan build.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("tables", "windows", "plan", "hits", "keys", "runs", "step_pairs", "kv_payload")


@pytest.mark.parametrize("family", FAMILIES)
def test_fuzz_corpus_replays_clean(family, tmp_path):
    # no importorskip: atheris is a test requirement, a missing one must fail CI
    corpus = ROOT / "fuzz" / "corpus" / family
    n = sum(1 for p in corpus.iterdir() if p.is_file())
    assert n >= 20, f"{corpus} holds {n} inputs: the committed corpus is missing"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "fuzz")]),
               TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, str(ROOT / "fuzz" / f"fuzz_{family}.py"), "-runs=0",
                        "-max_len=4096", "-timeout=60", f"-artifact_prefix={tmp_path}/",
                        str(corpus)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{family}: replay failed\n{out[-6000:]}"
    assert f"files: {n} " in out, out[-3000:]            # every committed input was read
    m = re.search(r"#(\d+)\s+INITED", out)
    assert m and int(m.group(1)) >= n, out[-3000:]       # ... and executed
