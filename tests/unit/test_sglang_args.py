"""`--sglang-<field>` forwarding and the SGLang engine's server arguments.

Two layers: the typing/rendering rules on a ServerArgs-shaped dataclass defined here (always runs), and the
same code against the installed sglang's real `ServerArgs` (runs where `sglang` is importable, e.g. after
`pip install --no-deps sglang==0.5.23 msgspec pybase64 pyzmq triton`; skipped otherwise). The real one is
exercised in a subprocess because importing sglang patches transformers process-wide.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from typing import Annotated, Literal, Optional

import pytest

from slime.backends.sglang_utils import sglang_engine as engine_mod
from slime.backends.sglang_utils.arguments import (
    SGLangArgumentError,
    convert_sglang_args,
    convert_value,
    fields_of,
    sglang_cli_args,
)
from slime.backends.sglang_utils.server_fields import RENAMED_FLAGS, with_cli_options
from slime.backends.hf_engine.engine import HFEngine
from slime.backends.sglang_utils.sglang_engine import SGLangEngine, engine_nnodes
from slime.config.arg_groups import SlimeArgumentError
from slime.config.arg_groups.sglang import validate_sglang
from tests.args import make_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Arg:  # the shape of sglang 0.5.2x's CLI metadata (`Arg(...)` inside `Annotated`)
    def __init__(self, help="", cli_name=None, no_cli=False, choices=None, action=None, type_parser=None):
        self.help, self.cli_name, self.no_cli, self.choices = help, cli_name, no_cli, choices
        self.action, self.type_parser = action, type_parser


@dataclasses.dataclass
class FakeServerArgs:
    model_path: str = ""
    mem_fraction_static: Optional[float] = None  # noqa: UP045 (sglang spells it this way)
    enable_torch_compile: bool = False
    cuda_graph_bs: list[int] | None = None
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    tokenizer_mode: Annotated[str, _Arg(choices=["auto", "slow"])] = "auto"
    json_config: dict | None = None
    fp8_backend: Annotated[str, _Arg(cli_name="--fp8-gemm-backend")] = "auto"
    hidden: Annotated[int, _Arg(no_cli=True)] = 0
    max_prefill_tokens: Annotated[int, _Arg(type_parser=int)] = 16384
    overlap: Annotated[bool | None, _Arg(action=argparse.BooleanOptionalAction)] = None


FIELDS = fields_of(FakeServerArgs)


# ---- flags resolved through SGLang's own option strings ------------------------------------------------------
class DeprecatedStoreTrueAction(argparse.Action):  # named like sglang's own: it stores True, and SGLang warns
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, const=True, default=False, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)


class DeprecatedAliasStoreAction(argparse._StoreAction):  # an old name storing its value in the new field
    pass


@dataclasses.dataclass
class AliasedServerArgs:  # fields as a 0.5.2x ServerArgs declares them; flags below as its add_cli_args adds them
    mem_fraction_static: Optional[float] = None  # noqa: UP045
    tp_size: int = 1
    ep_size: int = 1
    fp8_backend: str = "auto"
    enable_dp_attention: Annotated[bool, _Arg(no_cli=True)] = False  # only its deprecated flag reaches it
    sampling_backend: Annotated[Optional[str], _Arg(no_cli=True)] = None  # noqa: UP045 (a flag added by hand)
    cuda_graph_bs_decode: list[int] | None = None
    schedule_policy: str = "fcfs"
    overlap: bool | None = None
    hidden: Annotated[int, _Arg(no_cli=True)] = 0


def _aliased_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, dest="tp_size")
    p.add_argument("--ep-size", "--expert-parallel-size", "--ep", type=int, dest="ep_size")
    p.add_argument("--fp8-gemm-backend", dest="fp8_backend")
    p.add_argument("--enable-dp-attention", action=DeprecatedStoreTrueAction)
    p.add_argument("--sampling-backend", choices=["pytorch", "flashinfer"])
    p.add_argument("--cuda-graph-bs-decode", type=int, nargs="+")
    p.add_argument("--old-graph-bs", type=int, nargs="+", dest="cuda_graph_bs_decode", action=DeprecatedAliasStoreAction)
    p.add_argument("--schedule-policy")
    p.add_argument("--prefer-lpm", action="store_const", const="lpm", dest="schedule_policy")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction)
    return p


ALIASED = with_cli_options(fields_of(AliasedServerArgs), _aliased_parser()._actions)


def test_flags_resolve_through_sglangs_option_strings():
    """Aliases and deprecated flags set their field; flags whose meaning is their own stay themselves."""
    raw = {"expert_parallel_size": "8", "fp8_gemm_backend": "cutlass", "enable_dp_attention": True,
           "sampling_backend": "pytorch", "old_graph_bs": ["1", "2"], "prefer_lpm": True, "no_overlap": True}
    typed = convert_sglang_args(raw, ALIASED)
    assert typed == {"ep_size": 8, "fp8_backend": "cutlass", "enable_dp_attention": True, "sampling_backend": "pytorch",
                     "cuda_graph_bs_decode": [1, 2], "prefer_lpm": True, "no_overlap": True}
    assert sglang_cli_args(typed, ALIASED) == [
        "--ep-size", "8", "--fp8-gemm-backend", "cutlass", "--enable-dp-attention", "--sampling-backend", "pytorch",
        "--cuda-graph-bs-decode", "1", "2", "--prefer-lpm", "--no-overlap"]
    assert convert_sglang_args({"ep": "4"}, ALIASED) == {"ep_size": 4}
    assert convert_sglang_args({"ep_size": "2", "expert_parallel_size": "2"}, ALIASED) == {"ep_size": 2}
    assert sglang_cli_args({"overlap": False}, ALIASED) == ["--no-overlap"]


@pytest.mark.parametrize("raw, message", [
    ({"ep_size": "8", "expert_parallel_size": "4"},
     "--sglang-expert-parallel-size '4': sets ServerArgs.ep_size, which --sglang-ep-size already sets to 8"),
    ({"sampling_backend": "torch"}, "'torch' is not one of ['pytorch', 'flashinfer']"),
    ({"expert_paralel_size": "8"}, "has no flag --expert-paralel-size; did you mean --sglang-expert-parallel-size"),
    ({"hidden": "1"}, "--sglang-hidden: SGLang offers no command-line flag for 'hidden'"),
])
def test_aliased_flags_refused_with_the_flag_given(raw, message):
    with pytest.raises(SGLangArgumentError) as info:
        convert_sglang_args(raw, ALIASED)
    assert message in str(info.value)


def test_renamed_flags_are_forwarded_under_the_name_sglang_knows(caplog):
    """slime's scripts pass `--sglang-cuda-graph-bs` (SGLang 0.5.15's name); 0.5.16 takes it as a deprecated alias
    of `--cuda-graph-bs-decode`, later releases only the new name; an older one only the old name."""
    with caplog.at_level("INFO", logger="slime.backends.sglang_utils.arguments"):
        assert convert_sglang_args({"cuda_graph_bs": ["1", "2"]}, ALIASED) == {"cuda_graph_bs_decode": [1, 2]}
    assert "--sglang-cuda-graph-bs: forwarded as --cuda-graph-bs-decode" in caplog.text and "0.5.16" in caplog.text
    assert convert_sglang_args({"cuda_graph_bs_decode": [4]}, FIELDS) == {"cuda_graph_bs": [4]}  # FIELDS: old names
    assert "cuda_graph_bs" in RENAMED_FLAGS and "nsa_prefill_backend" in RENAMED_FLAGS


def test_values_are_typed_by_annotation():
    raw = {"mem_fraction_static": "0.7", "enable_torch_compile": True, "cuda_graph_bs": ["1", "2", "4"],
           "schedule_policy": "lpm", "tokenizer_mode": "slow", "json_config": '{"a": 1}', "max_prefill_tokens": "16k",
           "overlap": "false"}
    assert convert_sglang_args(raw, FIELDS) == {
        "mem_fraction_static": 0.7, "enable_torch_compile": True, "cuda_graph_bs": [1, 2, 4], "schedule_policy": "lpm",
        "tokenizer_mode": "slow", "json_config": {"a": 1}, "max_prefill_tokens": "16k", "overlap": False}
    # YAML values arrive typed already
    assert convert_sglang_args({"mem_fraction_static": 0.5, "cuda_graph_bs": [8]}, FIELDS) == {
        "mem_fraction_static": 0.5, "cuda_graph_bs": [8]}
    assert convert_value(Optional[int], "none") is None  # noqa: UP045
    assert convert_value(bool, "yes") is True


@pytest.mark.parametrize("raw, message", [
    ({"mem_fraction_statik": "0.7"}, "did you mean --sglang-mem-fraction-static"),
    ({"mem_fraction_static": "lots"}, "--sglang-mem-fraction-static 'lots': not a valid value"),
    ({"schedule_policy": "random"}, "'random' is not one of ['fcfs', 'lpm']"),
    ({"tokenizer_mode": "fast"}, "'fast' is not one of ['auto', 'slow']"),
    ({"enable_torch_compile": "maybe"}, "expected a boolean"),
    ({"mem_fraction_static": ["0.1", "0.2"]}, "takes one value"),
    ({"mem_fraction_static": True}, "needs a value"),
    ({"hidden": "1"}, "no command-line flag"),
])
def test_bad_forwarded_fields_name_the_flag(raw, message):
    with pytest.raises(SGLangArgumentError) as info:
        convert_sglang_args(raw, FIELDS)
    assert message in str(info.value)
    assert str(info.value).startswith("--sglang-")


def test_cli_rendering():
    values = {"model_path": "/m", "mem_fraction_static": 0.7, "enable_torch_compile": True, "cuda_graph_bs": [1, 2],
              "json_config": {"a": 1}, "fp8_backend": "cutlass", "overlap": False, "mem_saver": False, "seed": None}
    assert sglang_cli_args(values, FIELDS) == [
        "--model-path", "/m", "--mem-fraction-static", "0.7", "--enable-torch-compile", "--cuda-graph-bs", "1", "2",
        "--json-config", '{"a": 1}', "--fp8-gemm-backend", "cutlass", "--no-overlap"]
    # without sglang's fields: by name
    assert sglang_cli_args({"fp8_backend": "x", "overlap": False}) == ["--fp8-backend", "x"]


def _ns(**kw):
    """The parser's args of a GPU run with SGLang engines (not validated: validate_sglang is what runs)."""
    base = {"sglang_server_concurrency": 8, "sglang_router_request_timeout_secs": 10, "rollout_backend": "sglang",
            "use_cuda": True, "debug_train_only": False}
    return make_args(validate=False, **{**base, **kw})


