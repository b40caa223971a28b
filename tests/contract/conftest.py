"""The engine under test for the HTTP contract suite (tests/contract/test_engine_api.py).

Without options a real `hf` engine server is started for each test file (through `HFEngine`, on the tiny
random-init model) and reaped when that file is done: an engine kept for the whole session would outlive the
contract files and be counted by later tests that check no server of theirs is left (tests/e2e_cpu, e.g. under
`pytest -n 2 --dist loadfile`, which runs these files early in a worker). To check another server of the same
API, e.g. a real SGLang server started by hand:

    python -m pytest tests/contract --engine-url http://127.0.0.1:30000 \
        [--engine-model-path /models/Qwen3-4B] [--trainer-address 10.0.0.5] [--logprob-tol 0.05] \
        [--engine-same-host] [--weight-sync-backend nccl]

`--engine-model-path` (default: the engine's /model_info `model_path`) must be a local HF folder: the
weight tests read parameter names, shapes and values from its safetensors. `--trainer-address` is the
address the engine can reach this process at (it is rank 0 of the broadcast group). The tensor-update
test hands over shared memory, so it runs against an external engine only with `--engine-same-host`.
NCCL refuses two ranks on one GPU, so against an engine on this process's only GPU use
`--weight-sync-backend gloo` (SGLang receives into CUDA tensors over gloo too).

Against a real SGLang server start it with `--enable-memory-saver` (the release/resume tests are about its
memory saver; without it they release nothing) and, for bf16 weights, pass `--logprob-tol 0.05`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx
import pytest

from slime.backends.hf_engine.engine import HFEngine
from tests.args import make_args
from tools.make_tiny_model import VISION_ARCHS


def pytest_addoption(parser):
    g = parser.getgroup("engine contract")
    g.addoption("--engine-url", default=None, help="engine to test (default: start an hf engine)")
    g.addoption("--engine-model-path", default=None, help="local HF folder of the engine's model")
    g.addoption("--trainer-address", default="127.0.0.1", help="address the engine reaches this process at")
    g.addoption("--logprob-tol", type=float, default=1e-4, help="log-prob agreement tolerance")
    g.addoption("--engine-same-host", action="store_true", help="external engine shares this host's memory")
    g.addoption("--weight-sync-backend", default="gloo", choices=["gloo", "nccl"],
                help="backend of the update_weights_from_distributed group")


def pytest_collection_modifyitems(config, items):
    """Against an external engine (--engine-url), tests marked `runs_last` go after every other contract test:
    SGLang 0.5.16 stops serving after the pickle refusal, and the LoRA file would otherwise run after it. The
    in-process hf engine survives it, so a plain run keeps the files' order (and its module-scoped engines)."""
    if _option(config, "engine_url") is None:
        return
    items.sort(key=lambda item: item.get_closest_marker("runs_last") is not None)  # stable: the rest keep order


def _option(config, name, default=None):
    try:
        return config.getoption(name)
    except ValueError:  # this conftest was not loaded at start-up (pytest run from elsewhere)
        return default


@dataclass
class EngineUnderTest:
    url: str
    model_path: str
    external: bool
    trainer_address: str
    logprob_tol: float
    same_host: bool
    weight_sync_backend: str


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory) -> EngineUnderTest:
    config = request.config
    url = _option(config, "--engine-url")
    common = {"trainer_address": _option(config, "--trainer-address", "127.0.0.1"),
              "logprob_tol": _option(config, "--logprob-tol", 1e-4),
              "weight_sync_backend": _option(config, "--weight-sync-backend", "gloo")}
    if url:
        url = url.rstrip("/")
        model_path = _option(config, "--engine-model-path") or httpx.get(
            url + "/model_info", timeout=30, trust_env=False).json()["model_path"]
        yield EngineUnderTest(url, model_path, True, same_host=bool(_option(config, "--engine-same-host")),
                              **common)
        return

    from tools.make_tiny_model import make_tiny_model

    model_path = make_tiny_model(str(tmp_path_factory.mktemp("contract") / "tiny-qwen3"), size="tiny", seed=0)
    os.environ.setdefault("SLIME_ENGINE_LOG_DIR", str(tmp_path_factory.mktemp("engine_logs")))
    # the disk-update test loads from its own tmp_path: allow this session's temporary folders, as a run's
    # --save folder is allowed
    eng = HFEngine(make_args(hf_checkpoint=model_path, rollout_seed=0, sglang_server_concurrency=16,
                             save=str(tmp_path_factory.getbasetemp())), rank=0)
    try:
        yield EngineUnderTest(eng.init(), model_path, False, same_host=True, **common)
    finally:
        eng.shutdown()


def pytest_generate_tests(metafunc):
    """`vision_arch`: each tiny VLM of tools/make_tiny_model.py (VISION_ARCHS) for a local `hf` engine; "external"
    once for --engine-url."""
    if "vision_arch" in metafunc.fixturenames:
        archs = ["external"] if _option(metafunc.config, "engine_url") else VISION_ARCHS
        metafunc.parametrize("vision_arch", archs, scope="module")


@pytest.fixture(scope="module")
def vision_engine(request, vision_arch, tmp_path_factory) -> EngineUnderTest:
    """The engine of the image tests (test_image_api.py): `--engine-url`'s server when it serves a vision-language
    model (its /model_info `has_image_understanding`; skipped otherwise), else an `hf` engine started on the tiny
    model of tools/make_tiny_model.py named by `vision_arch` (Qwen2.5-VL, then Qwen3-VL; `-k qwen2_5_vl` for one)."""
    config = request.config
    common = {"trainer_address": _option(config, "--trainer-address", "127.0.0.1"),
              "logprob_tol": _option(config, "--logprob-tol", 1e-4),
              "weight_sync_backend": _option(config, "--weight-sync-backend", "gloo")}
    url = _option(config, "--engine-url")
    if url:
        url = url.rstrip("/")
        info = httpx.get(url + "/model_info", timeout=30, trust_env=False).json()
        if not info.get("has_image_understanding"):
            pytest.skip(f"{url} serves a text-only model ({info.get('model_path')}): the image tests need a "
                        "vision-language one")
        yield EngineUnderTest(url, _option(config, "--engine-model-path") or info["model_path"], True,
                              same_host=bool(_option(config, "--engine-same-host")), **common)
        return

    from tools.make_tiny_model import make_tiny_model

    model_path = make_tiny_model(str(tmp_path_factory.mktemp("contract") / f"tiny-{vision_arch}"), arch=vision_arch,
                                 size="tiny", seed=0)
    os.environ.setdefault("SLIME_ENGINE_LOG_DIR", str(tmp_path_factory.mktemp("engine_logs")))
    eng = HFEngine(make_args(hf_checkpoint=model_path, rollout_seed=0, sglang_server_concurrency=8), rank=0)
    try:
        yield EngineUnderTest(eng.init(), model_path, False, same_host=True, **common)
    finally:
        eng.shutdown()

