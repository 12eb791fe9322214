#!/usr/bin/env bash
# ASan + UBSan build of the Cython kernels, then the reliability property suite under it.
#
#   scripts/sanitize.sh [short|full]     (default full)
#
# The tree is copied to a temporary directory and built there with HMACORE_SANITIZE=1
# (-O1 -g -fsanitize=address,undefined, Cython bounds/wraparound checks back on), so the
# normal in-place .so files are never touched. The interpreter is not instrumented, so
# libasan/libubsan are LD_PRELOADed with leak detection off (CPython's arenas are not
# leaks); any ASan report or UBSan runtime error aborts the run with a non-zero status.
# (Build and environment: scripts/asan_build.sh, shared with scripts/fuzz.sh.)
# short: ~100 examples per property (CI, a few minutes) + the in-process NIXL round trips
# (the KV event payload reader under ASan: its committed fuzz corpus, replayed by
# test_fuzz_replay, and the subscriber's tests; its differential suite test_kv_payload.py,
# ~8 min under ASan, runs in full);
# full: HMACORE_REL_EXAMPLES or 300, + two-process NIXL, the NIXL fault tests, a short soak
# over four layouts (READ+WRITE), the Mooncake recovery/store-full tests (real master in
# unshare -n, when available).
set -euo pipefail
MODE=${1:-full}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=/work/main/.venv/bin/python
WORK=$(mktemp -d /tmp/hmacore-sanitize.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# shellcheck source=scripts/asan_build.sh
source "$ROOT/scripts/asan_build.sh"
asan_build "$ROOT" "$WORK"
cd "$WORK"
asan_env
if [ "$MODE" = short ]; then
  export HMACORE_REL_EXAMPLES=${HMACORE_REL_EXAMPLES:-100} HMACORE_EXAMPLES=${HMACORE_EXAMPLES:-100}
  TESTS="tests/reliability/test_sanitizer_canary.py tests/reliability/test_fuzz_tables.py
         tests/reliability/test_fuzz_windows.py tests/reliability/test_fuzz_plan_hits.py
         tests/reliability/test_stateful_invariants.py tests/reliability/test_threads.py
         tests/reliability/test_fuzz_replay.py tests/test_runs.py
         tests/test_safety_memory.py tests/test_safety_hardening.py tests/test_safety_objects.py
         tests/test_route_index.py tests/test_kv_events_drain.py"
else
  export HMACORE_REL_EXAMPLES=${HMACORE_REL_EXAMPLES:-300} HMACORE_EXAMPLES=${HMACORE_EXAMPLES:-300}
  TESTS="tests/reliability/test_sanitizer_canary.py tests/reliability/test_fuzz_tables.py
         tests/reliability/test_fuzz_windows.py tests/reliability/test_fuzz_plan_hits.py
         tests/reliability/test_stateful_invariants.py tests/reliability/test_threads.py
         tests/test_tables.py tests/test_tables_tracker.py tests/test_windows.py
         tests/test_windows_props.py tests/test_plan.py tests/test_plan_badinput.py
         tests/test_plan_props.py tests/test_hits.py tests/test_hits_set.py
         tests/test_hits_oracle.py tests/test_keys.py tests/test_store_embedded.py
         tests/reliability/test_fuzz_replay.py tests/test_runs.py
         tests/test_safety_memory.py tests/test_safety_hardening.py tests/test_safety_objects.py
         tests/test_route_index.py tests/test_kv_payload.py tests/test_kv_events_drain.py"
fi
start=$(date +%s)
# shellcheck disable=SC2086
timeout 1800 "$PY" -m pytest -q -p no:cacheprovider -p no:randomly $TESTS
# Phase 2: the NIXL (and, in the full form, Mooncake) paths with the same preload: the
# kernels run inside real transfers (desc_ids, clipping, tables), peer processes inherit the
# preload. tests/nixl runs in its own pytest (its conftest is imported by name).
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
if "$PY" -c "import nixl" 2>/dev/null; then
  if [ "$MODE" = short ]; then
    NIXL_TESTS="tests/nixl/test_nixl_agent.py"
    REL_TESTS=""
  else
    NIXL_TESTS="tests/nixl/test_nixl_agent.py tests/nixl/test_nixl_pd.py"
    REL_TESTS="tests/reliability/test_faults_nixl.py tests/reliability/test_soak.py
               tests/reliability/test_mooncake_recovery.py"
    if unshare -n true 2>/dev/null && "$PY" -c "import mooncake.store" 2>/dev/null; then
      REL_TESTS="$REL_TESTS tests/reliability/test_faults_store.py tests/mooncake/test_store_mooncake.py"
    fi
  fi
  # shellcheck disable=SC2086
  timeout 900 "$PY" -m pytest -q -p no:cacheprovider -p no:randomly $NIXL_TESTS
  if [ -n "$REL_TESTS" ]; then
    # shellcheck disable=SC2086
    HMACORE_SOAK_S=${HMACORE_SOAK_S:-5} HMACORE_SOAK_MIN=${HMACORE_SOAK_MIN:-150} \
      timeout 1800 "$PY" -m pytest -q -p no:cacheprovider -p no:randomly -m "not slow and not vllm" $REL_TESTS
  fi
else
  echo "sanitize: nixl not installed, NIXL phase skipped"
fi
echo "sanitize: $MODE run clean in $(( $(date +%s) - start )) s (ASan+UBSan, LD_PRELOAD, detect_leaks=0)"