def test_validation_keeps_strings_unless_slime_launches_sglang(monkeypatch):
    # hf engines, external engines, no CUDA: forwarded flags are not used by slime and stay as given,
    # without importing sglang.
    monkeypatch.setattr("slime.backends.sglang_utils.arguments.server_fields", lambda: pytest.fail("imported"))
    for kw in ({"rollout_backend": "hf"}, {"rollout_external_engine_addrs": ["h:1"]}, {"use_cuda": False},
               {"debug_train_only": True}):
        args = _ns(sglang_args={"mem_fraction_static": "0.7"}, **kw)
        validate_sglang(args)
        assert args.sglang_args == {"mem_fraction_static": "0.7"}


def test_validation_types_fields_and_refuses_reserved_ones(monkeypatch):
    monkeypatch.setattr("slime.backends.sglang_utils.arguments.server_fields", lambda: FIELDS)
    args = _ns(sglang_args={"mem_fraction_static": "0.7"})
    validate_sglang(args)
    assert args.sglang_args == {"mem_fraction_static": 0.7}
    with pytest.raises(SlimeArgumentError, match="--sglang-mem-fraction-statik.*did you mean"):
        validate_sglang(_ns(sglang_args={"mem_fraction_statik": "0.7"}))
    with pytest.raises(SlimeArgumentError, match="--sglang-tp-size.*--rollout-num-gpus-per-engine"):
        validate_sglang(_ns(sglang_args={"tp_size": "2"}))
    with pytest.raises(SlimeArgumentError, match=r"--sglang-tensor-parallel-size \(it sets SGLang's tp_size\): "
                                                 r"slime computes.*--rollout-num-gpus-per-engine"):
        monkeypatch.setattr("slime.backends.sglang_utils.arguments.server_fields", lambda: ALIASED)
        validate_sglang(_ns(sglang_args={"tensor_parallel_size": "2"}))
    # sglang not importable: strings stay, the engine refuses to launch later
    monkeypatch.setattr("slime.backends.sglang_utils.arguments.server_fields", lambda: None)
    args = _ns(sglang_args={"anything_at_all": "x"})
    validate_sglang(args)
    assert args.sglang_args == {"anything_at_all": "x"}


