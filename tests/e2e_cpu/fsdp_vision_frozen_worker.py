"""One fsdp training rank for tests/e2e_cpu/test_fsdp_vision_frozen.py: the tiny Qwen2.5-VL trained with its vision
tower frozen (`--freeze-params-name-list visual.`), two steps, each followed by a push to a real hf engine (started
by rank 0, which also makes the rollout every rank trains on).

The engine is wrapped in `Recording` (tests/e2e_cpu/push_recording.py), which passes every call through and notes the names and bytes of the tensors
each push announces (`update_weights_from_distributed`: the broadcast route of an engine that is not colocated).
Rank 0 writes <out>/result.json: per push the names and bytes sent, the trainer's and the engine's log-probs of the
rows after the second push, and per tensor the engine's checksum (its `/weights_checker` "checksum") next to the
trainer's checksum of the same tensor.
"""

from __future__ import annotations

import hashlib
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch

from slime.utils.processing_utils import load_processor
from tests.args import make_args as validated_args
from tests.e2e_cpu.fsdp_vision_worker import engine_scores, rollout, trainer_scores
from tests.e2e_cpu.push_recording import Recording
from tests.e2e_cpu.ranks import worker_parser, write_result


def checksum(t: torch.Tensor) -> str:
    """The engine's per-tensor checksum (slime/backends/hf_engine/weight_checker.py `checksum`)."""
    return hashlib.sha256(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def full_checksums(actor) -> dict[str, str]:
    """Collective: the checksum of every full tensor of the policy (FSDP shards gathered)."""
    from torch.distributed.tensor import DTensor

    return {n: checksum(t.full_tensor() if isinstance(t, DTensor) else t) for n, t in actor.model.state_dict().items()}


def main() -> None:
    import torch.distributed as dist

    cli = worker_parser().parse_args()
    os.makedirs(cli.out, exist_ok=True)
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
    from slime.backends.hf_engine.engine import HFEngine

    result: dict = {}
    engine = url = engine_images = None
    shared: list = [None]
    if cli.rank == 0:  # one engine, on rank 0: the others push to no engine (they only join the gathers)
        engine = HFEngine(validated_args(hf_checkpoint=cli.model, rollout_seed=0, sglang_server_concurrency=8), 0)
    try:
        if engine is not None:
            engine.init()
            url = engine.get_url()
            shared[0], engine_images = rollout(url, load_processor(cli.model, trust_remote_code=True))
        args = validated_args(hf_checkpoint=cli.model, distributed_backend="gloo", lr=1e-3, weight_decay=0.0,
                              rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=8, micro_batch_size=4,
                              update_weight_buffer_size=64 * 1024, freeze_params_name_list=[r"visual\."])
        actor = FSDPTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
        actor.init(args, "actor", with_ref=False)
        dist.broadcast_object_list(shared, src=0)  # rank 0's rollout, for every rank
        batch = shared[0]
        engines = [Recording(engine)] if engine is not None else []
        result["tower_at_start"] = {n: c for n, c in full_checksums(actor).items() if "visual." in n}
        for version in (1, 2):
            actor.train(version - 1, batch)
            for e in engines:
                e.begin_push()
            actor.update_weights(engines, weight_version=version)
        result["trainer_lp"] = trainer_scores(actor, batch)
        result["trainer_checksums"] = full_checksums(actor)
        result["trainable"] = [n for n, p in actor.model.named_parameters() if p.requires_grad]
        if engine is not None:
            result["pushes"] = engines[0].pushes
            result["engine_lp"] = engine_scores(url, batch, engine_images)
            result["engine_checksums"] = engine.check_weights("checksum")["ranks"][0]["checksums"]
        write_result(cli, result)
        actor.shutdown()
    finally:
        if engine is not None:
            engine.shutdown()


if __name__ == "__main__":
    main()
