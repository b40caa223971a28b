"""`--engine-api-key`: the parser's resolution and refusals, and the pure helpers of the key's path (who gets the
header, what is left open, what a log shows). The real servers and router are walked in
tests/e2e_cpu/test_engine_auth.py."""

from __future__ import annotations

import logging

import pytest

from slime.backends.hf_engine.auth import bearer_matches, is_open
from slime.utils import http_utils
from slime.utils.errors import SlimeArgumentError
from slime.utils.processes import shown_command
from tests.args import make_args


def test_unset_means_no_key():
    assert make_args().engine_api_key is None


def test_a_literal_key_is_kept():
    assert make_args("--engine-api-key", "s3cret-Key_1").engine_api_key == "s3cret-Key_1"


def test_auto_draws_a_fresh_random_key_and_logs_only_its_start(caplog):
    with caplog.at_level(logging.INFO):
        a = make_args("--engine-api-key", "auto").engine_api_key
    b = make_args("--engine-api-key", "auto").engine_api_key
    assert a != "auto" and b != "auto" and a != b
    assert len(a) >= 40 and all(c in "0123456789abcdef" for c in a)  # never a leading '-' (read as a flag)
    assert a[:4] in caplog.text and a not in caplog.text


def test_a_key_starting_with_a_dash_is_refused():
    """The router's and SGLang's command lines pass it as `--api-key KEY`: argparse would take '-x...' for a flag
    (CI saw a drawn `auto` key do this once, before keys were hex)."""
    with pytest.raises(SlimeArgumentError, match="--engine-api-key.*starting with '-'"):
        make_args("--engine-api-key=-s3cret")


@pytest.mark.parametrize("bad", ["", " ", "two words", "key\n"])
def test_an_empty_or_spaced_key_is_refused(bad):
    with pytest.raises(SlimeArgumentError, match="--engine-api-key"):
        make_args("--engine-api-key", bad)


def test_the_forwarded_api_key_flags_are_refused_naming_ours():
    with pytest.raises(SlimeArgumentError, match="--sglang-api-key.*--engine-api-key"):
        make_args("--sglang-api-key", "k")
    with pytest.raises(SlimeArgumentError, match="--router-api-key.*--engine-api-key"):
        make_args("--router-api-key", "k")


def test_bearer_matches_only_the_exact_key():
    assert bearer_matches("Bearer k1", "k1") and bearer_matches("bearer k1", "k1")
    for header in (None, "", "k1", "Bearer", "Bearer k2", "Bearer k1 ", "Basic k1", "Bearer  k1"):
        assert not bearer_matches(header, "k1"), header


def test_open_paths_are_sglangs():
    assert is_open("GET", "/health") and is_open("GET", "/health_generate") and is_open("GET", "/metrics")
    assert is_open("OPTIONS", "/generate")
    for path in ("/generate", "/get_load", "/model_info", "/update_weights_from_tensor", "/nope", "/"):
        assert not is_open("GET", path) and not is_open("POST", path), path


def test_shown_command_hides_the_key():
    cmd = ["python", "-m", "x", "--api-key", "SECRET", "--port", "1", "--api-key=SECRET2"]
    shown = shown_command(cmd)
    assert "SECRET" not in shown and shown == "python -m x --api-key *** --port 1 --api-key=***"


def test_http_utils_sends_the_key_to_trusted_origins_only(monkeypatch):
    monkeypatch.setattr(http_utils, "_engine_origins", set())
    monkeypatch.setattr(http_utils, "_engine_api_key", None)
    http_utils.trust_engine_url("http://10.0.0.5:30000")
    assert http_utils.engine_auth_headers("http://10.0.0.5:30000/generate") == {}  # no key set
    http_utils.set_engine_api_key("K")
    assert http_utils.engine_auth_headers("http://10.0.0.5:30000/generate") == {"Authorization": "Bearer K"}
    assert http_utils.engine_auth_headers("HTTP://10.0.0.5:30000/abort_request") == {"Authorization": "Bearer K"}
    assert http_utils.engine_auth_headers("http://10.0.0.5:30001/generate") == {}  # another port: a reward server
    assert http_utils.engine_auth_headers("http://10.0.0.6:30000/generate") == {}
    assert http_utils.engine_auth_headers("https://10.0.0.5:30000/generate") == {}
    http_utils.set_engine_api_key(None)
    assert http_utils.engine_auth_headers("http://10.0.0.5:30000/generate") == {}


def _engine_args(**kw):
    base = {"hf_checkpoint": "/models/qwen", "rollout_num_gpus_per_engine": 1, "num_gpus_per_node": 8, "seed": 1,
            "colocate": False, "offload_rollout": False}
    return make_args(validate=False, **{**base, **kw})


def test_sglang_servers_get_the_key_and_their_log_hides_it(monkeypatch, tmp_path):
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine

    monkeypatch.setenv("SLIME_SGLANG_LAUNCHER", "false")  # a server that exits at once: only its log is looked at
    monkeypatch.setenv("SLIME_ENGINE_LOG_DIR", str(tmp_path))
    assert "--api-key" not in SGLangEngine(_engine_args(), rank=0).launch_command("127.0.0.1", 30000)
    eng = SGLangEngine(_engine_args(engine_api_key="K3y-value"), rank=0)
    cmd = eng.launch_command("127.0.0.1", 30000)
    assert cmd[cmd.index("--api-key") + 1] == "K3y-value"
    assert eng.auth_headers() == {"Authorization": "Bearer K3y-value"}
    with pytest.raises(RuntimeError) as failed:
        eng.init()
    with open(eng.log_path) as f:
        first = f.readline()
    assert first.startswith("$ false ") and "--api-key ***" in first and "K3y-value" not in first
    assert "K3y-value" not in str(failed.value)


def test_hf_servers_get_the_key_in_their_environment_only(monkeypatch):
    from slime.backends.hf_engine.engine import HFEngine

    monkeypatch.setenv("SLIME_ENGINE_API_KEY", "left-over-from-the-shell")
    keyed = HFEngine(_engine_args(engine_api_key="K3y-value"), rank=0)
    assert keyed.launch_env()["SLIME_ENGINE_API_KEY"] == "K3y-value"
    assert "K3y-value" not in keyed.launch_command("127.0.0.1", 30000)
    # without the flag no key reaches the server, whatever the shell holds: it must not want one slime never sends
    assert "SLIME_ENGINE_API_KEY" not in HFEngine(_engine_args(), rank=0).launch_env()
