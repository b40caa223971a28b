#!/usr/bin/env bash
# The visual toy task on CPU (docs/vlm.md): GRPO teaches a tiny random-init Qwen2.5-VL to name the colour that
# fills an image, through Ray, sglang-router, one built-in `hf` engine (image_data) and one `fsdp` rank (the
# vision tower in the forward). ARCH=qwen3_vl trains a tiny Qwen3-VL instead. Makes the model and the data under
# ./models and ./data if they are missing. Extra flags are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."

ARCH=${ARCH:-qwen2_5_vl}
MODEL_DIR=${MODEL_DIR:-models/tiny-$ARCH}
[ -f "$MODEL_DIR/config.json" ] || python tools/make_tiny_model.py --out "$MODEL_DIR" --arch "$ARCH" --seed 0
DATA=${DATA:-data/toy_colour_train.jsonl}
[ -f "$DATA" ] || python tools/make_toy_data.py --task colour --out "$DATA" --num-samples 4000 --seed 0

export SLIME_TRAIN_NUM_THREADS=${SLIME_TRAIN_NUM_THREADS:-1}
export SLIME_ENGINE_NUM_THREADS=${SLIME_ENGINE_NUM_THREADS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

python train.py --train-backend fsdp --rollout-backend hf \
   --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 \
   --hf-checkpoint "$MODEL_DIR" \
   --prompt-data "$DATA" --input-key prompt --label-key label --multimodal-keys '{"image": "images"}' \
   --apply-chat-template --rollout-shuffle --rm-type toy \
   --num-rollout ${NUM_ROLLOUT:-100} \
   --rollout-batch-size 4 --n-samples-per-prompt 32 --global-batch-size 128 \
   --rollout-max-response-len 3 --rollout-temperature 1.0 \
   --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl \
   --entropy-coef 0.01 --eps-clip 0.2 --eps-clip-high 0.28 \
   --lr 7e-4 --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0 \
   --micro-batch-size 32 "$@"