def test_cpu_dry_run_warns_about_flags_this_sglang_refuses(monkeypatch, caplog):
    """Planning a GPU run away from the GPUs (--dry-run-cuda): this machine's SGLang need not be the engines', so
    a flag it refuses is a warning there and an error everywhere else."""
    monkeypatch.setattr("slime.backends.sglang_utils.arguments.server_fields", lambda: ALIASED)
    forwarded = {"mem_fraction_static": "0.7", "expert_parallel_size": "8", "only_in_another_release": "1"}
    args = _ns(sglang_args=dict(forwarded), dry_run=True, dry_run_cuda=True)
    with caplog.at_level("WARNING", logger="slime.config.arg_groups.sglang"):
        validate_sglang(args)
    assert args.sglang_args == {"mem_fraction_static": 0.7, "ep_size": 8, "only_in_another_release": "1"}
    assert "--sglang-only-in-another-release: the installed SGLang" in caplog.text
    assert "need not be the engines'" in caplog.text
    with pytest.raises(SlimeArgumentError, match="--sglang-only-in-another-release: the installed SGLang"):
        validate_sglang(_ns(sglang_args=dict(forwarded), dry_run=True))  # a dry run on a GPU node
    with pytest.raises(SlimeArgumentError, match="--sglang-only-in-another-release"):
        validate_sglang(_ns(sglang_args=dict(forwarded)))


