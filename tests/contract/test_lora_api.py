"""HTTP contract of an engine's LoRA adapters (SGLang 0.5.16's API: docs/lora.md), against any engine URL.

SGLang serves adapters only when started with `--enable-lora` (and, for adapters loaded after start,
`--max-lora-rank` and `--lora-target-modules` covering them); /server_info reports it as `enable_lora`. Against a
server started without it these tests skip, saying so, and only the refusal test runs. The `hf` engine always
serves adapters. A real SGLang server for this file:

    python -m sglang.launch_server --model-path /models/Qwen3-4B --enable-lora --max-lora-rank 8 \
        --lora-target-modules q_proj v_proj ...
    python -m pytest tests/contract/test_lora_api.py --engine-url http://127.0.0.1:30000 --engine-same-host

The adapters are PEFT folders written under pytest's temporary folder, which the server must be able to read (the
same host, or a shared file system); the tensor test also hands over shared memory (`--engine-same-host`).

Each test unloads what it loaded. Known difference of the `hf` engine (docs/lora.md): it merges one adapter into
its weights, so while one is loaded it serves every request with it, also those naming no `lora_path`; SGLang
serves those with the base model. No test here sends a request without `lora_path` while an adapter is loaded.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from slime.utils.lora_adapter import write_adapter_folder
from slime.weight_sync.tensor_payload import flatten_bucket, serialize_bucket
from tests.contract.test_engine_api import SEQ, get, max_diff, model_tensors, post

pytestmark = pytest.mark.timeout(180)

TARGETS = ("q_proj", "v_proj")
RANK = 4
LORA_REPLY_KEYS = {"success", "error_message", "loaded_adapters"}  # SGLang's LoRAUpdateOutput


def server_info(engine) -> dict:
    return get(engine, "/server_info").json()


@pytest.fixture(scope="module")
def lora_engine(engine):
    """The engine, when it serves LoRA adapters; otherwise the test skips naming the server flags it needs."""
    info = server_info(engine)
    if not info.get("enable_lora"):
        pytest.skip(f"the server at {engine.url} was not started with --enable-lora (/server_info enable_lora = "
                    f"{info.get('enable_lora')!r}); start SGLang with --enable-lora --max-lora-rank {RANK} "
                    f"--lora-target-modules {' '.join(TARGETS)} to run the LoRA tests")
    max_rank = info.get("max_lora_rank")
    if max_rank is not None and int(max_rank) < RANK:
        pytest.skip(f"the server's --max-lora-rank is {max_rank}; these tests load rank-{RANK} adapters")
    return engine


@pytest.fixture(scope="module")
def linears(engine) -> dict[str, tuple[int, int, torch.dtype]]:
    """{module: (in, out, dtype)} of every q_proj / v_proj of the engine's model, from its safetensors."""
    out = {}
    for name, t in model_tensors(engine.model_path).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and t.dim() == 2 and module.rsplit(".", 1)[-1] in TARGETS:
            out[module] = (t.shape[1], t.shape[0], t.dtype)
    if not out:
        pytest.skip(f"{engine.model_path} has no {' / '.join(TARGETS)} linear weights to adapt")
    return out


def adapter_tensors(linears, scale: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A rank-RANK adapter on every target linear: A and B Gaussian times `scale` (B = 0 when scale is 0)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module, (fan_in, fan_out, dtype) in linears.items():
        out[f"{module}.lora_A.weight"] = (torch.randn(RANK, fan_in, generator=gen) * 0.5).to(dtype)
        out[f"{module}.lora_B.weight"] = (torch.randn(fan_out, RANK, generator=gen) * scale).to(dtype)
    return out


def adapter_config(engine) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
            "bias": "none", "target_modules": list(TARGETS), "base_model_name_or_path": engine.model_path}


def adapter_folder(engine, linears, tmp_path, scale: float) -> str:
    path = str(tmp_path / f"adapter-{uuid.uuid4().hex[:8]}")
    write_adapter_folder(adapter_tensors(linears, scale), adapter_config(engine), path)
    return path


def lora_scores(engine, lora_path: str | None) -> list[float]:
    body = {"input_ids": SEQ, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}, "return_logprob": True,
            "logprob_start_len": 0}
    if lora_path is not None:
        body["lora_path"] = lora_path
    out = post(engine, "/generate", body).json()
    return [lp for lp, _, *_ in out["meta_info"]["input_token_logprobs"][1:]]


def load(engine, name: str, path: str, expect=200) -> dict:
    body = post(engine, "/load_lora_adapter", {"lora_name": name, "lora_path": path}, expect=expect).json()
    assert LORA_REPLY_KEYS <= set(body), f"/load_lora_adapter answered {body}"
    return body


def unload(engine, name: str, expect=200) -> dict:
    body = post(engine, "/unload_lora_adapter", {"lora_name": name}, expect=expect).json()
    assert LORA_REPLY_KEYS <= set(body), f"/unload_lora_adapter answered {body}"
    return body


@pytest.fixture(scope="module")
def base_lora_scores(lora_engine):
    return lora_scores(lora_engine, None)


