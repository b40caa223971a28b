"""`--engine-api-key` against a real SGLang server on one GPU (run on the H200).

SGLang 0.5.16 started with `--api-key K` answers 401 on every endpoint but OPTIONS, `/health*` and `/metrics*`
without `Authorization: Bearer K` (sglang/srt/utils/auth.py: its admin-optional endpoints, the weight updates and
memory calls among them, take the same key when no admin key is set). The first test holds the server to that for
the endpoints slime calls and checks a refused call changed nothing; the second runs tests/gpu/test_sglang_train.py's
colocated job with `--engine-api-key auto`: every control call, push and generation of slime's then carries the key.
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from tests.gpu.sglang_runs import NO_CUDA_GRAPH, check_policy_moved, check_pushes, flag_value, kept_log, sglang_server
from tests.gpu.test_sglang_train import run_train, sglang_startable, train_cmd

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not sglang_startable(), reason="needs sglang importable, or SLIME_SGLANG_LAUNCHER"),
]

KEY = "gpu-test-key-0123456789"
NUM_ROLLOUT = 3
GENERATE = {"input_ids": [56, 62, 137, 92], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
# (method, path, body) of what slime calls on an engine; each would change it or use it if let through.
GUARDED = [
    ("POST", "/generate", GENERATE),
    ("POST", "/update_weight_version", {"new_version": "hijacked"}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "hijacked"}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [], "weight_version": "hijacked"}),
    ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                            "world_size": 2, "group_name": "x", "backend": "gloo"}),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/resume_memory_occupation", {}),
    ("POST", "/pause_generation", {"mode": "in_place"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/flush_cache", {}),
    ("GET", "/get_load", None),
    ("GET", "/server_info", None),
    ("GET", "/get_weight_version", None),
    ("POST", "/weights_checker", {"action": "snapshot"}),
]


def _call(url: str, method: str, path: str, body, headers: dict) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60, trust_env=False)


@pytest.mark.timeout(600)
def test_sglang_with_a_key_refuses_slimes_calls_without_it(tiny_model_dir, tmp_path):
    # triton attention and pytorch sampling, as the other GPU tests start SGLang: the devpack's sgl_kernel has no
    # FA3 build, the default backend on Hopper.
    with sglang_server(tiny_model_dir, kept_log(tmp_path, "sglang-auth.log"), "--api-key", KEY, "--enable-memory-saver",
                       "--mem-fraction-static", "0.2", "--disable-cuda-graph", "--attention-backend", "triton",
                       "--sampling-backend", "pytorch") as url:
        good = {"Authorization": f"Bearer {KEY}"}

        def weight_version() -> str:  # SGLang 0.5.16 serves it in /model_info (/get_weight_version answers 404)
            return _call(url, "GET", "/model_info", None, good).json()["weight_version"]

        version = weight_version()
        refused = {}
        for method, path, body in GUARDED:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                status = _call(url, method, path, body, headers).status_code
                if status != 401:
                    refused[(path, str(headers))] = status
        assert not refused, f"answered without the right key (want 401): {refused}"
        assert weight_version() == version, "a refused call changed the weight version"
        assert _call(url, "GET", "/health", None, {}).status_code == 200  # liveness stays open, as SGLang documents
        out = _call(url, "POST", "/generate", GENERATE, good)
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 2, out.text[:500]
        # The same call with the key does change it: the check above could see a refused call let through.
        assert _call(url, "POST", "/update_weight_version", {"new_version": "with-key"}, good).status_code == 200
        assert weight_version() == "with-key"
        print(f"\n[sglang auth, endpoints] {len(GUARDED)} endpoints x 3 wrong headers answered 401; "
              f"the weight version stayed {version}; /generate with the key answered")


@pytest.mark.timeout(900)
def test_train_py_with_an_auto_key_against_sglang(tiny_model_dir, toy_data_path, tmp_path):
    out = str(tmp_path)
    tb = os.path.join(out, "tb")
    cmd = flag_value(train_cmd("fsdp", tiny_model_dir, toy_data_path, tb), "--num-rollout", str(NUM_ROLLOUT))
    run_train([*cmd, *NO_CUDA_GRAPH, "--engine-api-key", "auto"], out)
    logs = os.path.join(out, "engine_logs")
    heads = [open(os.path.join(logs, name), errors="replace").readline() for name in sorted(os.listdir(logs))]
    commands = [h for h in heads if "launch_server" in h]  # the router's log lies there too
    assert commands and all("--api-key ***" in c for c in commands), f"a server started without a key: {commands}"
    check_pushes(tb, "sglang auth, train.py", NUM_ROLLOUT)
    check_policy_moved(tb, "sglang auth, train.py")
