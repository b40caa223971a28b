#!/usr/bin/env bash
# GRPO on Qwen3-4B with the Megatron backend and SGLang engines on one 8-GPU node, colocated (training and
# generation take turns on the same GPUs). The full command, as a starting point to edit.
#
# Before the first run:
#   hf download Qwen/Qwen3-4B --local-dir /root/Qwen3-4B
#   hf download --repo-type dataset zhuzilin/dapo-math-17k --local-dir /root/dapo-math-17k
#   source scripts/models/qwen3-4B.sh
#   python tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint /root/Qwen3-4B \
#       --save /root/Qwen3-4B_torch_dist
# Extra flags are passed on (e.g. --num-rollout 10). PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/models/qwen3-4B.sh

CKPT_ARGS=(
   --hf-checkpoint /root/Qwen3-4B            # tokenizer, HF names for the weight push, engines' model
   --ref-load /root/Qwen3-4B_torch_dist      # frozen reference model (KL)
   --load /root/Qwen3-4B_slime/              # resumes from here when it holds a checkpoint
   --save /root/Qwen3-4B_slime/
   --save-interval 20
)
ROLLOUT_ARGS=(
   --prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label
   --apply-chat-template --rollout-shuffle --rm-type deepscaler
   --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
   --rollout-max-response-len 8192 --rollout-temperature 0.8
   --global-batch-size 256 --balance-data
)
EVAL_ARGS=(
   --eval-interval 20 --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl
   --n-samples-per-eval-prompt 16 --eval-max-response-len 16384 --eval-top-p 0.7
)
PERF_ARGS=(
   --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --context-parallel-size 1
   --expert-model-parallel-size 1 --expert-tensor-parallel-size 1
   --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
   --use-dynamic-batch-size --max-tokens-per-gpu 9216
)
GRPO_ARGS=(
   --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl
   --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
)
OPTIMIZER_ARGS=(
   --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
)
SGLANG_ARGS=(--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7)
MISC_ARGS=(
   --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32 --bf16
)

"${PYTHON:-python3}" train.py --train-backend megatron --rollout-backend sglang \
   --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate \
   "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}" \
   "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}" "$@"
