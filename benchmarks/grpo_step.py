"""One GRPO job run by slime and by TRL's GRPOTrainer, side by side in one invocation (GPU).

    python benchmarks/grpo_step.py [--shape qwen3-0.6b] [--prompts 32] [--prompt-len 64] [--response-len 256]
                                   [--steps 5] [--micro-batch-size 16] [--systems slime,trl]
                                   [--sglang-attention-backend triton] [--max-tokens-per-gpu N]
                                   [--log-probs-kernel triton] [--resident --sglang-mem-fraction 0.15]
                                   [--train-args "--attention-kernel cudnn"]

Both sides get the same random-init model (published Qwen3 dimensions, benchmarks/weight_sync.py's helper,
loaded in fp32 and trained with bf16 compute), the same prompts (`--prompts` strings of exactly
`--prompt-len` word-level tokens, so neither side pads them), 8 samples per prompt at temperature 1, a
fixed response length (EOS ignored: slime through this file's `generate`, TRL through `min_new_tokens`),
the same reward (this file's `reward`), one optimizer step per batch (global batch = prompts x 8, micro
batch `--micro-batch-size`), AdamW lr 1e-6 without weight decay, grad clip 1, clip epsilon 0.2, no KL and
no reference model.

- slime: `train.py`, colocated on the one GPU (fsdp trainer + the `hf` engine; a CUDA-IPC weight push after
  every step; `--colocate` hands the GPU over between the two sides every step). Its numbers are the per-rollout
  `perf/*` scalars of its TensorBoard directory; "handoff s" is that hand-over (`perf/handoff_time`), part of the
  step beside the rollout, training and weight sync, printed by phase below the table. `--resident` keeps both
  sides on the GPU instead (no handoff; `--sglang-mem-fraction` sizes SGLang's static memory beside the trainer).
  `slime-megatron`: the Megatron trainer + the `hf` engine. `slime-sglang`: the Megatron trainer + a real SGLang
  server behind sglang-router (what slime users run; `update_weights_from_tensor` over CUDA IPC after every
  step). SGLang is started by `SLIME_SGLANG_LAUNCHER` when it is set (docs/sglang_backend.md), with
  `--sglang-attention-backend` (triton by default), the pytorch sampler, bf16, CUDA graphs up to the batch
  and no prefill CUDA graphs; its start-up is not part of any step.
  The Megatron trainer packs micro-batches of at most `--max-tokens-per-gpu` tokens (slime's
  `--use-dynamic-batch-size`); by default the tokens of `--micro-batch-size` samples, i.e. the micro-batches TRL
  gets. A larger budget is the lever slime users have (fewer, larger micro-batches; same optimizer step).
- TRL: `GRPOTrainer` with its default generation path (`model.generate` inside the trainer), timed by a
  callback (step) and a wrapper around the model's `generate` (rollout).

Each side runs as its own process, one after the other; the first `--warmup` steps are left out of the
means. Peak memory is the device's used memory (all processes, `torch.cuda.mem_get_info` polled every
0.2 s by this script) above what was used before the run started.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH_DIR)

from slime.algorithm.log_probs import KERNELS  # noqa: E402

SAMPLES_PER_PROMPT = 8
# the phases of the memory handoff (slime/ray/handoff.py), each `perf/<phase>_time`
HANDOFF_PARTS = ("engine_release", "train_onload", "train_offload", "engine_resume")


# ---- the task: shared by both sides ---------------------------------------------------------------------


def score(token_ids: list[int]) -> float:
    """The reward: the fraction of response tokens with an even id (cheap, and it varies between samples)."""
    return sum(1 for t in token_ids if t % 2 == 0) / max(1, len(token_ids))


async def reward(args, sample) -> float:
    """slime's `--custom-rm-path` hook."""
    return score(sample.tokens[len(sample.tokens) - sample.response_length:])


async def generate(args, sample, sampling_params):
    """slime's `--custom-generate-function-path` hook: the default request, EOS ignored (fixed length)."""
    from slime.rollout.sglang_rollout import generate as default_generate

    return await default_generate(args, sample, {**sampling_params, "ignore_eos": True})


