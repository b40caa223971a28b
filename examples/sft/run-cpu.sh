#!/usr/bin/env bash
# SFT with slime's command line (scripts/run-qwen3-4B-base-sft.sh: its SFT and optimizer flags, CPU sizes) on the
# tiny random-init Qwen3: no engine (--debug-train-only), one fsdp rank, the chat rows of
# examples/sft/make_data.py. Makes the model and the data if missing. Extra flags are passed on (later flags win,
# e.g. --num-epoch 1, --save ckpt --save-interval 8, --train-backend megatron on a GPU).
# slime runs these flags with train_async.py; ENTRY=train_async.py does the same here (default: train.py).
set -euo pipefail
cd "$(dirname "$0")/../.."

DATA=${DATA:-data/sft_train.jsonl}
[ -f "$DATA" ] || python examples/sft/make_data.py --out "$DATA" --num-samples 64 --seed 0

source scripts/tiny-cpu-env.sh  # MODEL_DIR, MODEL_ARGS, one thread per process

SFT_ARGS=(
   --rollout-function-path slime.rollout.sft_rollout.generate_rollout
   --prompt-data "$DATA"
   --input-key messages
   --rollout-shuffle
   --num-epoch 3
   --rollout-batch-size 8
   --global-batch-size 8

   --loss-type sft_loss
   --calculate-per-token-loss
   --disable-compute-advantages-and-returns
   --debug-train-only
)
PERF_ARGS=(--use-dynamic-batch-size --max-tokens-per-gpu 512)
OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 3e-3
   --lr-decay-style cosine
   --min-lr 3e-4
   --lr-warmup-fraction 0.1
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.95
)

python "${ENTRY:-train.py}" --actor-num-nodes 1 --actor-num-gpus-per-node 1 --hf-checkpoint "$MODEL_DIR" \
   "${SFT_ARGS[@]}" "${PERF_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" --use-tensorboard ${MODEL_ARGS[@]} "$@"
