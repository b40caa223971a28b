"""One rank of the Megatron vision-language model for tests/e2e_cpu/test_megatron_vision_language.py.

Without CUDA it installs the test-only CPU shim (fp32). It builds the Megatron model of the tiny Qwen2.5-VL or
Qwen3-VL at --model (language model on megatron-core at --tp, the HF vision tower; MODEL_ARGS from the tiny script of
its model type), loads the HF checkpoint, and runs the rows of
<out>/rows.pt ({"ids", "pixel_values", "image_grid_thw"} each, the images None for a text row). Rank 0 writes
<out>/logits.pt with the logits over the real vocabulary, per row:
  "full": the images placed, 3-D (mrope) positions;
  "no_features": the same positions, the image tokens left with their own embeddings;
  "rope_1d": the images placed, positions 0, 1, 2, ... on all three axes (plain 1-D RoPE);
  "batched": the "full" logits of all rows run as one right-padded batch, each row cut to its length;
  "no_deepstack" (Qwen3-VL): "full" with the deepstack mergers' last linear zeroed (no deepstack features);
  "text_row_tower_grads": after a backward of the text row's logits, how many tower parameters got a gradient
  (of how many) and its largest magnitude.
With --actor it drives `MegatronTrainRayActor` instead (no Ray) on the same rows as one TrainBatch (the last
--response-tokens of each row its response, `multimodal_train_inputs` its images), micro-batches of 2 rows
(--qkv-format given by --extra), and rank 0 writes <out>/result.json: the response log-probs of
`log_probs_of_rows`, then the metrics of one training step (REWARDS: every row with images gets a gradient) and the
tower's gradient of it, and the largest change of a
vision-tower and of a language-model weight. With --engine (one rank) it then starts an `hf` engine on the
checkpoint, pushes the trained weights into it (by broadcast over gloo) and adds the names pushed and the engine's
response log-probs of the rows (images as image_data) before and after the push, and the trainer's after the step
(and the HF folder `save_hf_weights` writes then, "hf_saved");
then one more step and push, adding the names and bytes each push announced (tests/e2e_cpu/push_recording.py) and
both sides' log-probs after the second push.
transformers' logits are computed by the test in its own process (not under the shim).
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

if not torch.cuda.is_available():
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()

from tests.conftest import model_args  # noqa: E402
from tests.e2e_cpu.push_recording import Recording  # noqa: E402
from tests.e2e_cpu.ranks import worker_parser, write_prompt_file, write_result  # noqa: E402


# model type of the tiny VLM -> its scripts/models/*.sh
SCRIPTS = {"qwen2_5_vl": "tiny-qwen2.5-vl", "qwen3_vl": "tiny-qwen3-vl"}
VISION_NAMES = ("visual.", "model.visual.")  # the pushed tower: Qwen2.5-VL's Hub names, Qwen3-VL's
REWARDS = [1.0, -1.0, 0.5, -0.5]


def script_of(model: str) -> str:
    import json

    with open(os.path.join(model, "config.json")) as f:
        return SCRIPTS[json.load(f)["model_type"]]


def main() -> None:
    p = worker_parser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--actor", action="store_true")
    p.add_argument("--response-tokens", type=int, default=3)
    p.add_argument("--extra", default="", help="more slime flags, space-separated")
    p.add_argument("--engine", action="store_true", help="with --actor: push the trained weights into an hf engine")
    cli = p.parse_args()
    if cli.actor:
        run_actor(cli)
        return
    import torch.distributed as dist
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from slime.backends.megatron_utils import weights
    from slime.backends.megatron_utils.model import build_model, initialize_parallel
    from slime.backends.megatron_utils.vision_language import mrope_position_ids
    from slime.config.arguments import parse_args

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cli.port}", rank=cli.rank,
                            world_size=cli.world_size)
    argv = [*model_args(script_of(cli.model)), "--train-backend", "megatron", "--hf-checkpoint", cli.model,
            "--prompt-data", write_prompt_file(cli), "--rollout-batch-size", "1", "--n-samples-per-prompt", "1",
            "--global-batch-size", "1", "--num-rollout", "1", "--actor-num-gpus-per-node", str(cli.world_size),
            "--rollout-num-gpus", "1", "--tensor-model-parallel-size", str(cli.tp), "--qkv-format", "bshd"]
    args = parse_args(argv)
    initialize_parallel(args)
    model = build_model(args, wrap=False)[0]
    weights.load_hf_weights([model], args, cli.model)
    rows = torch.load(os.path.join(cli.out, "rows.pt"))
    merge = model.visual.spatial_merge_size
    image_token = model.image_token_id

    def logits(ids, positions, images):
        with torch.no_grad():
            out = model(ids, positions, None, **images)
        return gather_from_tensor_model_parallel_region(out)[..., : args.vocab_size].float()

    def images_of(selected):
        found = [r for r in selected if r["pixel_values"] is not None]
        if not found:
            return {}
        return {"pixel_values": torch.cat([r["pixel_values"] for r in found]),
                "image_grid_thw": torch.cat([r["image_grid_thw"] for r in found])}

    def positions_of(row):
        ids = row["ids"].unsqueeze(0)
        return mrope_position_ids(ids, images_of([row]).get("image_grid_thw"), ids == image_token, merge)

    out = {"full": [], "no_features": [], "rope_1d": []}
    for row in rows:
        ids = row["ids"].unsqueeze(0)
        images = images_of([row])
        positions = positions_of(row)
        flat = torch.arange(ids.shape[1]).expand(3, 1, -1)
        out["full"].append(logits(ids, positions, images)[0])
        out["no_features"].append(logits(ids, positions, {})[0])
        out["rope_1d"].append(logits(ids, flat, images)[0])
    lengths = [len(r["ids"]) for r in rows]
    batch = torch.zeros(len(rows), max(lengths), dtype=torch.long)  # right-padded with token 0
    for i, r in enumerate(rows):
        batch[i, : lengths[i]] = r["ids"]
    images = images_of(rows)
    positions = mrope_position_ids(batch, images.get("image_grid_thw"), batch == image_token, merge)
    batched = logits(batch, positions, images)
    out["batched"] = [batched[i, :n] for i, n in enumerate(lengths)]
    mergers = getattr(model.visual, "deepstack_merger_list", None)
    if mergers is not None:  # Qwen3-VL: the same rows with every deepstack feature zero (their last linear zeroed)
        saved = {k: v.detach().clone() for k, v in mergers.state_dict().items()}
        with torch.no_grad():
            for merger in mergers:
                merger.linear_fc2.weight.zero_()
                merger.linear_fc2.bias.zero_()
        out["no_deepstack"] = [logits(row["ids"].unsqueeze(0), positions_of(row), images_of([row]))[0]
                               for row in rows]
        mergers.load_state_dict(saved)
    # a text-only forward with gradients: every tower parameter gets a (zero) gradient, as with images
    text = next(r for r in rows if r["pixel_values"] is None)["ids"].unsqueeze(0)
    model.requires_grad_(True)
    model(text, torch.arange(text.shape[1]).expand(3, 1, -1), None).float().sum().backward()
    tower = [p.grad for p in model.visual.parameters()]
    out["text_row_tower_grads"] = {"parameters": len(tower), "with_grad": sum(g is not None for g in tower),
                                   "largest": max(float(g.abs().max()) for g in tower if g is not None)}
    if cli.rank == 0:
        torch.save(out, os.path.join(cli.out, "logits.pt"))
    write_result(cli, {"rows": len(rows)})
    dist.destroy_process_group()


def run_actor(cli) -> None:
    from slime.backends.megatron_utils import weights
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.model import unwrap
    from slime.config.arguments import parse_args
    from slime.utils.types import TrainBatch

    rows = torch.load(os.path.join(cli.out, "rows.pt"))
    n, r = len(rows), cli.response_tokens
    argv = [*model_args(script_of(cli.model)), "--train-backend", "megatron", "--hf-checkpoint", cli.model,
            "--prompt-data", write_prompt_file(cli), "--rollout-batch-size", str(n), "--n-samples-per-prompt", "1",
            "--global-batch-size", str(n), "--micro-batch-size", "2", "--num-rollout", "1",
            "--actor-num-gpus-per-node", str(cli.world_size), "--rollout-num-gpus", "1",
            "--tensor-model-parallel-size", str(cli.tp), "--lr", "1e-2", "--seed", "1234", *cli.extra.split()]
    args = parse_args(argv)
    batch = TrainBatch(tokens=[row["ids"].tolist() for row in rows], response_lengths=[r] * n,
                       loss_masks=[[1] * r] * n, rewards=REWARDS[:n], raw_rewards=REWARDS[:n],
                       truncated=[False] * n, group_indices=[0] * n,
                       multimodal_train_inputs=[{"pixel_values": row["pixel_values"],
                                                 "image_grid_thw": row["image_grid_thw"]}
                                                if row["pixel_values"] is not None else None for row in rows])
    actor = MegatronTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
    result: dict = {}
    engine = None
    try:
        actor.init(args, "actor", with_ref=False)
        lp = actor.log_probs_of_rows(actor.model, batch, actor.plan(batch.tokens, list(range(n)), log_probs=True))
        mine = [lp[i].float().cpu().tolist() for i in range(n)] if lp else None  # on the last pipeline stage
        result["log_probs"] = actor.from_last_stage(mine)
        model = unwrap(actor.model[0])
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        batch.rollout_log_probs = result["log_probs"]
        result["metrics"] = actor.train(0, batch)
        changed = {k: float((v.detach() - before[k]).abs().max()) for k, v in model.named_parameters()}
        # the tower lives on the first pipeline stage (rank 0, which reports)
        result["vision_change"] = max((v for k, v in changed.items() if k.startswith("visual.")), default=0.0)
        result["language_change"] = max(v for k, v in changed.items() if not k.startswith("visual."))
        result["sequence_parallel"] = model.config.sequence_parallel
        # the step's gradient of the tower (DDP keeps it in main_grad until the next step zeroes it)
        result["vision_grad"] = sum(float(p.main_grad.abs().sum()) for k, p in model.named_parameters()
                                    if k.startswith("visual.") and getattr(p, "main_grad", None) is not None)
        if cli.engine:
            engine = start_engine(cli.model)
            result["engine_lp_before_push"] = engine_log_probs(engine, rows, r)
            result["pushed_names"] = [name for name, _ in weights.iter_hf_weights(actor.model, args, actor.hf_config)]
            result["pushed_visual"] = sum(n.startswith(VISION_NAMES) for n in result["pushed_names"])
            result["pushed_language"] = len(result["pushed_names"]) - result["pushed_visual"]
            recording = Recording(engine)
            recording.begin_push()
            actor.update_weights([recording], weight_version=1)
            result["engine_lp_after_push"] = engine_log_probs(engine, rows, r)
            result["engine_weight_version"] = engine.get_weight_version()
            lp = actor.log_probs_of_rows(actor.model, batch, actor.plan(batch.tokens, list(range(n)), log_probs=True))
            result["lp_after"] = [lp[i].float().cpu().tolist() for i in range(n)]
            result["hf_saved"] = os.path.join(cli.out, "hf_after_step")  # --save-hf's writer, after the same step
            weights.save_hf_weights(actor.model, args, actor.hf_config, result["hf_saved"])
            # a second step and push: a frozen tower stays out of it (slime/weight_sync/frozen.py)
            actor.train(1, batch)
            recording.begin_push()
            actor.update_weights([recording], weight_version=2)
            result["pushes"] = recording.pushes
            result["engine_lp_after_push2"] = engine_log_probs(engine, rows, r)
            lp = actor.log_probs_of_rows(actor.model, batch, actor.plan(batch.tokens, list(range(n)), log_probs=True))
            result["lp_after2"] = [lp[i].float().cpu().tolist() for i in range(n)]
        write_result(cli, result)
    finally:
        try:
            actor.shutdown()  # first: it dissolves the weight broadcast group with the engine
        finally:
            if engine is not None:
                engine.shutdown()


def start_engine(model: str):
    from slime.backends.hf_engine.engine import HFEngine
    from tests.args import make_args as validated_args

    engine = HFEngine(validated_args(hf_checkpoint=model, rollout_seed=0, sglang_server_concurrency=8), 0)
    engine.init()
    return engine


def engine_log_probs(engine, rows: list[dict], response: int) -> list[list[float]]:
    """The engine's log-probs of each row's last `response` tokens, its images sent as image_data."""
    import httpx

    out = []
    for row in rows:
        ids = row["ids"].tolist()
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": 0, **({"image_data": row["image_data"]} if row["image_data"] else {})}
        meta = httpx.post(engine.get_url() + "/generate", json=body, timeout=60).json()["meta_info"]
        out.append([e[0] for e in meta["input_token_logprobs"][len(ids) - response:]])
    return out


if __name__ == "__main__":
    main()
