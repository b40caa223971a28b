"""Resources: how many training ranks and rollout engines, where they sit, and how they share devices.

Without CUDA the same flags count CPU processes: `--actor-num-gpus-per-node` is the number of CPU training
ranks per node and `--rollout-num-gpus` the number of CPU engine slots, so the placement code is the same.
"""

from __future__ import annotations

import argparse
import json
import logging

from slime.algorithm.estimators import estimator_of
from slime.config.arg_groups._common import fail, require_positive

logger = logging.getLogger(__name__)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "cluster",
        "Training ranks, rollout engines and their placement. Without CUDA, the *-gpus* counts below count "
        "CPU training ranks and CPU engine slots instead of GPUs.",
    )
    g.add_argument("--actor-num-nodes", type=int, default=1, help="Nodes for the training actor.")
    g.add_argument(
        "--actor-num-gpus-per-node",
        type=int,
        default=8,
        help="GPUs per node for the training actor (without CUDA: CPU training ranks per node).",
    )
    g.add_argument(
        "--critic-num-nodes", type=int, default=None, help="Nodes for the PPO critic; always set equal to the actor's."
    )
    g.add_argument(
        "--critic-num-gpus-per-node",
        type=int,
        default=None,
        help="GPUs per node for the PPO critic; always set equal to the actor's (the critic shares its GPUs).",
    )
    g.add_argument(
        "--rollout-num-gpus",
        type=int,
        default=None,
        help="GPUs for the rollout engines (without CUDA: CPU engine slots). With --colocate it defaults to the "
        "actor's GPU count; another count puts the engines on the first N of max(actor, N) GPUs, as slime: fewer "
        "leave some training GPUs without an engine, more give the engines GPUs of their own.",
    )
    g.add_argument(
        "--rollout-num-gpus-per-engine",
        type=int,
        default=1,
        help="GPUs per rollout engine (SGLang tensor parallel size); must divide --rollout-num-gpus.",
    )
    g.add_argument("--num-gpus-per-node", type=int, default=8, help="GPUs per node available to the rollout engines.")
    g.add_argument(
        "--colocate",
        action="store_true",
        help="Training and engines share the same GPUs; turns on --offload-train and --offload-rollout (they take "
        "turns with the memory, docs/colocate.md).",
    )
    g.add_argument("--offload", action="store_true", help="Shorthand for --offload-train --offload-rollout.")
    g.add_argument(
        "--offload-train",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Move the training state (parameters, gradients, optimizer state, frozen reference/teacher copies) to "
        "host memory while the engines generate (on with --colocate or PPO; --no-offload-train keeps it resident).",
    )
    g.add_argument(
        "--offload-rollout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="The engines release their weights, KV cache and CUDA graphs while training runs and take them back "
        "around each weight push (on with --colocate; --no-offload-rollout keeps them resident).",
    )
    g.add_argument(
        "--distributed-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="torch.distributed backend of the training ranks (default: nccl with CUDA, gloo without).",
    )
    g.add_argument("--distributed-timeout-minutes", type=int, default=10, help="Collective timeout of the ranks.")
    g.add_argument(
        "--train-env-vars",
        type=json.loads,
        default="{}",
        help="slime: extra environment variables of every training rank (actor and critic), a JSON object, e.g. "
        "'{\"PYTORCH_CUDA_ALLOC_CONF\": \"expandable_segments:True\"}'.",
    )


