#!/usr/bin/env bash
# Talk to the model examples/pretrain_gpt_cpu.sh trained, then take it to Hugging Face.
#
#   bash examples/generate_cpu.sh OUT_DIR ["prompt"]
#
# 1. Serves OUT_DIR/checkpoints with tools/run_text_generation_server.py (torchrun, TP=2, the
#    model flags read from the checkpoint with --use-checkpoint-args) on a free local port, asks
#    it for a greedy continuation of the prompt with tools/text_generation_cli.py (Megatron's
#    PUT /api), and stops it.
# 2. Converts the checkpoint to a transformers GPT2LMHeadModel folder, OUT_DIR/hf, with
#    tools/checkpoint/convert.py, and, when transformers is installed (it is in .venv),
#    continues the same prompt with GPT2LMHeadModel.from_pretrained(OUT_DIR/hf) offline.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: generate_cpu.sh OUT_DIR [prompt]}"
PROMPT="${2:-def __init__(self}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TOKENS="${TOKENS:-48}"
cd "$ROOT"

PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
LOG="$OUT/server.log"
echo "-- generation server on port $PORT (log: $LOG)"
OMP_NUM_THREADS=1 setsid "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
  tools/run_text_generation_server.py --use-checkpoint-args --load "$OUT/checkpoints" \
  --vocab-file "$OUT/data/vocab.json" --merge-file "$OUT/data/merges.txt" \
  --device cpu --host 127.0.0.1 --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -- -$SERVER 2>/dev/null || true' EXIT
"$PY" - "$PORT" "$SERVER" <<'PYEOF'
import os, socket, sys, time
port, pid = int(sys.argv[1]), int(sys.argv[2])
deadline = time.time() + 300
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the generation server exited; see its log")
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.5)
sys.exit("the generation server did not start listening within 300 s")
PYEOF
ANSWER="$("$PY" tools/text_generation_cli.py "127.0.0.1:$PORT" --prompt "$PROMPT" \
  --tokens-to-generate "$TOKENS" --top-k 1 --json)"
kill -- -"$SERVER" 2>/dev/null || true
wait "$SERVER" 2>/dev/null || true
trap - EXIT
echo "$ANSWER" > "$OUT/sample.json"
echo "== sample from PUT /api (greedy, $TOKENS tokens):"
"$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["text"][0])' "$OUT/sample.json"

echo "-- converting $OUT/checkpoints to a Hugging Face folder: $OUT/hf"
rm -rf "$OUT/hf"
"$PY" tools/checkpoint/convert.py --model-type GPT --loader megatron --saver hf \
  --load-dir "$OUT/checkpoints" --save-dir "$OUT/hf"
if "$PY" -c "import transformers" 2>/dev/null; then
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1 "$PY" - "$OUT" "$PROMPT" "$TOKENS" <<'PYEOF'
import json, sys
import torch
from transformers import AutoTokenizer, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()
out, prompt, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(f"{out}/hf")
model = GPT2LMHeadModel.from_pretrained(f"{out}/hf").eval()
ids = tokenizer(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    result = model.generate(ids, max_new_tokens=tokens, do_sample=False,
                            pad_token_id=tokenizer.eos_token_id)
text = tokenizer.decode(result[0])
print(f"== sample from transformers GPT2LMHeadModel.from_pretrained('{out}/hf') (greedy):")
print(text)
served = json.load(open(f"{out}/sample.json"))["text"][0]
print("== the two samples are " + ("identical" if text == served else
      "different (greedy ties can break differently between the two implementations)"))
PYEOF
fi