_STUBBED_ARGUMENTS = r"""
import sys, types
import slime.backends.sglang_utils as package
assert not [m for m in sys.modules if m.startswith("slime.backends.sglang_utils.")], "the package imported a module"
# what slime's tests/test_megatron_argument_validation.py does: a stub in place of the arguments module
stub = types.ModuleType("slime.backends.sglang_utils.arguments")
stub.sglang_parse_args = lambda *a, **k: None
stub.validate_args = lambda args: args
sys.modules["slime.backends.sglang_utils.arguments"] = stub
import slime.utils.arguments
print("imported", "slime.backends.sglang_utils.sglang_engine" in sys.modules)
"""


def test_the_package_imports_none_of_its_modules():
    """As slime's: importing slime.backends.sglang_utils (or the parser, with its arguments module stubbed) pulls
    neither sglang_engine nor arguments."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", _STUBBED_ARGUMENTS], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["imported", "False"]


# ---- SGLangEngine's server arguments ---------------------------------------------------------------------
def _engine_args(**kw):
    base = {"hf_checkpoint": "/models/qwen", "rollout_num_gpus_per_engine": 2, "num_gpus_per_node": 8, "seed": 100,
            "colocate": False, "offload_rollout": False, "sglang_args": {"mem_fraction_static": 0.7}}
    return make_args(validate=False, **{**base, **kw})


def test_engine_server_args(monkeypatch):
    monkeypatch.setenv("SLIME_SGLANG_LAUNCHER", "sglang serve")
    eng = SGLangEngine(_engine_args(), rank=3)
    values = eng.server_args("127.0.0.1", 30000)
    assert values["model_path"] == "/models/qwen" and values["tp_size"] == 2
    assert (values["host"], values["port"]) == ("127.0.0.1", 30000) and values["nccl_port"] not in (None, 30000)
    assert values["random_seed"] == 103 and values["base_gpu_id"] == 0
    assert values["enable_memory_saver"] is False and values["skip_server_warmup"] and values["trust_remote_code"]
    assert "nnodes" not in values and values["mem_fraction_static"] == 0.7
    cmd = eng.launch_command("127.0.0.1", 30000)
    assert cmd[:2] == ["sglang", "serve"]
    assert cmd[cmd.index("--tp-size") + 1] == "2" and "--enable-memory-saver" not in cmd
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"
    colocated = SGLangEngine(_engine_args(colocate=True, offload_rollout=True), rank=0)
    assert "--enable-memory-saver" in colocated.launch_command("127.0.0.1", 1)


@pytest.mark.parametrize("targets, exclude, modules", [
    ("all-linear", None, ["all"]), ("all-linear", "down_proj", ["all"]),
    ("q_proj,k_proj,v_proj,o_proj", "o_proj", ["q_proj", "k_proj", "v_proj"]),
])
def test_engine_serves_lora_adapters_loaded_after_start(monkeypatch, targets, exclude, modules):
    """SGLang needs --enable-lora, --max-lora-rank and --lora-target-modules to load adapters it was not started
    with; SGLang's `all` covers every module it can adapt (the adapter pushed may cover fewer)."""
    monkeypatch.setenv("SLIME_SGLANG_LAUNCHER", "sglang serve")
    eng = SGLangEngine(_engine_args(lora_rank=16, target_modules=targets, exclude_modules=exclude), rank=0)
    values = eng.server_args("127.0.0.1", 30000)
    assert (values["enable_lora"], values["max_lora_rank"], values["lora_target_modules"]) == (True, 16, modules)
    cmd = eng.launch_command("127.0.0.1", 30000)
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "16"
    at = cmd.index("--lora-target-modules") + 1
    assert cmd[at:at + len(modules)] == modules
    plain = SGLangEngine(_engine_args(), rank=0).launch_command("127.0.0.1", 30000)
    assert not any("lora" in part for part in plain)
    assert "--enable-weights-cpu-backup" not in cmd  # the engines keep their weights: nothing to back up


