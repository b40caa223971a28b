"""The engine contract's LoRA tests (tests/contract/test_lora_api.py) against a real SGLang server on this GPU
(run on the H200): the server started as tests/gpu/test_contract_sglang_gpu.py starts it, plus `--enable-lora
--max-lora-rank 8 --lora-target-modules q_proj v_proj` (the adapters the tests load after start), as
`SGLangEngine` starts it for `--lora-rank` (slime/backends/sglang_utils/sglang_engine.py). Every LoRA test must
pass: a skip of one of them means the server did not report LoRA on."""

from __future__ import annotations

import re

import pytest
import torch

from tests.gpu.sglang_runs import kept_log, sglang_server
from tests.gpu.test_contract_sglang_gpu import SERVER_FLAGS, run_contract
from tests.gpu.test_sglang_train import sglang_startable

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not sglang_startable(), reason="needs sglang importable, or SLIME_SGLANG_LAUNCHER"),
]
LORA_FLAGS = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]


@pytest.mark.timeout(900)
def test_lora_contract_against_real_sglang(tiny_model_dir, tmp_path):
    log = kept_log(tmp_path, "sglang-lora-contract.log")
    with sglang_server(tiny_model_dir, log, *SERVER_FLAGS, *LORA_FLAGS) as url:
        rc, said, summary, _ = run_contract(url, tmp_path, "lora contract vs sglang", "tests/contract/test_lora_api.py")
    assert rc == 0, said[-6000:]
    count = {what: int(n) for n, what in re.findall(r"(\d+) (passed|skipped)", summary)}
    # the seven LoRA tests pass; only the test for a server started without LoRA may skip
    assert count.get("passed", 0) >= 7 and count.get("skipped", 0) <= 1, said[-4000:]
