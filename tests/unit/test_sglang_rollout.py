"""Default rollout functions against a scripted SGLang-shaped HTTP peer (the real engine is tested in e2e).

The peer answers /generate with three tokens ("one two three", log-probs -0.5/-0.25/-0.125, weight version
"7"), fewer with finish_reason "length" when max_new_tokens is smaller. Prompts containing "red" block
until /abort_request, then answer with one token and finish_reason "abort"; "blue" answers "abort" at once;
"fish" gets a malformed answer; "query" a 404; "cat" answers after 0.4 s. (Trigger words are in the tiny
tokenizer's vocabulary: a word outside it is <unk>, and two such words would look the same to the peer.)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from slime.rollout import sglang_rollout
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import (
    build_sampling_params,
    generate,
    generate_and_rm,
    generate_and_rm_group,
    generate_rollout,
    prompt_ids,
    sampling_seed,
)
from slime.rollout.sample_hooks import set_current_rollout_id
from slime.utils.eval_config import EvalDatasetConfig
from slime.utils.http_utils import HTTPRequestError, run_sync
from slime.utils.types import Sample
from tests.args import make_args, router_fields

HERE = __file__
BLOCK_LIMIT_S = 20.0


class ScriptedEngine:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab
        self.requests: list[dict] = []
        self.aborts: list[dict] = []
        self._lock = threading.Lock()
        self._abort = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # the router's worker list: this peer is the only engine
                data = json.dumps({"workers": [{"id": "w0", "url": outer.url}]} if self.path == "/workers"
                                  else {"detail": f"no route {self.path}"}).encode()
                self.send_response(200 if self.path == "/workers" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
                status, answer = outer.answer(self.path, body)
                raw = isinstance(answer, bytes)  # a body that is not JSON, sent as it is
                data = answer if raw else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if raw else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, path: str, body):
        if path == "/abort_request":
            with self._lock:
                self.aborts.append(body)
                event, self._abort = self._abort, threading.Event()
            event.set()
            return 200, {}
        if path != "/generate":
            return 404, {"detail": f"no route {path}"}
        with self._lock:
            self.requests.append(body)
            abort_event = self._abort
        ids = body["input_ids"]
        words = [self.vocab[w] for w in ("one", "two", "three")]
        fresh = words[0] not in ids  # no earlier response tokens in the input
        if self.vocab["fish"] in ids:
            return 200, {"text": "no meta"}
        if self.vocab["query"] in ids:
            return 404, {"detail": "no such model"}
        if self.vocab["red"] in ids and fresh:
            abort_event.wait(BLOCK_LIMIT_S)
            return 200, _answer(words[:1], "abort")
        if self.vocab["cat"] in ids:
            time.sleep(0.4)
        if self.vocab["blue"] in ids and fresh:
            return 200, _answer([], "abort")
        n = min(3, body["sampling_params"]["max_new_tokens"])
        return 200, _answer(words[:n], "stop" if n == 3 else "length")

    def close(self):
        with self._lock:
            self._abort.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _answer(ids: list[int], reason: str) -> dict:
    text = " ".join(["one", "two", "three"][: len(ids)])
    logprobs = [[-0.5 / (2**i), tok, w] for i, (tok, w) in enumerate(zip(ids, text.split()))]
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": reason},
            "output_token_logprobs": logprobs,
            "prompt_tokens": 5,
            "completion_tokens": len(ids),
            "weight_version": "7",
        },
    }


@pytest.fixture(scope="module")
def engine(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    peer = ScriptedEngine(
        {w: tok.convert_tokens_to_ids(w) for w in ("one", "two", "three", "red", "blue", "fish", "cat", "query")}
    )
    yield peer
    peer.close()


def _args(tokenizer_dir, engine, **kw):
    """Parsed args of 2 prompts x 2 samples against the scripted peer as router (`kw` set before validation)."""
    base = dict(hf_checkpoint=tokenizer_dir, **router_fields(engine.url), sglang_server_concurrency=64,
                rollout_max_response_len=8, rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=5,
                rollout_stop_token_ids=[2], rm_type="toy", input_key="prompt", label_key="label", rollout_seed=1)
    return make_args(**{**base, **kw})


def _data(tmp_path, rows):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": lab}) + "\n" for p, lab in rows))
    return str(path)


# --- plugins (loaded by path, so they hold no state of their own) --------------------------------------


@dataclass
class Verdict:
    keep: bool
    reason: str | None = None


def keep_rewarded(args, group):
    """--dynamic-sampling-filter-path: drop groups whose rewards are all zero."""
    return Verdict(keep=any(s.reward for s in group), reason="zero_reward")


def keep_all(args, group):
    return True


async def fail_on_red(args, sample, sampling_params):
    """--custom-generate-function-path without the evaluation parameter."""
    if "red" in sample.prompt:
        raise ValueError(f"boom on {sample.prompt!r}")
    return await generate(args, sample, sampling_params)


async def fan_out(args, sample, sampling_params, evaluation=False):
    """--custom-generate-function-path with the evaluation parameter: two samples per input sample."""
    second = Sample(group_index=sample.group_index, index=sample.index, prompt=sample.prompt, label=sample.label)
    out = [await generate(args, sample, sampling_params), await generate(args, second, sampling_params)]
    for s in out:
        s.metadata["evaluation"] = evaluation
    return out


async def reward_raises(args, sample):
    raise KeyError("no such field")


async def group_scores(args, samples):
    return [10.0 + i for i in range(len(samples))]


# --- generate --------------------------------------------------------------------------------------------


def test_generate_request_accumulation_and_status(tokenizer_dir, engine):
    args = _args(tokenizer_dir, engine, partial_rollout=True, mask_offpolicy_in_partial_rollout=True)
    params = build_sampling_params(args)
    ids = prompt_ids(args, "what comes after two?")
    one, two, three = (engine.vocab[w] for w in ("one", "two", "three"))

    sample = run_sync(generate(args, Sample(prompt="what comes after two?"), params))
    request = engine.requests[-1]
    assert request == {
        "input_ids": ids,
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 8, "stop_token_ids": [2],
                            "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False},
        "return_logprob": True,
    }  # fmt: skip
    assert sample.status == Sample.Status.COMPLETED
    assert sample.tokens == ids + [one, two, three]
    assert (sample.response, sample.response_length) == ("one two three", 3)
    assert sample.loss_mask == [1, 1, 1]
    assert sample.rollout_log_probs == [-0.5, -0.25, -0.125]
    assert sample.weight_versions == ["7"]

    # a partial sample continues from all its tokens with the remaining budget; old tokens masked out
    sample.status = Sample.Status.ABORTED
    run_sync(generate(args, sample, params))
    assert engine.requests[-1]["input_ids"] == ids + [one, two, three]
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 5
    assert sample.response_length == 6 and len(sample.tokens) == len(ids) + 6
    assert sample.loss_mask == [0, 0, 0, 1, 1, 1]
    assert sample.weight_versions == ["7", "7"]

    short = run_sync(
        generate(
            _args(tokenizer_dir, engine, rollout_max_response_len=2),
            Sample(prompt="two"),
            build_sampling_params(_args(tokenizer_dir, engine, rollout_max_response_len=2)),
        )
    )
    assert short.status == Sample.Status.TRUNCATED and short.response_length == 2

    aborted = run_sync(generate(args, Sample(prompt="blue"), params))
    assert aborted.status == Sample.Status.ABORTED and aborted.response_length == 0

    # the context limit caps max_new_tokens; nothing left -> truncated without a request
    n_requests = len(engine.requests)
    ctx_args = _args(tokenizer_dir, engine, rollout_max_context_len=len(ids))
    full = run_sync(generate(ctx_args, Sample(prompt="what comes after two?"), params))
    assert full.status == Sample.Status.TRUNCATED and len(engine.requests) == n_requests


def test_malformed_answer_and_http_errors(tokenizer_dir, engine):
    args = _args(tokenizer_dir, engine)
    params = build_sampling_params(args)
    with pytest.raises(ValueError, match=r"/generate: malformed /generate answer.*got \['text'\]"):
        run_sync(generate(args, Sample(prompt="fish"), params))
    failed = run_sync(generate_and_rm(args, Sample(prompt="fish", label="one"), params))
    assert failed.status == Sample.Status.FAILED and failed.reward == 0.0
    assert "malformed /generate answer" in failed.metadata["error"]
    with pytest.raises(HTTPRequestError, match=r"/generate -> HTTP 404: .*no such model"):
        run_sync(generate(args, Sample(prompt="query"), params))


def test_generate_and_rm_rewards_and_failures(tokenizer_dir, engine):
    args = _args(tokenizer_dir, engine)
    params = build_sampling_params(args)
    good = run_sync(generate_and_rm(args, Sample(prompt="say", label="one"), params))
    assert good.status == Sample.Status.COMPLETED and good.reward == 1.0
    # a finished sample passes through without a request
    n_requests = len(engine.requests)
    assert run_sync(generate_and_rm(args, good, params)) is good and len(engine.requests) == n_requests
    # an aborted sample is not graded
    assert run_sync(generate_and_rm(args, Sample(prompt="blue", label="one"), params)).reward is None
    # a reward function that raises marks the sample FAILED with the exception text
    bad_rm = _args(tokenizer_dir, engine, custom_rm_path=f"{HERE}:reward_raises")
    failed = run_sync(generate_and_rm(bad_rm, Sample(prompt="say", label="one"), params))
    assert failed.status == Sample.Status.FAILED and failed.reward == 0.0
    assert "KeyError" in failed.metadata["error"] and "no such field" in failed.metadata["error"]


def test_each_sample_is_seeded_by_seed_rollout_and_index(tokenizer_dir, engine):
    """A sample's sampling_seed is a function of (--seed, rollout id, index, train/eval) only: the engines draw its
    random numbers from it, whatever order the requests arrive in."""
    args = _args(tokenizer_dir, engine, seed=7)
    sample = Sample(index=3)
    set_current_rollout_id(5)
    try:
        seed = sampling_seed(args, sample)
        assert seed == sampling_seed(_args(tokenizer_dir, engine, seed=7), Sample(index=3)) and 0 <= seed < 2**63
        others = {sampling_seed(args, Sample(index=4)), sampling_seed(_args(tokenizer_dir, engine, seed=8), sample),
                  sampling_seed(args, sample, evaluation=True)}
        set_current_rollout_id(6)  # a partial sample continued in a later rollout draws anew
        others.add(sampling_seed(args, sample))
        assert seed not in others and len(others) == 4

        set_current_rollout_id(5)
        params = build_sampling_params(args)
        # the requests of a group are sent together and reach the engine in any order: seeds are compared per prompt
        group = [Sample(group_index=0, index=i, prompt=f"say {i}", label="one") for i in range(3)]
        run_sync(generate_and_rm_group(args, group, params))
        sent = {tuple(r["input_ids"]): r["sampling_params"]["sampling_seed"] for r in engine.requests[-3:]}
        assert sent == {tuple(s.tokens[:len(s.tokens) - s.response_length]): sampling_seed(args, s) for s in group}
        assert "sampling_seed" not in params
        # slime's --sglang-enable-deterministic-inference: the i-th sample of every group, --rollout-seed + i
        slime_mode = _args(tokenizer_dir, engine, seed=7)
        slime_mode.sglang_args["enable_deterministic_inference"] = True
        pair = [Sample(group_index=1, index=9 + i, prompt=f"say {i}", label="one") for i in range(2)]
        run_sync(generate_and_rm_group(slime_mode, pair, params))
        sent = {tuple(r["input_ids"]): r["sampling_params"]["sampling_seed"] for r in engine.requests[-2:]}
        assert sent == {tuple(s.tokens[:len(s.tokens) - s.response_length]): 1 + i for i, s in enumerate(pair)}
    finally:
        set_current_rollout_id(None)


def test_custom_generate_signature_and_group_rm(tokenizer_dir, engine):
    args = _args(tokenizer_dir, engine, custom_generate_function_path=f"{HERE}:fan_out")
    params = build_sampling_params(args)
    group = [Sample(group_index=0, index=i, prompt="say", label="one") for i in range(2)]
    out = run_sync(generate_and_rm_group(args, group, params, evaluation=True))
    assert len(out) == 4 and all(s.metadata["evaluation"] is True and s.reward == 1.0 for s in out)

    plain = _args(tokenizer_dir, engine, custom_generate_function_path=f"{HERE}:fail_on_red")
    assert run_sync(generate_and_rm(plain, Sample(prompt="say", label="two"), params, evaluation=True)).reward == 0.0

    grouped = _args(tokenizer_dir, engine, group_rm=True, custom_rm_path=f"{HERE}:group_scores")
    group = [Sample(group_index=0, index=i, prompt="say", label="one") for i in range(3)]
    out = run_sync(generate_and_rm_group(grouped, group, params))
    assert [s.reward for s in out] == [10.0, 11.0, 12.0]


# --- generate_rollout ----------------------------------------------------------------------------------


def test_rollout_dynamic_filter_abort_and_partial_buffer(tmp_path, tokenizer_dir, engine):
    # 4 groups in flight; group 1 answers first and is dropped, so group 4 is started in its place; the
    # slower groups 0 and 3 are kept; the blocked group 2 and the late group 4 are left over
    rows = [("cat zero", "one"),   # group 0: reward 1, kept
            ("one", "two"),        # group 1: reward 0, dropped by the filter
            ("red red", "one"),    # group 2: blocks until the abort
            ("cat two", "one"),    # group 3: reward 1, kept
            ("cat five", "one"),   # group 4: reward 1, left over
            ("six", "one")]  # fmt: skip
    args = _args(
        tokenizer_dir,
        engine,
        prompt_data=_data(tmp_path, rows),
        over_sampling_batch_size=4,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
        dynamic_sampling_filter_path=f"{HERE}:keep_rewarded",
    )
    data_source = RolloutDataSourceWithBuffer(args)
    aborts_before = len(engine.aborts)

    output = generate_rollout(args, 0, data_source)
    groups = output.samples

    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    assert [g[0].group_index for g in groups] == sorted(g[0].group_index for g in groups)
    assert all(s.reward == 1.0 and s.status == Sample.Status.COMPLETED for g in groups for s in g)
    assert {g[0].group_index for g in groups} <= {0, 3, 4}
    assert output.metrics["rollout/dynamic_filter/drop_zero_reward"] == 1
    assert engine.aborts[aborts_before:] == [{"abort_all": True}]

    # the blocked group went back to the buffer, partial, tagged with its rollout; it is served first
    buffered = {g[0].group_index: g for g in data_source.buffer}
    assert 2 in buffered
    red = buffered[2]
    assert all(s.status == Sample.Status.ABORTED and s.metadata["start_rollout_id"] == 0 for s in red)
    assert [s.response_length for s in red] == [1, 1]
    buffer_order = [g[0].group_index for g in data_source.buffer]
    assert data_source.get_samples(1)[0][0].group_index == buffer_order[0]

    resumed = run_sync(generate_and_rm_group(args, red, build_sampling_params(args)))
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 7
    for s in resumed:
        assert s.status == Sample.Status.COMPLETED and s.response == "oneone two three" and s.response_length == 4
        assert s.loss_mask == [0, 1, 1, 1]  # the token from the earlier rollout is context only


def test_rollout_without_partial_drops_leftovers(tmp_path, tokenizer_dir, engine):
    rows = [("say", "one"), ("red", "one"), ("say again", "one"), ("count", "one")]
    args = _args(
        tokenizer_dir,
        engine,
        prompt_data=_data(tmp_path, rows),
        over_sampling_batch_size=3,
        rollout_batch_size=1,
        global_batch_size=2,
        dynamic_sampling_filter_path=f"{HERE}:keep_all",
    )
    data_source = RolloutDataSourceWithBuffer(args)
    groups = generate_rollout(args, 5, data_source).samples
    assert len(groups) == 1 and groups[0][0].status == Sample.Status.COMPLETED
    assert data_source.get_buffer_length() == 0
    assert engine.aborts[-1] == {"abort_all": True}


def test_rollout_fails_past_max_failed_ratio(tmp_path, tokenizer_dir, engine):
    rows = [("red fish", "one"), ("say", "one"), ("count", "one"), ("more", "one")]
    common = dict(prompt_data=_data(tmp_path, rows), custom_generate_function_path=f"{HERE}:fail_on_red")
    args = _args(tokenizer_dir, engine, **common)
    with pytest.raises(RuntimeError, match=r"rollout 3: 2 samples failed, more than --max-failed-ratio=0.05 of 4.*"
                                           r"boom on 'red fish'"):  # fmt: skip
        generate_rollout(args, 3, RolloutDataSourceWithBuffer(args))

    tolerant = _args(tokenizer_dir, engine, max_failed_ratio=0.5, **common)
    groups = generate_rollout(tolerant, 3, RolloutDataSourceWithBuffer(tolerant)).samples
    failed = [s for g in groups for s in g if s.status == Sample.Status.FAILED]
    assert len(failed) == 2 and all(s.reward == 0.0 and "boom on" in s.metadata["error"] for s in failed)
    assert sorted(s.group_index for s in failed) == [0, 0]


def test_eval_rollout(tmp_path, tokenizer_dir, engine):
    path = _data(tmp_path, [("say", "one"), ("count", "two")])
    args = _args(tokenizer_dir, engine, eval_prompt_data=["toyset", path], n_samples_per_eval_prompt=2,
                 eval_max_response_len=2, eval_temperature=0.0)
    out = generate_rollout(args, 0, None, evaluation=True).data
    assert list(out) == ["toyset"]
    assert out["toyset"]["rewards"] == [1.0, 1.0, 0.0, 0.0]
    assert out["toyset"]["truncated"] == [True] * 4
    assert engine.requests[-1]["sampling_params"]["temperature"] == 0.0
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 2


def test_eval_config_overrides_per_dataset(tmp_path, tokenizer_dir, engine):
    path = _data(tmp_path, [("say", "one"), ("count", "two")])
    config = tmp_path / "eval.yaml"
    config.write_text(f"""