def test_colocated_lora_engines_keep_the_base_in_host_memory(monkeypatch):
    """A colocated LoRA run's engines release their weights and each push sends only the adapter: SGLang is
    started with --enable-weights-cpu-backup so that a resume brings the base back (without it SGLang's memory
    saver gives the weights back uninitialised); a colocated full-weight run does not need it (every push is
    complete), and a forwarded --sglang-enable-weights-cpu-backup false wins."""
    monkeypatch.setenv("SLIME_SGLANG_LAUNCHER", "sglang serve")
    lora = {"lora_rank": 16, "target_modules": "all-linear"}
    eng = SGLangEngine(_engine_args(colocate=True, offload_rollout=True, **lora), rank=0)
    assert eng.server_args("127.0.0.1", 30000)["enable_weights_cpu_backup"] is True
    cmd = eng.launch_command("127.0.0.1", 30000)
    assert "--enable-weights-cpu-backup" in cmd and "--enable-memory-saver" in cmd and "--enable-lora" in cmd
    full = SGLangEngine(_engine_args(colocate=True, offload_rollout=True), rank=0).launch_command("127.0.0.1", 1)
    assert "--enable-memory-saver" in full and "--enable-weights-cpu-backup" not in full
    off = SGLangEngine(_engine_args(colocate=True, offload_rollout=True, sglang_args={
        "enable_weights_cpu_backup": False}, **lora), rank=0)
    assert off.server_args("127.0.0.1", 30000)["enable_weights_cpu_backup"] is False


