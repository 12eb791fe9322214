#!/usr/bin/env bash
# Coverage-guided fuzzing (Atheris / libFuzzer) of the Cython entry points against an
# ASan+UBSan build of the kernels (scripts/asan_build.sh, the build sanitize.sh uses).
#
#   scripts/fuzz.sh fuzz   [family...]   fuzz each family, then minimize its corpus (make fuzz)
#   scripts/fuzz.sh replay [family...]   run every committed corpus input once (make fuzz-replay)
#
# Families (default: all): tables windows plan hits keys runs step_pairs kv_payload -> fuzz/fuzz_<family>.py, corpus
# fuzz/corpus/<family>/ (updated by `fuzz`, then merged into a minimal set), crash inputs
# fuzz/artifacts/<family>-crash-* (not tracked).
# Budget per family: FUZZ_SECONDS (default 60), or FUZZ_RUNS inputs (both set: whichever ends
# first). Also
# FUZZ_MAX_LEN (bytes per input, 4096), FUZZ_TIMEOUT (s per input before it counts as a hang,
# 30), FUZZ_NICE (10). Families run one after the other (one fuzz process at a time).
#
# Coverage: Atheris instruments hmacore's Python modules (line/branch coverage). The C
# kernels get ASan+UBSan and GCC's -fsanitize-coverage=trace-cmp (compare operands for
# libFuzzer's value profile); there is no clang here, so no edge coverage of the C code
# (clang's -fsanitize=fuzzer-no-link). fuzz/cov_shim.c is preloaded first so GCC's libasan
# does not swallow Atheris' coverage callbacks (see the comment there).
set -euo pipefail
MODE=${1:-fuzz}
shift || true
FAMILIES=${*:-tables windows plan hits keys runs step_pairs kv_payload}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=/work/main/.venv/bin/python
SECONDS_PER=${FUZZ_SECONDS:-60}
MAX_LEN=${FUZZ_MAX_LEN:-4096}
NICE=${FUZZ_NICE:-10}
case "$MODE" in fuzz|replay) ;; *) echo "usage: $0 fuzz|replay [family...]"; exit 2;; esac
"$PY" -c "import atheris" || { echo "fuzz: atheris is not installed (requirements/test.txt)"; exit 1; }

WORK=$(mktemp -d /tmp/hmacore-fuzz.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
# shellcheck source=scripts/asan_build.sh
source "$ROOT/scripts/asan_build.sh"
export HMACORE_FUZZ=1                 # setup.py: + -fsanitize-coverage=trace-cmp
asan_build "$ROOT" "$WORK"
gcc -O2 -shared -fPIC -o "$WORK/cov_shim.so" "$ROOT/fuzz/cov_shim.c" -ldl
asan_env
# the shim defines only __sanitizer_cov_*/weak-hook symbols, so it may precede libasan
export LD_PRELOAD="$WORK/cov_shim.so $LD_PRELOAD"
export ASAN_OPTIONS="$ASAN_OPTIONS:verify_asan_link_order=0"
export PYTHONPATH="$WORK:$WORK/fuzz" TMPDIR="$WORK"   # fuzz_keys.py writes layout files
# libFuzzer's -merge re-runs the harness as a child through its #! line: the venv's python3
PATH="$(dirname "$PY"):$PATH"
cd "$WORK"
mkdir -p "$ROOT/fuzz/artifacts"
COMMON=(-max_len="$MAX_LEN" -timeout="${FUZZ_TIMEOUT:-30}" -rss_limit_mb=4096 -detect_leaks=0)

failed=""
for f in $FAMILIES; do
  harness="fuzz/fuzz_$f.py"
  corpus="$ROOT/fuzz/corpus/$f"
  [ -f "$harness" ] || { echo "fuzz: no harness $harness"; exit 2; }
  mkdir -p "$corpus"
  log="$WORK/$f.log"
  start=$(date +%s)
  if [ "$MODE" = replay ]; then
    # -runs=0: execute every corpus input once, no mutation
    if ! "$PY" "$harness" "${COMMON[@]}" -runs=0 "$corpus" >"$log" 2>&1; then
      tail -40 "$log"; failed="$failed $f"
    fi
    n=$(find "$corpus" -type f | wc -l)
    echo "fuzz-replay: $f: $n inputs in $(( $(date +%s) - start )) s: $([[ $failed == *" $f"* ]] && echo FAILED || echo ok)"
    continue
  fi
  # FUZZ_RUNS alone: an input budget; with FUZZ_SECONDS too, whichever ends first
  budget=(-max_total_time="$SECONDS_PER")
  if [ -n "${FUZZ_RUNS:-}" ]; then
    budget=(-runs="$FUZZ_RUNS")
    if [ -n "${FUZZ_SECONDS:-}" ]; then budget+=(-max_total_time="$FUZZ_SECONDS"); fi
  fi
  if ! nice -n "$NICE" "$PY" "$harness" "${COMMON[@]}" "${budget[@]}" -use_value_profile=1 \
      -print_final_stats=1 -artifact_prefix="$ROOT/fuzz/artifacts/$f-" "$corpus" >"$log" 2>&1; then
    tail -60 "$log"; failed="$failed $f"
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  grep -E '^#[0-9]+[[:space:]]+(DONE|pulse)' "$log" | tail -1 || true     # coverage reached
  # minimize: merge into a fresh directory keeping one input per covered edge (no hit
  # counters, no value profile: a few hundred files), then replace the corpus with it
  fresh="$WORK/min-$f"
  mkdir -p "$fresh"
  nice -n "$NICE" "$PY" "$harness" "${COMMON[@]}" -merge=1 -use_counters=0 "$fresh" "$corpus" \
      >"$WORK/$f.merge.log" 2>&1 \
    || { tail -20 "$WORK/$f.merge.log"; failed="$failed $f(merge)"; continue; }
  if [ -z "$(ls -A "$fresh")" ] && [ -n "$(ls -A "$corpus")" ]; then   # never wipe a corpus
    tail -20 "$WORK/$f.merge.log"; failed="$failed $f(merge)"; continue
  fi
  find "$corpus" -type f -delete
  cp "$fresh"/* "$corpus"/ 2>/dev/null || true
  echo "fuzz: $f: ${runs:-?} inputs in $(( $(date +%s) - start )) s (incl. merge), corpus" \
       "$(find "$corpus" -type f | wc -l) files / $(cat "$corpus"/* 2>/dev/null | wc -c) bytes," \
       "$(grep -c '^==[0-9]*== ERROR\|Uncaught Python exception' "$log" || true) crashes"
done
[ -z "$failed" ] || { echo "fuzz: FAILED:$failed (inputs in fuzz/artifacts/)"; exit 1; }
echo "fuzz: $MODE clean ($FAMILIES)"
