"""What each decoder layer of a tiny Megatron model keeps for its backward, per token (one CPU process).

Builds the tiny model of `--arch` (tools/make_tiny_model.py) through slime's model provider under the test-only CPU
shim, in bf16, and runs one packed (THD) forward with gradients on. A `saved_tensors_hooks` pack hook tallies the
storages autograd keeps while each decoder layer runs, each storage once (a view keeps its whole storage, as on the
GPU), parameters and storages that more than one layer keeps left out. Three parts keep other tensors on the CPU
than slime's CUDA kernels do, so for them the hook records what the CUDA kernel keeps instead: an RMSNorm (torch's
fused kernel: its input and fp32 inverse RMS per row, where the CPU decomposition keeps fp32 copies), the core
attention (flash attention: query, key, value, output and the fp32 log-sum-exp per head) and the rotary embedding
(slime's fused kernel keeps only the model's one frequency table, megatron-core's unfused rotation cos and sin
tables per call). `--route` picks the attention of `--attention-kernel`: flash (the default), padded (cudnn's
route with the packed sequences scattered to padded rows and gathered back, forced here on sequences of one length so
that no pad token enters the per-token figures) or one-length (cudnn's route as it runs on sequences of one length:
the packed row viewed as the padded layout). Both cudnn routes run sdpa_attention.padded_causal, tallied as they are:
its SDPA runs torch's CPU flash kernel (checked), which keeps the same tensors as cuDNN's. Writes
<out>/activations.json: {"model_dir", "tokens", "layers": [bf16 bytes per token of each layer], "other": [bytes per
token of its other dtypes: fp32 statistics, the router's probabilities, indices]}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from tests import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.install()

from tests.autograd_graph import node_names  # noqa: E402
from tests.conftest import model_args  # noqa: E402


class Tally:
    """Storages kept for backward, per decoder layer: {layer: {key: (bytes, in the activation dtype)}}."""

    def __init__(self, params: set[int]):
        self.params = params
        self.layer: int | None = None
        self.substituted = False  # inside a module whose CUDA kernel's saved tensors are recorded instead
        self.kept: dict[int, dict] = {}
        self.held: list[torch.Tensor] = []  # every tallied tensor stays alive: no address is reused in the pass

    def keep(self, key, nbytes: int, activation: bool) -> None:
        self.kept.setdefault(self.layer, {})[key] = (nbytes, activation)

    def keep_storage(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self.held.append(t)
        if storage.data_ptr() not in self.params:
            self.keep(storage.data_ptr(), storage.nbytes(), t.dtype == torch.bfloat16)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.layer is not None and not self.substituted:
            self.keep_storage(t)
        return t

    def hook_layer(self, index: int, layer: torch.nn.Module, padded_attention: bool) -> None:
        layer.register_forward_pre_hook(lambda m, a: setattr(self, "layer", index))
        layer.register_forward_hook(lambda m, a, o: setattr(self, "layer", None))
        for name, module in layer.named_modules():
            if name.endswith("core_attention"):
                if padded_attention:
                    module.register_forward_hook(self.check_padded_kernel)
                else:
                    self.substitute(module, self.flash_attention)
            elif type(module).__name__ == "RMSNorm":
                self.substitute(module, self.fused_rms_norm)

    def substitute(self, module: torch.nn.Module, record) -> None:
        module.register_forward_pre_hook(lambda m, a: setattr(self, "substituted", True))

        def done(m, args, out):
            self.substituted = False
            record(m, args, out)

        module.register_forward_hook(done)

    def fused_rms_norm(self, module, args, out) -> None:
        x = args[0]
        self.keep_storage(x)
        self.keep(("inverse rms", id(module), id(x)), x.numel() // x.shape[-1] * 4, False)

    def flash_attention(self, module, args, out) -> None:
        query, key, value = args[:3]
        for t in (query, key, value, out[0] if isinstance(out, tuple) else out):
            self.keep_storage(t)
        self.keep(("log-sum-exp", id(module)), query.numel() // query.shape[-1] * 4, False)

    @staticmethod
    def check_padded_kernel(module, args, out) -> None:
        """The padded route's SDPA ran torch's CPU flash kernel, which keeps what cuDNN's does (the padded query,
        key, value and output, the fp32 log-sum-exp per head), not the math kernel's score matrix."""
        nodes = node_names(out)
        if "ScaledDotProductFlashAttentionForCpuBackward0" not in nodes:
            raise SystemExit(f"the padded attention did not run torch's CPU flash kernel: {sorted(nodes)}")

    def rotary(self, apply):
        """`apply` (megatron-core's rotation) with nothing it keeps tallied."""

        def rotate(*args, **kwargs):
            self.substituted = True
            try:
                return apply(*args, **kwargs)
            finally:
                self.substituted = False

        return rotate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=29581)
    p.add_argument("--sequences", type=int, default=3)
    p.add_argument("--length", type=int, default=40)
    p.add_argument("--route", choices=("flash", "padded", "one-length"), default="flash",
                   help="the attention route (module docstring)")
    cli = p.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    import torch.distributed as dist
    from megatron.core.transformer import attention

    from slime.backends.megatron_utils.forward import packed_seq_params
    from slime.backends.megatron_utils.model import build_model, initialize_parallel
    from slime.backends.megatron_utils.sdpa_attention import PaddedRows
    from slime.config.arguments import parse_args
    from tools.make_tiny_model import make_tiny_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cli.port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model_dir = make_tiny_model(os.path.join(cli.out, f"tiny-{cli.arch}"), arch=cli.arch, size="tiny", seed=0)
    data = os.path.join(cli.out, "prompts.jsonl")
    with open(data, "w") as f:
        f.write('{"prompt": "1+1?", "label": "2"}\n')
    args = parse_args([*model_args(f"tiny-{cli.arch.replace('_', '-')}"), "--train-backend", "megatron",
                       "--hf-checkpoint", model_dir, "--prompt-data", data, "--rollout-batch-size", "1",
                       "--n-samples-per-prompt", "1", "--global-batch-size", "1", "--num-rollout", "1",
                       "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--bf16"])
    initialize_parallel(args)
    cudnn = cli.route != "flash"
    args.attention_kernel = "cudnn" if cudnn else "flash"  # cudnn is refused on the CPU: the route runs on any device
    model = build_model(args, wrap=False)[0]
    model.eval()  # as slime trains: no dropout
    for param in model.parameters():
        param.requires_grad_(True)
    tally = Tally({param.untyped_storage().data_ptr() for param in model.parameters()})
    attention.apply_rotary_pos_emb = tally.rotary(attention.apply_rotary_pos_emb)
    for index, layer in enumerate(model.decoder.layers):
        tally.hook_layer(index, layer, padded_attention=cudnn)

    tokens = cli.sequences * cli.length
    ids = torch.randint(3, args.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(cli.length).repeat(cli.sequences).unsqueeze(0)
    packed = packed_seq_params(list(range(0, tokens + 1, cli.length)), "cpu")
    assert (packed.padded_rows is not None) == cudnn
    if cli.route == "padded":
        packed.padded_rows = PaddedRows(packed.padded_rows.lengths, viewed=False)
    with torch.autograd.graph.saved_tensors_hooks(tally.pack, lambda t: t):
        model(ids, positions, None, packed_seq_params=packed)
    owners: dict = {}
    for layer, kept in tally.kept.items():
        for key in kept:
            owners.setdefault(key, set()).add(layer)

    def per_token(layer: int, activation: bool) -> float:
        return sum(nbytes for key, (nbytes, bf16) in tally.kept.get(layer, {}).items()
                   if bf16 == activation and len(owners[key]) == 1) / tokens

    n = len(model.decoder.layers)
    with open(os.path.join(cli.out, "activations.json"), "w") as f:
        json.dump({"model_dir": model_dir, "tokens": tokens, "layers": [per_token(i, True) for i in range(n)],
                   "other": [per_token(i, False) for i in range(n)]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