def test_engine_resolves_forwarded_flags_against_its_own_sglang(monkeypatch):
    """A driver without sglang hands the flags over as given; the engine resolves them (each rendered once)."""
    monkeypatch.delenv("SLIME_SGLANG_LAUNCHER", raising=False)
    monkeypatch.setattr(SGLangEngine, "launcher_command", lambda self: ["sglang-stand-in"])
    monkeypatch.setattr(engine_mod, "server_fields", lambda: ALIASED)
    args = _engine_args(sglang_args={"expert_parallel_size": "8", "cuda_graph_bs": ["1", "2"]})
    cmd = SGLangEngine(args, rank=0).launch_command("127.0.0.1", 30000)
    assert cmd[cmd.index("--ep-size") + 1] == "8" and cmd.count("--ep-size") == 1
    assert "--expert-parallel-size" not in cmd and "--cuda-graph-bs" not in cmd
    assert cmd[cmd.index("--cuda-graph-bs-decode") + 1:][:2] == ["1", "2"]


def test_engine_gpu_placement(monkeypatch):
    monkeypatch.setattr(engine_mod, "ray_gpu_ids", lambda: [5])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    eng = SGLangEngine(_engine_args(), rank=1)
    assert eng.server_args("127.0.0.1", 1)["base_gpu_id"] == 5
    assert "CUDA_VISIBLE_DEVICES" not in eng.launch_env()  # the server sees the node's GPUs, from id 5 on
    monkeypatch.setattr(engine_mod, "ray_gpu_ids", list)
    assert SGLangEngine(_engine_args(), rank=1).launch_env()["CUDA_VISIBLE_DEVICES"] == "5"


def test_multi_node_engine():
    args = _engine_args(rollout_num_gpus_per_engine=16, num_gpus_per_node=8)
    assert engine_nnodes(args) == 2 and engine_nnodes(_engine_args()) == 1
    head = SGLangEngine(args, rank=0)
    addr = head.get_dist_init_addr()
    assert head.get_dist_init_addr() == addr and ":" in addr
    values = head.server_args("127.0.0.1", 1)
    assert (values["nnodes"], values["node_rank"], values["dist_init_addr"], values["tp_size"]) == (2, 0, addr, 16)
    follower = SGLangEngine(args, rank=0, node_rank=1, dist_init_addr=addr)
    assert follower.server_args("127.0.0.1", 1)["node_rank"] == 1
    assert follower.flush_cache() is None  # control calls go to node rank 0 only
    follower.wait_idle(timeout=0.1)  # node rank 0 waits for the engine: no server of its own is asked
    with pytest.raises(ValueError, match="dist_init_addr"):
        SGLangEngine(args, rank=0, node_rank=1).get_dist_init_addr()
    with pytest.raises(ValueError, match="spans 2 node"):
        SGLangEngine(args, rank=0, node_rank=2)


