"""One fsdp training rank for tests/e2e_cpu/test_fsdp_vision_ranks.py: a tiny VLM (--model) trained one step on a
fixed batch whose rows 0-3 have an image each and rows 4-7 none, so that with two ranks (contiguous shares) rank 1
trains text rows only while rank 0's rows feed the vision tower.

Rank 0 writes <out>/result.json: the metrics of the step and every row's log-probs before and after it (each
rank scores all rows, in the same micro-batches: one with images, one without).
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

from slime.utils.ppo_utils import group_normalize_rewards
from slime.utils.processing_utils import build_processor_kwargs, load_processor
from slime.utils.types import TrainBatch
from tests.args import make_args as validated_args
from tests.e2e_cpu.ranks import worker_parser, write_result

COLOURS = [(255, 0, 0), (0, 200, 0), (0, 0, 255), (250, 250, 0)]


def fixed_batch(processor) -> TrainBatch:
    from PIL import Image

    tokens, lengths, images = [], [], []
    for i in range(8):
        with_image = i < 4
        content = [{"type": "text", "text": "which colour fills the image?"}]
        if with_image:
            content.insert(0, {"type": "image", "image": "x"})
        text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        if with_image:
            img = Image.new("RGB", (56, 56), COLOURS[i])
            processed = processor(text=text, **build_processor_kwargs({"images": [img]}))
            prompt = [int(t) for t in processed["input_ids"][0]]
            images.append({"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]})
        else:
            prompt = processor.tokenizer(text)["input_ids"]
            images.append(None)
        response = [100 + 7 * i + k for k in range(4)]
        tokens.append(prompt + response)
        lengths.append(len(response))
    raw = [1.0 if i % 2 == 0 else 0.0 for i in range(8)]
    groups = [i // 2 for i in range(8)]
    return TrainBatch(tokens=tokens, response_lengths=lengths, loss_masks=[[1] * n for n in lengths],
                      rewards=group_normalize_rewards(raw, groups, True), raw_rewards=raw, truncated=[False] * 8,
                      group_indices=groups, multimodal_train_inputs=images)


def scores(actor, batch: TrainBatch) -> list[list[float]]:
    rows = actor.log_probs_of_rows(actor.model, batch, [[0, 1, 2, 3], [4, 5, 6, 7]])
    return [rows[r].tolist() for r in range(len(batch))]


def main() -> None:
    cli = worker_parser().parse_args()
    os.makedirs(cli.out, exist_ok=True)
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor

    batch = fixed_batch(load_processor(cli.model, trust_remote_code=True))
    args = validated_args(hf_checkpoint=cli.model, save=os.path.join(cli.out, "ckpt"), distributed_backend="gloo",
                          lr=1e-3, weight_decay=0.0, rollout_batch_size=4, n_samples_per_prompt=2,
                          global_batch_size=8, micro_batch_size=4 // cli.world_size, use_kl_loss=True,
                          kl_loss_coef=0.01, kl_loss_type="low_var_kl")
    actor = FSDPTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
    actor.init(args, "actor", with_ref=True)
    result = {"lp_before": scores(actor, batch), "metrics": actor.train(0, batch)}
    result["lp_after"] = scores(actor, batch)
    vision = [p for n, p in actor.model.named_parameters() if "visual" in n]
    result["vision_params"] = len(vision)
    write_result(cli, result)
    actor.shutdown()


if __name__ == "__main__":
    main()
