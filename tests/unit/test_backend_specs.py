"""The backend records (slime/utils/backend_specs.py): one per training backend and rollout engine, matching the
classes the runtime registers and the parser's choices; configuration asks them instead of comparing names; the
planner calls the runtime's own rules (reference model, rollout count, placement); --offload-train's one rule."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from slime.config.arg_groups.cluster import offload_train_applies
from slime.config.arguments import SlimeArgumentError, build_parser
from slime.config.plan import report
from slime.config.plan.layout import compute_layout
from slime.ray import loop
from slime.ray.actor_group import CRITIC_BACKENDS, TRAIN_BACKENDS
from slime.ray.rollout import ENGINE_CLASSES
from slime.utils.backend_specs import (
    ENGINE_SPECS,
    EXTERNAL_ENGINES,
    TRAIN_BACKEND_SPECS,
    default_rollout_backend,
    default_train_backend,
    engine_spec,
    train_spec,
)
from slime.utils.placement import engine_node_count
from tests.args import make_args
from tests.conftest import REPO_ROOT


def test_every_registered_backend_has_a_record_and_the_parser_offers_exactly_those():
    assert set(TRAIN_BACKEND_SPECS) == set(TRAIN_BACKENDS)
    assert set(ENGINE_SPECS) == set(ENGINE_CLASSES)
    assert {name for name, spec in TRAIN_BACKEND_SPECS.items() if spec.has_critic} == set(CRITIC_BACKENDS)
    assert all(name == spec.name for name, spec in {**TRAIN_BACKEND_SPECS, **ENGINE_SPECS}.items())
    choices = {a.dest: a.choices for a in build_parser()._actions}
    assert set(choices["train_backend"]) == set(TRAIN_BACKEND_SPECS)
    assert set(choices["rollout_backend"]) == set(ENGINE_SPECS)


def _backend_comparisons(path: str) -> list[str]:
    """`x.train_backend == "..."`-style comparisons (==, !=, in) of a source file, as file:line."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(s, ast.Attribute) and s.attr in ("train_backend", "rollout_backend") for s in sides)
        if named and any(isinstance(s, (ast.Constant, ast.Tuple, ast.List, ast.Set)) and
                         not (isinstance(s, ast.Constant) and s.value is None) for s in sides):
            found.append(f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno}")
    return found


def test_configuration_asks_the_records_instead_of_comparing_backend_names():
    config = os.path.join(REPO_ROOT, "slime", "config")
    paths = [os.path.join(d, f) for d, _, files in os.walk(config) for f in files if f.endswith(".py")]
    found = [hit for path in sorted(paths) for hit in _backend_comparisons(path)]
    assert not found, f"compare a backend by its record (slime/utils/backend_specs.py), not its name: {found}"


def test_the_comparison_finder_finds_comparisons(tmp_path):
    source = tmp_path / "x.py"
    source.write_text('if a.train_backend == "fsdp" or a.rollout_backend in ("hf",) or a.train_backend is None:\n'
                      "    pass\n")
    assert _backend_comparisons(str(source)) == [f"{os.path.relpath(source, REPO_ROOT)}:1"] * 2


def with_engines(tmp_path, *flags: str, **fields):
    """Validated args of a run that launches (or reaches) engines, on a fake HF folder."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    return make_args("--disable-rollout-global-dataset", "--rollout-num-gpus", "1", *flags,
                     hf_checkpoint=str(tmp_path / "model"), debug_train_only=False, **fields)


def test_defaults_and_lookups(tmp_path):
    assert (default_train_backend(True, True), default_train_backend(True, False),
            default_train_backend(False, True)) == ("megatron", "fsdp", "fsdp")
    assert (default_rollout_backend(True), default_rollout_backend(False)) == ("sglang", "hf")
    args = make_args()
    assert (train_spec(args).name, engine_spec(args).name) == ("fsdp", "hf")
    external = with_engines(tmp_path, "--rollout-external-engine-addrs", "127.0.0.1:30000")
    assert engine_spec(external) is EXTERNAL_ENGINES and not EXTERNAL_ENGINES.launched


def test_an_engine_spans_nodes_only_when_its_record_says_so():
    wide = dict(rollout_num_gpus_per_engine=16, num_gpus_per_node=8, rollout_external_engine_addrs=None,
                use_cuda=True)
    assert engine_node_count(make_args(validate=False, rollout_backend="sglang", **wide)) == 2
    assert engine_node_count(make_args(validate=False, rollout_backend="hf", **wide)) == 1


def test_the_planner_lays_out_engines_with_the_runtime_node_count(tmp_path):
    args = with_engines(tmp_path, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    layout = compute_layout(args)
    assert [e.nnodes for e in layout.engines] == [engine_node_count(args)] * 2 == [1, 1]
    assert [e.bundles for e in layout.engines] == [[1, 2], [3, 4]]  # after the actor's one bundle


def test_the_planner_calls_the_runtime_rules():
    """One rule each, read by the `--dry-run` planner and by the loop (slime/ray/loop.py)."""
    assert report.needs_reference_model is loop.needs_reference_model
    args = make_args()
    args.num_rollout, args.num_epoch, args.rollout_batch_size = None, 3, 7
    assert loop.num_rollout_of_epochs(args, 50) == 50 // 7 * 3 == 21
    args.prompt_data, args.rollout_global_dataset = None, True
    assert report.resolve_num_rollout(args)[0] is None  # no file to count: resolved when the data source loads


def test_the_parser_and_the_planner_import_without_ray():
    """Flag parsing and the `--dry-run` planner load no Ray: the rules they share with the loop live below it
    (slime's own tests stub `ray` in sys.modules while they import slime.utils.arguments)."""
    code = ("import sys; import slime.utils.arguments, slime.config.plan; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'slime.ray'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_the_planner_counts_rollouts_of_epochs_with_the_runtime_rule(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(f'{{"input": "q{i}"}}\n' for i in range(50)))
    args = make_args()
    args.num_rollout, args.num_epoch, args.rollout_batch_size = None, 3, 7
    args.prompt_data, args.rollout_global_dataset = str(data), True
    n, how = report.resolve_num_rollout(args)
    assert n == loop.num_rollout_of_epochs(args, 50) == 21 and "50 rows" in how


@pytest.mark.parametrize("flags, fields, expected", [
    ((), {}, False),
    (("--offload",), {}, True),
    (("--offload-train",), {}, True),
    (("--offload", "--no-offload-train"), {}, False),
    (("--colocate",), {}, True),
    (("--colocate", "--no-offload-train"), {}, False),
    (("--advantage-estimator", "ppo"), {}, True),
    (("--advantage-estimator", "ppo", "--no-offload-train"), {}, True),  # slime: the critic takes turns
    (("--offload-train",), {"debug_rollout_only": True}, False),
])  # fmt: skip
def test_offload_train_has_one_rule(tmp_path, flags, fields, expected):
    args = with_engines(tmp_path, *flags, **fields)
    assert args.offload_train is expected
    assert offload_train_applies(args) is expected  # idempotent on resolved args
    assert offload_train_applies(args, asynchronous=True) is False  # train_async.py hands nothing over


def test_a_critic_on_a_backend_without_one_names_the_backends_that_have_one():
    with pytest.raises(SlimeArgumentError) as info:
        make_args("--advantage-estimator", "ppo", train_backend="megatron")
    assert "implemented for --train-backend fsdp only; add --train-backend fsdp" in str(info.value)