def test_default_launcher_needs_sglang(monkeypatch):
    monkeypatch.delenv("SLIME_SGLANG_LAUNCHER", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(engine_mod.importlib.util, "find_spec", lambda n, *a: None if n == "sglang" else real(n, *a))
    with pytest.raises(RuntimeError, match=r"sglang package is not installed.*pip install sglang=="):
        SGLangEngine(_engine_args(), rank=0).launch_command("127.0.0.1", 1)


# ---- against the installed sglang's real ServerArgs ----------------------------------------------------------
_REAL_CHECK = r"""
import argparse, json, sys
from tests.unit.test_sglang_args import SCRIPT_FLAGS
from slime.backends.sglang_utils.arguments import (SGLangArgumentError, convert_sglang_args, server_fields,
                                                   sglang_cli_args)
from slime.backends.sglang_utils.sglang_engine import SGLangEngine
from slime.config.arg_groups import SlimeArgumentError
from slime.config.arg_groups.sglang import validate_sglang
from tests.args import make_args
import sglang
from sglang.srt.server_args import ServerArgs

fields = server_fields()
raw = {"mem_fraction_static": "0.7", "context_length": "8192", "enable_torch_compile": True,
       "chunked_prefill_size": "4096", "log_level": "warning", "max_running_requests": "128",
       "disable_radix_cache": True, "attention_backend": "triton", "numa_node": ["0", "1"]}
typed = convert_sglang_args(raw, fields)
errors = []
for bad in ({"mem_fraction_statik": "0.7"}, {"mem_fraction_static": "lots"}, {"tokenizer_mode": "fast"}):
    try:
        convert_sglang_args(bad, fields)
    except SGLangArgumentError as e:
        errors.append(str(e))
ns = make_args(validate=False, sglang_server_concurrency=8, sglang_router_request_timeout_secs=10,
               rollout_backend="sglang", use_cuda=True, debug_train_only=False,
               sglang_args={"mem_fraction_statik": "0.7"})
try:
    validate_sglang(ns)
    errors.append("no error")
except SlimeArgumentError as e:
    errors.append(str(e))
# flags of slime's launch scripts: aliases, deprecated flags, flags added by hand, renamed flags
ns.sglang_args = dict(SCRIPT_FLAGS)
validate_sglang(ns)
scripts = dict(ns.sglang_args)
ns.sglang_args = dict(raw)
validate_sglang(ns)

engine_args = make_args(validate=False, hf_checkpoint="/models/qwen", rollout_num_gpus_per_engine=16,
                        num_gpus_per_node=8, seed=1, colocate=True, offload_rollout=True, sglang_args=ns.sglang_args)
eng = SGLangEngine(engine_args, rank=2)
cmd = eng.launch_command("127.0.0.1", 30000)
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
launch_module = cmd.index("sglang.launch_server")
parsed = vars(parser.parse_args(cmd[launch_module + 1:]))
computed = eng.server_args("127.0.0.1", 30000)
# the raw script flags straight to the engine (a driver without sglang): resolved there, parsed by sglang
engine_args.sglang_args = dict(SCRIPT_FLAGS)
script_cmd = SGLangEngine(engine_args, rank=0).launch_command("127.0.0.1", 30001)
script_parsed = vars(parser.parse_args(script_cmd[launch_module + 1:]))
print(json.dumps({
    "version": sglang.__version__, "num_fields": len(fields), "typed": typed, "validated": ns.sglang_args,
    "errors": errors, "cmd_head": cmd[:launch_module + 1], "scripts": scripts,
    "computed_unknown": sorted(k for k in computed if k not in fields),
    "parsed": {k: parsed[k] for k in list(computed) if k in parsed},
    "expected": {k: v for k, v in computed.items() if k != "nccl_port"},
    "script_parsed": {k: script_parsed[k] for k in scripts},
}))
"""

# As slime's scripts/run-*.sh pass them (kimi-k2-Thinking, qwen3-235B-A22B, qwen3-30B-A3B, glm5, qwen3.5-27B).
SCRIPT_FLAGS = {"enable_dp_attention": True, "dp_size": "8", "expert_parallel_size": "8", "cuda_graph_bs": ["1", "2"],
                "cuda_graph_max_bs": "8", "nsa_prefill_backend": "flashmla_sparse", "nsa_decode_backend": "flashmla_kv",
                "mamba_scheduler_strategy": "extra_buffer", "reasoning_parser": "qwen3", "sampling_backend": "pytorch"}


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="sglang is not installed (pip install --no-deps sglang==0.5.23 msgspec pybase64 pyzmq "
                           "triton makes sglang.srt.server_args importable on CPU)")