def write_prompts(path: str, count: int, length: int, vocab_size: int, seed: int = 0) -> str:
    """`count` prompts of exactly `length` tokens of the word-level tokenizer ('w<id>' is token <id>)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            words = " ".join(f"w{rng.randrange(1, vocab_size - 1)}" for _ in range(length))
            f.write(json.dumps({"prompt": words, "label": ""}) + "\n")
    return path


def job_inputs(args, workdir: str) -> tuple[str, str]:
    """The job's random-init model folder of `--shape` and its prompts file, under `workdir` (the model is not kept
    on the GPU)."""
    import torch

    from weight_sync import SHAPES, make_model_dir

    model_dir, model = make_model_dir(args.shape, workdir)
    del model
    torch.cuda.empty_cache()
    data = write_prompts(os.path.join(workdir, "prompts.jsonl"), args.prompts, args.prompt_len,
                         SHAPES[args.shape]["vocab_size"])
    return model_dir, data


# ---- device memory ------------------------------------------------------------------------------------------


class MemoryPeak:
    """Polls the device's used memory in a thread; `peak_gb` is the most seen above the level at start."""

    def __init__(self, interval: float = 0.2):
        import torch

        self._torch, self.interval = torch, interval
        self.base = self._used()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _used(self) -> int:
        free, total = self._torch.cuda.mem_get_info()
        return total - free

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._used())

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_gb(self) -> float:
        return (self.peak - self.base) / 1e9


# ---- the two sides ------------------------------------------------------------------------------------------


# the Megatron flags of each shape (scripts/models/*.sh)
MODEL_SCRIPTS = {"qwen3-0.6b": "qwen3-0.6B", "qwen3-4b": "qwen3-4B"}


