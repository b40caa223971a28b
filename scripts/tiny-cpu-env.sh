# Sourced from the repository root by the CPU run scripts (scripts/run-tiny-cpu.sh, examples/*/run-cpu.sh):
# the tiny random-init Qwen3 under $MODEL_DIR (made if missing) and its MODEL_ARGS, one thread per process
# (two cores: training, engine and router would otherwise fight over them), and CLUSTER_ARGS for one
# training rank and one engine.
MODEL_DIR=${MODEL_DIR:-models/tiny-qwen3}
[ -f "$MODEL_DIR/config.json" ] || python tools/make_tiny_model.py --out "$MODEL_DIR" --size tiny --seed 0
source scripts/models/tiny-qwen3.sh

export SLIME_TRAIN_NUM_THREADS=${SLIME_TRAIN_NUM_THREADS:-1}
export SLIME_ENGINE_NUM_THREADS=${SLIME_ENGINE_NUM_THREADS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

CLUSTER_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1)