@pytest.mark.timeout(240)
def test_forwarding_against_real_server_args():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", _REAL_CHECK], capture_output=True, text=True, env=env, timeout=230,
                          cwd=ROOT, check=False)
    if proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr:
        pytest.skip(f"sglang is installed but sglang.srt.server_args does not import: {proc.stderr[-400:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["num_fields"] > 100
    assert out["typed"] == {"mem_fraction_static": 0.7, "context_length": "8192", "enable_torch_compile": True,
                            "chunked_prefill_size": 4096, "log_level": "warning", "max_running_requests": 128,
                            "disable_radix_cache": True, "attention_backend": "triton", "numa_node": [0, 1]}
    assert out["validated"] == out["typed"]
    did_you_mean, bad_float, bad_choice, validate_error = out["errors"]
    assert "did you mean --sglang-mem-fraction-static" in did_you_mean
    assert "--sglang-mem-fraction-static 'lots'" in bad_float and "'fast' is not one of" in bad_choice
    assert validate_error.startswith("--sglang-mem-fraction-statik: the installed SGLang (0.5.")
    # slime's scripts' flags: each stored under the field it sets in this SGLang (renamed ones under the new name)
    assert out["scripts"] == {"enable_dp_attention": True, "dp_size": 8, "ep_size": 8, "cuda_graph_bs_decode": [1, 2],
                              "cuda_graph_max_bs_decode": 8, "dsa_prefill_backend": "flashmla_sparse",
                              "dsa_decode_backend": "flashmla_kv", "mamba_radix_cache_strategy": "extra_buffer",
                              "reasoning_parser": "qwen3", "sampling_backend": "pytorch"}
    assert out["script_parsed"] == out["scripts"]  # and SGLang's own parser reads them so from our command line
    # every field slime computes is a real ServerArgs field, and sglang's own parser reads our command line
    assert out["computed_unknown"] == []
    assert out["cmd_head"][1:] == ["-m", "sglang.launch_server"]
    parsed, expected = out["parsed"], out["expected"]
    assert parsed["context_length"] == 8192 and parsed["numa_node"] == [0, 1]
    for key, value in expected.items():
        got = str(parsed[key]) if isinstance(value, str) else parsed[key]  # own-parser fields stay strings here
        assert got == value, (key, parsed[key], value)


def test_hf_engine_takes_the_sglang_cuda_graph_flag():
    """`--sglang-disable-cuda-graph` (a bare flag: True; or a typed string) reaches the hf engine's own flag."""
    def command(sglang_args):
        args = make_args(validate=False, hf_checkpoint="/models/tiny", rollout_seed=0, sglang_server_concurrency=8,
                         sglang_args=sglang_args)
        return HFEngine(args, rank=0).launch_command("127.0.0.1", 1)

    assert "--disable-cuda-graph" in command({"disable_cuda_graph": True})
    assert "--disable-cuda-graph" in command({"disable_cuda_graph": "true"})
    assert "--disable-cuda-graph" not in command({"disable_cuda_graph": "false"})
    assert "--disable-cuda-graph" not in command({})
    with pytest.raises(ValueError, match="--sglang-disable-cuda-graph"):
        command({"disable_cuda_graph": "maybe"})
    # no prefix reuse in SGLang: no prompt shared between the hf engine's requests either
    assert "--disable-shared-prefill" in command({"disable_radix_cache": True})
    assert "--disable-shared-prefill" not in command({})
    assert "--disable-overlap-schedule" in command({"disable_overlap_schedule": True})
    assert "--disable-overlap-schedule" not in command({})


def test_a_qwen3_moe_with_dense_layers_is_refused_before_sglang_starts(tmp_path):
    """SGLang 0.5.16 builds every Qwen3-MoE layer as MoE (slime/backends/sglang_utils/model_support.py): a
    checkpoint with dense layers would run with uninitialised experts, so --rollout-backend sglang refuses it at
    parse time; the hf engine serves it; an all-sparse Qwen3-MoE (the releases' layout) passes."""
    from slime.config.arg_groups.rollout import check_hf_checkpoint

    def args_for(backend: str, **layout):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **layout}))
        args = make_args("--rollout-backend", backend, hf_checkpoint=str(tmp_path))
        args.debug_train_only = False  # a run that starts engines (validated as train-only: no data files needed)
        return args

    with pytest.raises(SlimeArgumentError, match=r"mlp_only_layers \[0\], decoder_sparse_step 1.*--rollout-backend hf"):
        check_hf_checkpoint(args_for("sglang", mlp_only_layers=[0], decoder_sparse_step=1))
    with pytest.raises(SlimeArgumentError, match=r"mlp_only_layers \[\], decoder_sparse_step 2"):
        check_hf_checkpoint(args_for("sglang", mlp_only_layers=[], decoder_sparse_step=2))
    check_hf_checkpoint(args_for("hf", mlp_only_layers=[0], decoder_sparse_step=1))
    check_hf_checkpoint(args_for("sglang", mlp_only_layers=[], decoder_sparse_step=1))
