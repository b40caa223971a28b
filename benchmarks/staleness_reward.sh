#!/usr/bin/env bash
# Staleness vs reward on the CPU quick-start task (scripts/run-tiny-cpu.sh's job and flags, --num-rollout 150):
# lag 0 is train.py (on-policy); lag N > 0 is train_async.py generating each rollout N steps ahead
# (--async-buffer-size N, a push after every step), so every sample is exactly N versions behind when it trains,
# with --max-policy-version-lag N checking it (no group may be dropped: the bound equals the built-in lag).
# Two runs at a time, niced; then docs/staleness_reward.png (raw reward, smoothed over 10 rollouts).
#
#     bash benchmarks/staleness_reward.sh            # LAGS="0 1 2 4" NUM_ROLLOUT=150 OUT=outputs/staleness
set -euo pipefail
cd "$(dirname "$0")/.."

LAGS=${LAGS:-"0 1 2 4"}
OUT=${OUT:-outputs/staleness}
export NUM_ROLLOUT=${NUM_ROLLOUT:-150}

# made once here, not by two runs at the same time (run-tiny-cpu.sh makes them when missing)
export MODEL_DIR=${MODEL_DIR:-models/tiny-qwen3} DATA=${DATA:-data/toy_train.jsonl}
[ -f "$MODEL_DIR/config.json" ] || python tools/make_tiny_model.py --out "$MODEL_DIR" --size tiny --seed 0
[ -f "$DATA" ] || python tools/make_toy_data.py --out "$DATA" --num-samples 20000 --seed 0
mkdir -p "$OUT"
# run-tiny-cpu.sh's job through train_async.py: the same flags and directory, the script's train.py swapped
sed -e 's#^python train.py #python train_async.py #' -e "s#^cd .*#cd \"$PWD\"#" scripts/run-tiny-cpu.sh \
    > "$OUT/run-async.sh"

run_one() {
    local lag=$1 rc=0
    local tb="$OUT/lag$lag"
    rm -rf "$tb"
    if [ "$lag" = 0 ]; then
        nice -n 10 bash scripts/run-tiny-cpu.sh --tensorboard-dir "$tb" > "$OUT/lag$lag.log" 2>&1 || rc=$?
    else
        nice -n 10 bash "$OUT/run-async.sh" --tensorboard-dir "$tb" --async-buffer-size "$lag" \
            --max-policy-version-lag "$lag" > "$OUT/lag$lag.log" 2>&1 || rc=$?
    fi
    echo "lag $lag: exit $rc ($tb)"
}

pids=()
for lag in $LAGS; do
    run_one "$lag" &
    pids+=($!)
    if [ ${#pids[@]} -ge 2 ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
wait

dirs=() labels=()
for lag in $LAGS; do dirs+=("$OUT/lag$lag"); labels+=("lag $lag"); done
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python tools/plot_metrics.py "${dirs[@]}" --labels "${labels[@]}" --smooth 10 --tags rollout/raw_reward \
    --out "$OUT/plot" --dpi 80
cp "$OUT/plot/tags.png" docs/staleness_reward.png
