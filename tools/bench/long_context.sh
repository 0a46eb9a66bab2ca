#!/bin/bash
# Decode and prefill at a long context, Colibri against llama.cpp and (optionally) ik_llama.cpp,
# REPS alternations, every file read into the page cache before each round.
#
#   bash tools/bench/long_context.sh COLIBRI_DIR GGUF LLAMA_BENCH [IK_LLAMA_BENCH] [DEPTH] [REPS]
#
# Colibri: `python -m colibri bench` with a DEPTH-token prompt and 32 tokens after it; llama.cpp:
# llama-bench -p DEPTH -n 0, then -p 0 -n 32 -d DEPTH (decode at that depth); ik_llama.cpp (which
# you build; nothing here builds it): llama-bench -gp DEPTH,32 as it comes and with -rtr 1.
set -euo pipefail
C=$1; G=$2; L=$3; I=${4:-}; D=${5:-4096}; REPS=${6:-2}
for rep in $(seq 1 "$REPS"); do
  find "$C" -name '*.bin' -exec cat {} + > /dev/null; cat "$G" > /dev/null
  echo "== rep $rep colibri"
  python -m colibri bench --model-dir "$C" --n-ctx $((D + 64)) --prompt-len "$D" --gen 32 --repeat 1 --threads 2 --json |
    python -c "import json,sys; r=json.load(sys.stdin); print('colibri pp', r['prefill_tok_s']['median'], 'tg', r['decode_tok_s']['median'])"
  echo "== rep $rep llama.cpp"
  "$L" -m "$G" -p "$D" -n 0 -t 2 -r 1 2>/dev/null | grep "pp$D"
  "$L" -m "$G" -p 0 -n 32 -d "$D" -t 2 -r 1 2>/dev/null | grep "tg32"
  if [ -n "$I" ]; then
    echo "== rep $rep ik_llama.cpp"; "$I" -m "$G" -gp "$D,32" -t 2 -r 1 2>/dev/null | grep "@pp"
    echo "== rep $rep ik_llama.cpp -rtr"; "$I" -m "$G" -gp "$D,32" -t 2 -r 1 -rtr 1 2>/dev/null | grep "@pp"
  fi
done
