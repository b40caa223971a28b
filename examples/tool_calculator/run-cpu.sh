#!/usr/bin/env bash
# GRPO on the calculator tool-use task with the tiny random-init Qwen3 on CPU: Ray, sglang-router, one hf
# engine, one fsdp rank; the episode (answer, or `call` the calculator, which alone sees the task's secret
# numbers, and answer after its result) runs in
# examples/tool_calculator/generate.py. Makes the model and the data if missing. Extra flags are passed on
# (later flags win, e.g. --num-rollout 1).
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=examples/tool_calculator

DATA=${DATA:-data/calc_train.jsonl}
[ -f "$DATA" ] || python "$HERE/make_data.py" --out "$DATA" --num-samples 20000 --seed 0

source scripts/tiny-cpu-env.sh  # MODEL_DIR, MODEL_ARGS, threads, CLUSTER_ARGS

ROLLOUT_ARGS=(
   --hf-checkpoint "$MODEL_DIR"
   --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
   --custom-generate-function-path "$PWD/$HERE/generate.py"
   --custom-rm-path "$PWD/$HERE/reward.py"
   --max-turns 2 --rollout-max-response-len 4 --rollout-max-context-len 64
   --num-rollout ${NUM_ROLLOUT:-400}
   --rollout-batch-size 64 --n-samples-per-prompt 8 --global-batch-size 512 --sglang-server-concurrency 128
   --rollout-temperature 1.0
)
ALGO_ARGS=(--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl
           --entropy-coef 0.02 --eps-clip 0.2 --eps-clip-high 0.28)
OPTIMIZER_ARGS=(--lr 2e-4 --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0)

python train.py "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${ALGO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
   --use-tensorboard --micro-batch-size 32 ${MODEL_ARGS[@]} "$@"
