#!/usr/bin/env bash
# The main CPU job: GRPO on the toy task ("what number comes after N?") with a tiny random-init Qwen3,
# through Ray, sglang-router, one built-in `hf` engine process and one `fsdp` training rank.
# Makes the model and the data under ./models and ./data if they are missing. Extra flags are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/tiny-cpu-env.sh  # MODEL_DIR (the tiny model, made if missing), MODEL_ARGS, threads, CLUSTER_ARGS
DATA=${DATA:-data/toy_train.jsonl}
[ -f "$DATA" ] || python tools/make_toy_data.py --out "$DATA" --num-samples 20000 --seed 0

ROLLOUT_ARGS=(
   --hf-checkpoint "$MODEL_DIR"
   --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
   --rm-type toy
   --num-rollout ${NUM_ROLLOUT:-500}
   --rollout-batch-size 4 --n-samples-per-prompt 32 --global-batch-size 128
   --rollout-max-response-len 4 --rollout-temperature 1.0
)
ALGO_ARGS=(--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl
           --entropy-coef 0.01 --eps-clip 0.2 --eps-clip-high 0.28)
OPTIMIZER_ARGS=(--lr 7e-4 --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0)

python train.py "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${ALGO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
   --use-tensorboard --micro-batch-size 32 ${MODEL_ARGS[@]} "$@"
