"""slime's `slime.observability`: what a run records besides its checkpoints: the train-side debug dump
(`train_data_utils`, `--save-debug-train-data`) and rollout metrics computed from the samples
(`rollout_metrics`). The rollout-side dump (`--save-debug-rollout-data`) is slime/rollout/train_data.py's, the
list-based rollout and eval metrics are slime/utils/metrics.py's."""
