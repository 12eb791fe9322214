# Sourced by scripts/sanitize.sh and scripts/fuzz.sh: the one ASan + UBSan build of the Cython
# kernels, and the environment that runs the (uninstrumented) interpreter against it.
#
#   asan_build ROOT WORK      copy ROOT's branch files into WORK, build there, check the .so
#   asan_env                  export LD_PRELOAD / ASAN_OPTIONS / UBSAN_OPTIONS for that build
#
# The tree is copied so the normal in-place .so files are never touched. HMACORE_SANITIZE=1
# (setup.py) builds with -O1 -g -fsanitize=address,undefined and Cython's bounds/wraparound
# checks back on; extra setup.py switches (HMACORE_FUZZ=1) pass through the environment.
# The interpreter is not instrumented, so libasan/libubsan are LD_PRELOADed with leak
# detection off (CPython's arenas are not leaks); any ASan report or UBSan runtime error
# aborts the process with a non-zero status.

asan_build() {
  local root=$1 work=$2 so syms
  # tracked + new (untracked, not ignored) files: what the branch builds from, no .so/.c
  (cd "$root" && git ls-files -co --exclude-standard -z -- hmacore tests fuzz setup.py \
      pyproject.toml conftest.py | xargs -0 cp --parents -t "$work")
  rm -f "$work"/hmacore/_fast/*.so "$work"/hmacore/_fast/*.c
  echo "asan: building in $work"
  (cd "$work" && HMACORE_SANITIZE=1 "$PY" setup.py -q build_ext --inplace --parallel 2 \
      >build.log 2>&1) || { tail -50 "$work/build.log"; return 1; }
  for so in "$work"/hmacore/_fast/*.so; do   # the build really is instrumented
    syms=$(nm -D "$so")                        # (no `nm | grep -q`: SIGPIPE under pipefail)
    [[ $syms == *__asan_init* ]] || { echo "asan: $so has no ASan"; return 1; }
    [[ $syms == *__ubsan_handle* ]] || { echo "asan: $so has no UBSan"; return 1; }
  done
  echo "asan: $(ls "$work"/hmacore/_fast/*.so | wc -l) extensions built with ASan+UBSan"
}

asan_env() {
  LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
  export LD_PRELOAD
  export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  export HMACORE_SANITIZED=1 PYTHONHASHSEED=0
}