def validate_cluster(args: argparse.Namespace) -> None:
    require_positive(
        args, "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine", "num_gpus_per_node"
    )
    require_positive(args, "distributed_timeout_minutes")
    if args.rollout_num_gpus is not None and args.rollout_num_gpus < 0:
        fail(f"--rollout-num-gpus {args.rollout_num_gpus}: must be >= 0 (0: no local engines, external ones only).")

    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if args.use_cuda else "gloo"
    elif args.distributed_backend == "nccl" and not args.use_cuda:
        fail("--distributed-backend nccl needs CUDA, which this machine does not have; use --distributed-backend gloo.")

    check_train_env_vars(args)
    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    external = args.rollout_external_engine_addrs is not None

    if args.debug_rollout_only:
        # No training: engines get the whole allocation, nothing is colocated or offloaded.
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = actor_gpus
        args.colocate = False
        args.offload = False
        args.offload_rollout = False

    if args.offload_rollout is None and (args.offload or args.colocate):
        args.offload_rollout = True  # slime's implication; an explicit --no-offload-rollout stays

    if args.colocate:
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = actor_gpus
        elif 0 < args.rollout_num_gpus != actor_gpus:
            # slime's sizing: max(actor, rollout) devices; the engines take the first --rollout-num-gpus of them
            where = (f"the first {args.rollout_num_gpus} of the actor's {actor_gpus} GPUs (the other "
                     f"{actor_gpus - args.rollout_num_gpus} train only)" if args.rollout_num_gpus < actor_gpus else
                     f"the actor's {actor_gpus} GPUs and {args.rollout_num_gpus - actor_gpus} more of their own "
                     f"(engines there get the weights by broadcast)")  # fmt: skip
            logger.info("--colocate with --rollout-num-gpus %d: the engines sit on %s.", args.rollout_num_gpus, where)

    if args.rollout_num_gpus is None:
        if args.debug_train_only or external:
            args.rollout_num_gpus = 0
        else:
            fail(
                "--rollout-num-gpus is not set: give the number of rollout GPUs (CPU engine slots without CUDA), "
                "e.g. --rollout-num-gpus 8, or use --colocate to share the actor's."
            )

    if args.rollout_num_gpus < args.rollout_num_gpus_per_engine and not (external or args.debug_train_only):
        fail(
            f"--rollout-num-gpus {args.rollout_num_gpus} is smaller than --rollout-num-gpus-per-engine "
            f"{args.rollout_num_gpus_per_engine}: no engine fits; raise the first, lower the second, or point "
            "--rollout-external-engine-addrs at running engines."
        )
    if args.rollout_num_gpus % args.rollout_num_gpus_per_engine != 0:
        fail(
            f"--rollout-num-gpus {args.rollout_num_gpus} is not divisible by --rollout-num-gpus-per-engine "
            f"{args.rollout_num_gpus_per_engine} (each engine takes that many); make it a multiple, e.g. "
            f"{max(1, args.rollout_num_gpus // args.rollout_num_gpus_per_engine) * args.rollout_num_gpus_per_engine}."
        )

    per_engine, per_node = args.rollout_num_gpus_per_engine, args.num_gpus_per_node
    if per_engine > per_node and per_engine % per_node:
        fail(
            f"--rollout-num-gpus-per-engine {per_engine} is wider than a node (--num-gpus-per-node {per_node}), so "
            f"an engine spans whole nodes: make it a multiple of {per_node}, "
            f"e.g. {(per_engine // per_node + 1) * per_node}."
        )

    args.use_critic = estimator_of(args).needs_critic
    # The critic shares the actor's GPUs here (in slime it may have GPUs of its own).
    for dest, actor_value in (("critic_num_nodes", args.actor_num_nodes),
                              ("critic_num_gpus_per_node", args.actor_num_gpus_per_node)):
        given = getattr(args, dest)
        if given is not None and given != actor_value:
            fail(f"--{dest.replace('_', '-')} {given}: the PPO critic runs on the actor's GPUs here, so it must equal "
                 f"the actor's ({actor_value}); drop the flag.")
        setattr(args, dest, actor_value)
    resolve_offload(args)


def check_train_env_vars(args: argparse.Namespace) -> None:
    """--train-env-vars: a JSON object of names to values; values become strings (what a process environment
    holds; Ray refuses anything else)."""
    env = args.train_env_vars
    if not isinstance(env, dict):
        fail(f"--train-env-vars {json.dumps(env)}: must be a JSON object of variable names to values, e.g. "
             "'{\"NCCL_DEBUG\": \"INFO\"}'.")
    bad = [k for k, v in env.items() if not k or "=" in k or isinstance(v, (dict, list)) or v is None]
    if bad:
        fail(f"--train-env-vars: {bad[0]!r}={env[bad[0]]!r} is not an environment variable (a non-empty name "
             "without '=', a string or number value).")
    args.train_env_vars = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in env.items()}


def offload_train_applies(args: argparse.Namespace, asynchronous: bool = False) -> bool:
    """Whether the training state goes to host memory while the engines generate: the one rule of --offload-train.
    Never without training, nor under train_async.py (`asynchronous`: generation overlaps training, so nothing is
    handed over); always with a PPO critic (slime: actor and critic alternate on the same GPUs, so the state is
    offloadable; even over --no-offload-train); else the flag as given, by default on with --colocate or
    --offload. Idempotent: resolved args give the same answer again."""
    if args.debug_rollout_only or asynchronous:
        return False
    if args.use_critic:
        return True
    if args.offload_train is not None:
        return bool(args.offload_train)
    return bool(args.colocate or args.offload)


def resolve_offload(args: argparse.Namespace) -> None:
    """The offload flags resolved (on with --colocate, --offload-train with PPO; an explicit --no-...
    stays), None -> False. The loop hands the GPU memory back and forth accordingly (slime/ray/handoff.py)."""
    args.offload_train = offload_train_applies(args)
    args.offload_rollout = bool(args.offload_rollout)
    args.offload = args.offload_train and args.offload_rollout
    if args.offload_rollout and args.update_weights_interval != 1 and not args.debug_train_only:
        fail(f"--offload-rollout (on with --colocate) with --update-weights-interval {args.update_weights_interval}: "
             "engines that released their weights get them back only through a push (SGLang returns them "
             "uninitialised), so every rollout must push; use --update-weights-interval 1 or --no-offload-rollout.")