def model_args(shape: str) -> list[str]:
    script = os.path.join(ROOT, "scripts", "models", f"{MODEL_SCRIPTS[shape]}.sh")
    out = subprocess.run(["bash", "-c", f"set -eu; source '{script}'; printf '%s\\n' \"${{MODEL_ARGS[@]}}\""],
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def backend_flags(args, backend: str) -> list[str]:
    """fsdp: the HF model in fp32 under bf16 autocast. megatron: bf16 parameters with fp32 master weights
    (distributed optimizer), packed micro-batches of at most --max-tokens-per-gpu tokens."""
    kernel = ["--log-probs-kernel", getattr(args, "log_probs_kernel", "auto")]
    if backend == "fsdp":
        return ["--train-backend", "fsdp", "--micro-batch-size", str(args.micro_batch_size), *kernel]
    tokens = getattr(args, "max_tokens_per_gpu", None) or args.micro_batch_size * (args.prompt_len + args.response_len)
    return ["--train-backend", "megatron", *model_args(args.shape), "--bf16", "--use-distributed-optimizer",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(tokens), *kernel]


# system -> (training backend, rollout backend)
SLIME_SYSTEMS = {"slime": ("fsdp", "hf"), "slime-megatron": ("megatron", "hf"), "slime-sglang": ("megatron", "sglang")}


def rollout_flags(args, rollout: str) -> list[str]:
    if rollout == "hf":
        return ["--rollout-backend", "hf"]
    batch = args.prompts * SAMPLES_PER_PROMPT
    return ["--rollout-backend", "sglang", "--sglang-attention-backend", args.sglang_attention_backend,
            "--sglang-sampling-backend", "pytorch", "--sglang-dtype", "bfloat16",
            "--sglang-mem-fraction-static", str(getattr(args, "sglang_mem_fraction", 0.3)),
            "--sglang-cuda-graph-max-bs", str(batch),
            "--sglang-disable-prefill-cuda-graph"]


def slime_command(args, model_dir: str, data: str, tb_dir: str, backend: str = "fsdp",
                  rollout: str = "hf") -> list[str]:
    batch = args.prompts * SAMPLES_PER_PROMPT
    here = os.path.abspath(__file__)
    return [
        sys.executable, os.path.join(ROOT, "train.py"),
        "--hf-checkpoint", model_dir, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
        "--custom-rm-path", f"{here}:reward", "--custom-generate-function-path", f"{here}:generate",
        *backend_flags(args, backend), *rollout_flags(args, rollout), "--colocate",
        *(["--no-offload-train", "--no-offload-rollout"] if getattr(args, "resident", False) else []),
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(SAMPLES_PER_PROMPT),
        "--global-batch-size", str(batch),
        "--sglang-server-concurrency", str(batch),
        "--rollout-max-response-len", str(args.response_len), "--rollout-temperature", "1.0",
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.2",
        "--lr", "1e-6", "--weight-decay", "0.0", "--adam-beta1", "0.9", "--adam-beta2", "0.999",
        "--clip-grad", "1.0", "--num-rollout", str(args.steps),
        "--use-tensorboard", "--tensorboard-dir", tb_dir,
    ]


def run_slime(args, model_dir: str, data: str, workdir: str, name: str = "slime") -> dict:
    from slime.utils.tracking import read_scalars

    backend, rollout = SLIME_SYSTEMS[name]
    tb_dir = os.path.join(workdir, f"{name}_tb")
    log_path = os.path.join(workdir, f"{name}.log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               SLIME_ENGINE_LOG_DIR=os.path.join(workdir, f"{name}_engine_logs"))
    print(f"[{name}] train.py ... (log: {log_path})", flush=True)
    cmd = [*slime_command(args, model_dir, data, tb_dir, backend, rollout), *shlex.split(args.train_args)]
    with MemoryPeak() as mem, open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir).returncode
    if rc != 0:
        with open(log_path) as f:
            raise SystemExit(f"[{name}] train.py exited with {rc}; log tail:\n{f.read()[-4000:]}")

    def per_step(tag: str, skip: int = args.warmup) -> list[float]:
        values = read_scalars(tb_dir, tag)
        return [values[k] for k in sorted(values)][skip:]

    return {"step": per_step("perf/step_time"), "rollout": per_step("perf/rollout_time"),
            "train": per_step("perf/train_time"), "sync": per_step("perf/update_weights_time"),
            "handoff": per_step("perf/handoff_time"), "reward": per_step("rollout/raw_reward"), "peak_gb": mem.peak_gb,
            "logprob_gap": per_step("train/train_rollout_logprob_abs_diff", skip=0),
            "handoff_parts": {part: per_step(f"perf/{part}_time") for part in HANDOFF_PARTS}}


def run_trl(args, model_dir: str, data: str, workdir: str) -> dict:
    out = os.path.join(workdir, "trl.json")
    log_path = os.path.join(workdir, "trl.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", out, "--model-dir", model_dir,
           "--data", data, "--prompts", str(args.prompts), "--response-len", str(args.response_len),
           "--steps", str(args.steps), "--micro-batch-size", str(args.micro_batch_size)]
    print(f"[trl] GRPOTrainer ... (log: {log_path})", flush=True)
    with MemoryPeak() as mem, open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir).returncode
    if rc != 0:
        with open(log_path) as f:
            raise SystemExit(f"[trl] exited with {rc}; log tail:\n{f.read()[-4000:]}")
    with open(out) as f:
        steps = json.load(f)
    steps = steps[args.warmup:]
    return {"step": [s["step"] for s in steps], "rollout": [s["rollout"] for s in steps],
            "train": [s["step"] - s["rollout"] for s in steps], "sync": [],
            "reward": [s["reward"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps],
            "peak_gb": mem.peak_gb}


def trl_worker(args) -> None:
    """Runs inside its own process: GRPOTrainer on the same job; writes per-step timings to `args.trl_worker`."""
    import torch
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    with open(args.data) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    # Built from an Arrow table with a fixed fingerprint: datasets' fingerprint hashing pickles the table
    # schema, which fails with some pyarrow versions and is irrelevant here.
    dataset = Dataset(InMemoryTable.from_pydict({"prompt": prompts}), fingerprint="grpo-step-prompts")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    batch = args.prompts * SAMPLES_PER_PROMPT
    timings: list[dict] = []
    rollout_seconds = [0.0]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CPU: smoke runs only

    inner_generate = model.generate

    def timed_generate(*a, **kw):
        sync()
        start = time.perf_counter()
        out = inner_generate(*a, **kw)
        sync()
        rollout_seconds[0] += time.perf_counter() - start
        return out

    model.generate = timed_generate

    def trl_reward(completions, completion_ids, **kw):
        return [score(ids) for ids in completion_ids]

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            sync()
            self.start = time.perf_counter()
            rollout_seconds[0] = 0.0

        def on_step_end(self, *a, **kw):
            sync()
            timings.append({"step": time.perf_counter() - self.start, "rollout": rollout_seconds[0]})

        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "reward" in logs and timings:
                timings[-1]["reward"] = float(logs["reward"])
                timings[-1]["grad_norm"] = float(logs.get("grad_norm", math.nan))

    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(args.trl_worker), "trl_out"), report_to=[], save_strategy="no",
        max_steps=args.steps, logging_steps=1, num_generations=SAMPLES_PER_PROMPT,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=batch // args.micro_batch_size,
        max_completion_length=args.response_len, generation_kwargs={"min_new_tokens": args.response_len},
        temperature=1.0, beta=0.0, epsilon=0.2, learning_rate=1e-6, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, max_grad_norm=1.0, lr_scheduler_type="constant", bf16=True,
        gradient_checkpointing=False, num_iterations=1, shuffle_dataset=False, seed=0,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    with open(args.trl_worker, "w") as f:
        json.dump(timings, f)