def test_lora_is_refused_by_a_server_started_without_it(engine):
    """SGLang without --enable-lora: loading an adapter or naming one in /generate answers 400."""
    if server_info(engine).get("enable_lora"):
        pytest.skip(f"the server at {engine.url} serves LoRA (enable_lora is set); this checks one that does not")
    body = post(engine, "/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}, expect=400).json()
    assert body["success"] is False and "--enable-lora" in body["error_message"]
    resp = post(engine, "/generate", {"input_ids": SEQ, "sampling_params": {"max_new_tokens": 1},
                                      "lora_path": "x"}, expect=400)
    assert "--enable-lora" in resp.text


def test_load_generate_with_and_unload_an_adapter(lora_engine, linears, base_lora_scores, tmp_path):
    name, path = f"contract-{uuid.uuid4().hex[:8]}", adapter_folder(lora_engine, linears, tmp_path, scale=0.5)
    body = load(lora_engine, name, path)
    try:
        assert body["success"] is True and not body["error_message"]
        assert body["loaded_adapters"].get(name) == path, f"loaded_adapters: {body['loaded_adapters']}"
        with_adapter = lora_scores(lora_engine, name)
        assert max_diff(with_adapter, base_lora_scores) > 1e-3, "a non-zero adapter did not change the log-probs"
        out = post(lora_engine, "/generate", {"input_ids": SEQ[:4], "lora_path": name,
                                              "sampling_params": {"max_new_tokens": 3, "temperature": 0.0,
                                                                  "ignore_eos": True}}).json()
        assert out["meta_info"]["completion_tokens"] == 3
    finally:
        body = unload(lora_engine, name)
    assert body["success"] is True and name not in (body["loaded_adapters"] or {})
    assert max_diff(lora_scores(lora_engine, None), base_lora_scores) <= lora_engine.logprob_tol


def test_a_zero_adapter_scores_as_the_base_model(lora_engine, linears, base_lora_scores, tmp_path):
    name, path = f"contract-{uuid.uuid4().hex[:8]}", adapter_folder(lora_engine, linears, tmp_path, scale=0.0)
    load(lora_engine, name, path)
    try:
        diff = max_diff(lora_scores(lora_engine, name), base_lora_scores)
        assert diff <= lora_engine.logprob_tol, f"an adapter with B = 0 moved the log-probs by {diff}"
    finally:
        unload(lora_engine, name)


def test_generate_naming_an_adapter_never_loaded_is_refused(lora_engine):
    name = f"never-loaded-{uuid.uuid4().hex[:8]}"
    resp = post(lora_engine, "/generate", {"input_ids": SEQ, "sampling_params": {"max_new_tokens": 1},
                                           "lora_path": name}, expect=400)
    assert name in resp.json()["error"]["message"], resp.text


def test_unloading_an_adapter_not_loaded_is_refused(lora_engine):
    name = f"not-loaded-{uuid.uuid4().hex[:8]}"
    body = unload(lora_engine, name, expect=400)
    assert body["success"] is False and name in body["error_message"]


def test_loading_a_name_already_loaded_is_refused(lora_engine, linears, base_lora_scores, tmp_path):
    """SGLang keeps the loaded adapter and refuses the second load (unload it first)."""
    name = f"contract-{uuid.uuid4().hex[:8]}"
    first, second = (adapter_folder(lora_engine, linears, tmp_path, scale) for scale in (0.5, 0.0))
    load(lora_engine, name, first)
    try:
        before = lora_scores(lora_engine, name)
        body = load(lora_engine, name, second, expect=400)
        assert body["success"] is False and "already loaded" in body["error_message"]
        assert max_diff(lora_scores(lora_engine, name), before) <= lora_engine.logprob_tol
    finally:
        unload(lora_engine, name)


def test_loading_a_folder_without_an_adapter_is_refused(lora_engine, base_lora_scores, tmp_path):
    name = f"contract-{uuid.uuid4().hex[:8]}"
    body = load(lora_engine, name, str(tmp_path), expect=400)
    assert body["success"] is False and body["error_message"]
    assert name not in (body["loaded_adapters"] or {})
    assert max_diff(lora_scores(lora_engine, None), base_lora_scores) <= lora_engine.logprob_tol


def test_load_lora_adapter_from_tensors(lora_engine, linears, base_lora_scores):
    """The adapter as one flattened bucket (`load_format: "flattened_bucket"`), as the weight push sends it."""
    if lora_engine.external and not lora_engine.same_host:
        pytest.skip("the tensor path hands over shared memory: pass --engine-same-host for an external engine")
    name = f"contract-{uuid.uuid4().hex[:8]}"
    flat = flatten_bucket(list(adapter_tensors(linears, scale=0.5).items()))
    resp = post(lora_engine, "/load_lora_adapter_from_tensors", {
        "lora_name": name, "config_dict": adapter_config(lora_engine), "serialized_tensors": serialize_bucket(flat),
        "load_format": "flattened_bucket"})
    del flat  # loaded; the shared buffer may go
    body = resp.json()
    try:
        assert LORA_REPLY_KEYS <= set(body) and body["success"] is True
        assert body["loaded_adapters"].get(name) == "__tensor__", f"loaded_adapters: {body['loaded_adapters']}"
        assert max_diff(lora_scores(lora_engine, name), base_lora_scores) > 1e-3
    finally:
        unload(lora_engine, name)
    assert max_diff(lora_scores(lora_engine, None), base_lora_scores) <= lora_engine.logprob_tol
