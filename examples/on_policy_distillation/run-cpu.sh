#!/usr/bin/env bash
# On-policy distillation as slime's examples/on_policy_distillation scripts, on CPU: the tiny random-init Qwen3
# (the student) learns from a different, sharper tiny model (the teacher, examples/on_policy_distillation/
# make_teacher.py) on its own samples of the toy prompts. GRPO with --use-opd; no task reward (pure distillation).
#   OPD_TYPE=sglang (default): a teacher server, a second hf engine process started here (SGLang's API), scores
#     every sample through slime.rollout.on_policy_distillation at --rm-url; TEACHER_URL=http://HOST:PORT uses a
#     server already up instead (on a GPU an SGLang server of the teacher, tests/gpu/test_sft_opd_gpu.py);
#   OPD_TYPE=megatron: the trainer holds the teacher (--opd-teacher-load; with the fsdp backend an HF folder).
# One fsdp rank and one student engine. Makes the models and the data if missing; extra flags are passed on
# (later flags win). train/opd_reverse_kl is the student-teacher KL of each step.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=examples/on_policy_distillation

DATA=${DATA:-data/toy_train.jsonl}
[ -f "$DATA" ] || python tools/make_toy_data.py --out "$DATA" --num-samples 2000 --seed 0
source scripts/tiny-cpu-env.sh  # MODEL_DIR (the student), MODEL_ARGS, threads, CLUSTER_ARGS
TEACHER_DIR=${TEACHER_DIR:-models/tiny-qwen3-teacher}
[ -f "$TEACHER_DIR/config.json" ] || python "$HERE/make_teacher.py" --out "$TEACHER_DIR"

OPD_TYPE=${OPD_TYPE:-sglang}
if [ "$OPD_TYPE" = sglang ]; then
   if [ -z "${TEACHER_URL:-}" ]; then
      TEACHER_PORT=${TEACHER_PORT:-$(python -c "from slime.utils.net import free_port; print(free_port())")}
      TEACHER_URL="http://127.0.0.1:$TEACHER_PORT"
      python -m slime.backends.hf_engine --model-path "$TEACHER_DIR" --host 127.0.0.1 --port "$TEACHER_PORT" \
         --device cpu --dtype float32 --num-threads 1 > "${TEACHER_LOG:-/tmp/opd_teacher_$TEACHER_PORT.log}" 2>&1 &
      TEACHER_PID=$!
      trap 'kill $TEACHER_PID 2>/dev/null || true; wait $TEACHER_PID 2>/dev/null || true' EXIT
      until curl -sf --noproxy "*" "$TEACHER_URL/health" > /dev/null; do
         kill -0 $TEACHER_PID 2>/dev/null || { echo "the teacher server exited"; exit 1; }
         sleep 1
      done
   fi
   OPD_ARGS=(
      --use-opd --opd-type sglang --opd-kl-coef 1.0
      --custom-rm-path slime.rollout.on_policy_distillation.reward_func
      --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards
      --rm-url "$TEACHER_URL/generate"
   )
else
   OPD_ARGS=(--use-opd --opd-type megatron --opd-kl-coef 1.0 --opd-teacher-load "$TEACHER_DIR" --rm-type toy)
fi

ROLLOUT_ARGS=(
   --hf-checkpoint "$MODEL_DIR"
   --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
   --num-rollout ${NUM_ROLLOUT:-20}
   --rollout-batch-size 4 --n-samples-per-prompt 4 --rollout-max-response-len 8 --rollout-temperature 1
   --global-batch-size 16
)
GRPO_ARGS=(--advantage-estimator grpo --entropy-coef 0.00)
OPTIMIZER_ARGS=(--optimizer adam --lr 3e-3 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9
                --adam-beta2 0.98)

python train.py "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${OPD_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
   --micro-batch-size 16 --use-tensorboard ${MODEL_ARGS[@]} "$@"