# ---- report -------------------------------------------------------------------------------------------------


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def report(args, results: dict[str, dict]) -> str:
    samples = args.prompts * SAMPLES_PER_PROMPT
    rollout_tokens = samples * args.response_len
    train_tokens = samples * (args.prompt_len + args.response_len)
    rows = {}
    for name, r in results.items():
        rows[name] = {
            "step s": _mean(r["step"]), "rollout s": _mean(r["rollout"]),
            "rollout tok/s": rollout_tokens / _mean(r["rollout"]), "train s": _mean(r["train"]),
            "train tok/s": train_tokens / _mean(r["train"]),
            "weight sync s": _mean(r["sync"]) if r["sync"] else float("nan"),
            "handoff s": _mean(r["handoff"]) if r.get("handoff") else float("nan"), "peak GB": r["peak_gb"],
        }
    cols = list(next(iter(rows.values())))
    lines = [f"{samples} samples x {args.response_len} tokens per step ({args.prompts} prompts x "
             f"{SAMPLES_PER_PROMPT}, prompt {args.prompt_len} tokens), {args.shape}; means of steps "
             f"{args.warmup + 1}..{args.steps}",
             "| system | " + " | ".join(cols) + " |", "| --- |" + " ---: |" * len(cols)]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join("-" if math.isnan(v) else f"{v:,.2f}" for v in row.values()) + " |")
    for name in [n for n in rows if n.startswith("slime")] if "trl" in rows else []:
        s, t = rows[name], rows["trl"]
        lines.append(f"| TRL / {name} (time), {name} / TRL (tok/s, GB) | " + " | ".join(
            "-" if math.isnan(s[c]) or math.isnan(t[c]) else
            f"{(t[c] / s[c] if c.endswith(' s') else s[c] / t[c]):.2f}x" for c in cols) + " |")
    for name, r in results.items():
        extra = f"; TRL grad_norm {', '.join(f'{g:.3g}' for g in r['grad_norm'])}" if "grad_norm" in r else ""
        lines.append(f"{name}: reward per step {', '.join(f'{v:.3f}' for v in r['reward'])}{extra}")
        if r.get("logprob_gap"):
            lines.append(f"{name}: |trainer - engine log-prob| per step, all steps: "
                         + ", ".join(f"{v:.2e}" for v in r["logprob_gap"]))
        parts = {part: _mean(v) for part, v in (r.get("handoff_parts") or {}).items() if v}
        if parts:
            lines.append(f"{name}: handoff s per step, by phase: "
                         + ", ".join(f"{part} {seconds:.2f}" for part, seconds in parts.items()))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the means")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="Megatron systems: token budget per micro-batch (default: --micro-batch-size samples' tokens)")
    p.add_argument("--systems", default="slime,trl", help="of slime (fsdp), slime-megatron, slime-sglang, trl")
    p.add_argument("--sglang-attention-backend", default="triton", help="slime-sglang: SGLang's attention backend")
    p.add_argument("--log-probs-kernel", default="auto", choices=("auto", *KERNELS),
                   help="the slime systems' --log-probs-kernel (default: slime's, auto: triton on CUDA)")
    p.add_argument("--resident", action="store_true",
                   help="the slime systems colocated without the memory handoff (--no-offload-train "
                   "--no-offload-rollout): both sides stay on the GPU; lower --sglang-mem-fraction to fit")
    p.add_argument("--sglang-mem-fraction", type=float, default=0.3, help="slime-sglang: SGLang's static memory")
    p.add_argument("--train-args", default="",
                   help="more train.py flags for the slime systems, one shell-quoted string appended to each "
                        "command (e.g. \"--attention-kernel cudnn\"); later flags win")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args)
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/grpo_step.py needs CUDA")
    runners = {**{name: functools.partial(run_slime, name=name) for name in SLIME_SYSTEMS}, "trl": run_trl}
    unknown = [name for name in args.systems.split(",") if name not in runners]
    if unknown:
        sys.exit(f"--systems: unknown {unknown}; choose from {', '.join(runners)}")
    if (args.prompts * SAMPLES_PER_PROMPT) % args.micro_batch_size:
        sys.exit(f"--micro-batch-size {args.micro_batch_size} must divide {args.prompts} x {SAMPLES_PER_PROMPT}")
    with tempfile.TemporaryDirectory() as workdir:
        model_dir, data = job_inputs(args, workdir)
        systems, results = args.systems.split(","), {}
        for name in systems:
            results[name] = runners[name](args, model_dir, data, workdir)
            if len(results) < len(systems):  # now, so that a run cut short (a device call's limit) keeps its figures
                print(report(args, {name: results[name]}), flush=True)
    print(report(args, results))


if __name__ == "__main__":
    main()