eval:
  defaults: {{max_response_len: 2}}
  datasets:
    - {{name: greedy, path: {path}, temperature: 0.0, n_samples_per_eval_prompt: 1}}
    - {{name: sampled, path: {path}, temperature: 0.5, n_samples_per_eval_prompt: 3, rm_type: f1, max_response_len: 3}}
""")
    args = _args(tokenizer_dir, engine, eval_config=str(config))
    before = len(engine.requests)
    out = generate_rollout(args, 0, None, evaluation=True).data
    assert list(out) == ["greedy", "sampled"]
    assert len(out["greedy"]["rewards"]) == 2 and len(out["sampled"]["rewards"]) == 6
    assert all(s.metadata.get("rm_type") == "f1" for s in out["sampled"]["samples"])
    assert all("rm_type" not in (s.metadata or {}) for s in out["greedy"]["samples"])
    params = sorted((r["sampling_params"]["temperature"], r["sampling_params"]["max_new_tokens"])
                    for r in engine.requests[before:])
    assert params == [(0.0, 2)] * 2 + [(0.5, 3)] * 6


def test_eval_dataset_settings_reach_prompts_metadata_and_requests(tmp_path, tokenizer_dir, engine):
    """A dataset's own chat-template setting, metadata_overrides (through inject_metadata) and no_stop_trim act;
    eval prompts are cut by --eval-max-prompt-len (templated length), not by --rollout-max-prompt-len."""
    path = _data(tmp_path, [("say", "one"), ("count one two three four", "two")])  # 1 and 5 tokens; templated 6, 10
    config = tmp_path / "eval.yaml"
    config.write_text(f"""
