#!/usr/bin/env bash
# Search-R1 on CPU with the tiny random-init Qwen3: starts the BM25 retrieval server in the background,
# waits until it answers, runs GRPO through train.py with the search/answer loop of generate.py and the
# exact-match reward of reward.py, and stops the server on every exit path. Extra flags are passed on to
# train.py (later flags win, e.g. --num-rollout 1). Environment: MODEL_DIR, NUM_ROLLOUT (3),
# SEARCH_R1_PORT (8765), SEARCH_R1_PIDFILE (a file to write the server's pid to, for tests).
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=examples/search-r1

DATA_DIR=${DATA_DIR:-$HERE/data}
PORT=${SEARCH_R1_PORT:-8765}
source scripts/tiny-cpu-env.sh  # MODEL_DIR, MODEL_ARGS, threads, CLUSTER_ARGS
[ -f "$DATA_DIR/corpus.jsonl" ] || python "$HERE/make_data.py" --out-dir "$DATA_DIR" --seed 0

SERVER_PID=""
TRAIN_PID=""
cleanup() {
   # train.py first (it reaps its own Ray actors, engines and router on SIGTERM), then the server.
   if [ -n "$TRAIN_PID" ] && kill -0 "$TRAIN_PID" 2>/dev/null; then
      kill -TERM "$TRAIN_PID" 2>/dev/null || true
      wait "$TRAIN_PID" 2>/dev/null || true
   fi
   if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
      kill "$SERVER_PID" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$SERVER_PID" 2>/dev/null || true
      wait "$SERVER_PID" 2>/dev/null || true
   fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

python "$HERE/retrieval_server.py" --corpus "$DATA_DIR/corpus.jsonl" --host 127.0.0.1 --port "$PORT" &
SERVER_PID=$!
[ -z "${SEARCH_R1_PIDFILE:-}" ] || echo "$SERVER_PID" > "$SEARCH_R1_PIDFILE"
export SEARCH_R1_URL="http://127.0.0.1:$PORT/retrieve"
for i in $(seq 120); do
   if python -c "import sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; then
      break
   fi
   kill -0 "$SERVER_PID" 2>/dev/null || { echo "retrieval server exited before answering" >&2; exit 1; }
   [ "$i" -lt 120 ] || { echo "retrieval server did not answer on port $PORT within 60 s" >&2; exit 1; }
   sleep 0.5
done
echo "retrieval server (pid $SERVER_PID) answers on $SEARCH_R1_URL"

ROLLOUT_ARGS=(
   --hf-checkpoint "$MODEL_DIR"
   --prompt-data "$DATA_DIR/qa_train.jsonl" --input-key prompt --label-key answer --apply-chat-template
   --rollout-shuffle
   --custom-generate-function-path "$PWD/$HERE/generate.py"
   --custom-rm-path "$PWD/$HERE/reward.py"
   --max-turns 3 --rollout-max-response-len 16 --rollout-max-context-len 512
   --num-rollout ${NUM_ROLLOUT:-3}
   --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32
   --rollout-temperature 1.0
)
ALGO_ARGS=(--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl
           --eps-clip 0.2 --eps-clip-high 0.28)
OPTIMIZER_ARGS=(--lr 1e-4 --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0)

# In the background + wait (not exec, not foreground): bash runs a signal trap only once its foreground
# command ends, so a SIGTERM to this script would otherwise wait for the whole run. `wait` passes on
# train.py's exit status (set -e), and the EXIT trap stops the server either way.
python train.py "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${ALGO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
   --micro-batch-size 8 ${MODEL_ARGS[@]} "$@" &
TRAIN_PID=$!
wait "$TRAIN_PID"
