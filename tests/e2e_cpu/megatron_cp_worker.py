"""One training rank for tests/e2e_cpu/test_megatron_context_parallel.py (a plain process per rank, CPU shim).

Drives `MegatronTrainRayActor` (no Ray) over a real gloo group at the layout given by --extra (e.g.
`--context-parallel-size 2`): log-probs (and entropies) of a batch -> one train step -> every parameter's
gradient as the optimizer used it (the DDP buffers, after the reduction over the data-parallel-with-CP group)
-> log-probs after the step. Rank 0 writes <out>/result.json (log-probs, metrics) and <out>/grads.pt.
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

from tests.e2e_cpu.fsdp_worker import make_batch  # noqa: E402
from tests.e2e_cpu.megatron_worker import make_args  # noqa: E402
from tests.e2e_cpu.ranks import worker_parser, write_result  # noqa: E402


def long_batch():
    """make_batch's 8 samples with longer prompts (up to 37 tokens), so that sequences span several chunks."""
    batch = make_batch(8, seed=0)
    for i, tokens in enumerate(batch.tokens):
        batch.tokens[i] = [3 + (7 * i + 5 * j) % 180 for j in range(4 * i + 1)] + tokens
    return batch


def main() -> None:
    p = worker_parser()
    p.add_argument("--extra", default="")
    cli = p.parse_args()
    cli.tp, cli.pp, cli.arch, cli.bf16, cli.engine, cli.broadcast, cli.dynamic, cli.load = \
        1, 1, "qwen3", False, False, False, False, None
    os.makedirs(cli.out, exist_ok=True)

    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.model import unwrap
    from slime.backends.megatron_utils.sdpa_attention import SDPAttention

    # how many attention calls ran across the CP group (and over how many local query tokens): the CP run must
    # really split the sequences
    calls = {"cp_attention_calls": 0, "cp_query_tokens": 0, "packed_tokens": 0}
    packed_cp, packed = SDPAttention._packed_cp, SDPAttention._packed

    def counting_cp(self, query, *rest):
        calls["cp_attention_calls"] += 1
        calls["cp_query_tokens"] += query.shape[0]
        return packed_cp(self, query, *rest)

    def counting(self, query, *rest):
        calls["packed_tokens"] += query.shape[0]
        return packed(self, query, *rest)

    SDPAttention._packed_cp, SDPAttention._packed = counting_cp, counting

    args = make_args(cli)
    batch = long_batch()
    actor = MegatronTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
    result: dict = {}
    try:
        actor.init(args, "actor", with_ref=True)
        result["lp_before"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
        rows = list(range(len(batch.tokens)))
        entropy: dict = {}
        actor._log_probs(actor.model, batch.tokens, batch.response_lengths, actor.plan(batch.tokens, rows, True),
                         entropy)
        result["entropy"] = actor.from_last_stage([entropy[r].tolist() for r in rows] if entropy else None)
        batch.rollout_log_probs = [[x + 0.05 for x in row] for row in result["lp_before"]]
        result["metrics"] = actor.train(0, batch)
        grads = {name: p.main_grad.detach().clone() for name, p in unwrap(actor.model[0]).named_parameters()
                 if p.requires_grad}
        result["lp_after"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
        from megatron.core import parallel_state as ps

        result.update(calls, cp_size=ps.get_context_parallel_world_size(), dp_size=ps.get_data_parallel_world_size())
        if cli.rank == 0:
            torch.save(grads, os.path.join(cli.out, "grads.pt"))
    finally:
        write_result(cli, result)
        actor.shutdown()


if __name__ == "__main__":
    main()