datasets:
  - {{name: chat, path: {path}, apply_chat_template: true, no_stop_trim: false,
      metadata_overrides: {{rm_type: f1, source: chat}}}}
  - {{name: plain, path: {path}, rm_type: toy}}
""")
    args = _args(tokenizer_dir, engine, eval_config=str(config), eval_max_prompt_len=6, rollout_max_prompt_len=2)
    before = len(engine.requests)
    out = generate_rollout(args, 0, None, evaluation=True).data
    (chat,) = out["chat"]["samples"]  # the 10-token templated prompt is over --eval-max-prompt-len 6
    assert chat.prompt.startswith("<|im_start|>user\nsay") and chat.metadata == {"rm_type": "f1", "source": "chat"}
    assert out["chat"]["rewards"] == [pytest.approx(0.5)]  # f1 of "one two three" against "one"
    assert [s.prompt for s in out["plain"]["samples"]] == ["say", "count one two three four"]  # 5 > 2: still kept
    assert out["plain"]["rewards"] == [1.0, 0.0] and all(s.metadata == {"rm_type": "toy"} for s in out["plain"]["samples"])
    assert sorted(r["sampling_params"]["no_stop_trim"] for r in engine.requests[before:]) == [False, True, True]


def test_eval_sampling_params_send_the_datasets_penalty_and_min_new_tokens(tokenizer_dir, engine):
    args = _args(tokenizer_dir, engine, eval_min_new_tokens=4, eval_temperature=0.0)
    params = sglang_rollout.eval_sampling_params(args, EvalDatasetConfig(name="x", path="x.jsonl",
                                                                         repetition_penalty=1.1, top_k=3))
    assert (params["repetition_penalty"], params["min_new_tokens"], params["no_stop_trim"]) == (1.1, 4, True)
    assert (params["temperature"], params["top_k"]) == (0.0, 3)  # the eval flag, the dataset's override
    own = sglang_rollout.eval_sampling_params(args, EvalDatasetConfig(name="x", path="x.jsonl", min_new_tokens=2))
    assert own["min_new_tokens"] == 2 and "repetition_penalty" not in own
    assert "min_new_tokens" not in build_sampling_params(args, evaluation=True)  # the training request's builder
