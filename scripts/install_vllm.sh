#!/usr/bin/env bash
# Install vLLM 0.32.0 (pinned) into an existing venv, lean CPU recipe:
#   1. the lean dependency list (requirements/vllm-lean.txt), torch 2.13.0+cpu;
#   2. `--no-deps xgrammar==0.2.8 vllm==0.32.0` (avoids triton and vLLM's GPU-only deps);
#   3. verify: torch is 2.13.0+cpu, no CUDA torchvision/torchaudio/torchcodec, numpy and
#      nixl (if it was there before) still import, and vLLM's v1 Scheduler imports with
#      VLLM_TARGET_DEVICE=cpu.
# Usage: scripts/install_vllm.sh VENV      (idempotent; exits non-zero on any failure)
set -euo pipefail

VENV="${1:?usage: $0 VENV}"
PY="$VENV/bin/python"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="$HERE/requirements/vllm-lean.txt"
VLLM_VERSION="0.32.0"
XGRAMMAR_VERSION="0.2.8"

[ -x "$PY" ] || { echo "install_vllm: no python at $PY" >&2; exit 2; }
[ -f "$REQ" ] || { echo "install_vllm: missing $REQ" >&2; exit 2; }

had_nixl=0
"$PY" -c "import nixl" >/dev/null 2>&1 && had_nixl=1

installed="$("$PY" -c 'import importlib.metadata as m
try: print(m.version("vllm"))
except m.PackageNotFoundError: print("")')"
if [ "$installed" != "$VLLM_VERSION" ]; then
  echo "install_vllm: installing lean deps + vllm==$VLLM_VERSION into $VENV"
  "$PY" -m pip install -q -r "$REQ"
  "$PY" -m pip install -q --no-deps "xgrammar==$XGRAMMAR_VERSION" "vllm==$VLLM_VERSION"
else
  echo "install_vllm: vllm $VLLM_VERSION already installed in $VENV"
fi

# Defensive: these CUDA builds must never be present next to the CPU torch.
for bad in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$bad" >/dev/null 2>&1; then
    echo "install_vllm: removing $bad (CUDA build breaks vllm on CPU)"
    "$PY" -m pip uninstall -y -q "$bad"
  fi
done

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1
"$PY" - "$had_nixl" <<'PYEOF'
import importlib.metadata as md
import importlib.util
import sys

had_nixl = sys.argv[1] == "1"
import torch
assert torch.__version__ == "2.13.0+cpu", f"torch is {torch.__version__}, want 2.13.0+cpu"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(bad) is None, f"{bad} is installed; it must not be"
for dist in md.distributions():
    name = (dist.metadata["Name"] or "").lower()
    assert not name.startswith("nvidia-"), f"CUDA package {name} got installed"
import numpy
if had_nixl:
    import nixl  # noqa: F401
import vllm
assert vllm.__version__.startswith("0.32.0"), vllm.__version__
import vllm.v1.core.sched.scheduler  # noqa: F401
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print(f"install_vllm: OK vllm={vllm.__version__} torch={torch.__version__} "
      f"numpy={numpy.__version__} nixl={'yes' if had_nixl else 'absent'}")
PYEOF
