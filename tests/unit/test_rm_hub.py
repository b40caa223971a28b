"""Reward hub: each built-in type with closed expectations, the dispatch precedence, remote_rm over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime.rollout.rm_hub import RM_TYPES, async_rm, batched_async_rm, validate_rm_type
from slime.rollout.rm_hub.dapo import dapo_reward
from slime.rollout.rm_hub.f1 import f1_reward, token_f1
from slime.rollout.rm_hub.gpqa import gpqa_reward
from slime.rollout.rm_hub.math_utils import deepscaler_reward, is_equiv, last_boxed_answer, math_reward
from slime.utils.types import Sample
from tests.args import make_args

HERE = __file__


def _args(**kw):
    base = dict(rm_type=None, custom_rm_path=None, group_rm=False, rm_url=None)
    base.update(kw)
    return make_args(validate=False, **base)


def _rm(args, response, label, metadata=None):
    return asyncio.run(async_rm(args, Sample(response=response, label=label, metadata=metadata or {})))


# plugins used through --custom-rm-path / metadata["custom_rm_path"]
async def reward_seven(args, sample):
    return 7.0


def reward_eight(args, sample):  # sync plugins are accepted too
    return 8.0


async def group_reward(args, samples):
    return [float(i) for i in range(len(samples))]


async def group_reward_wrong_length(args, samples):
    return [1.0]


def test_boxed_extraction():
    assert last_boxed_answer(r"first \boxed{1} then \boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert last_boxed_answer(r"\fbox{x^{2}}") == "x^{2}"
    assert last_boxed_answer(r"so \boxed 7$ done") == "7"
    assert last_boxed_answer("no box") is None
    assert last_boxed_answer(r"\boxed{unclosed") is None


@pytest.mark.parametrize(
    "a,b,equal",
    [
        (r"\frac{1}{2}", "0.5", True),
        (r"\dfrac12", r"\frac{1}{2}", True),
        ("1,000", "1000", True),
        ("x = 3", "3", True),
        (r"2\sqrt{2}", r"\sqrt{8}", True),
        (r"x^{2}+1", "1+x^2", True),
        (r"90^\circ", "90", True),
        (r"\text{Paris}", "paris", True),
        ("5", "6", False),
        ("9^9^9^9", "1", False),  # stacked powers are never evaluated
        ("__import__('os')", "0", False),
    ],
)
def test_is_equiv(a, b, equal):
    assert is_equiv(a, b) is equal


def test_math_reward():
    assert math_reward(r"so the answer is \boxed{\frac{1}{2}}.", "0.5") == 1.0
    assert math_reward(r"\boxed{3}", "4") == 0.0
    assert math_reward("4", "4") == 0.0  # no boxed answer, no credit
    assert math_reward(r"\boxed{4}", ["3", "4"]) == 1.0


def test_deepscaler_reward():
    assert deepscaler_reward(r"<think>maybe \boxed{5}</think> so \boxed{4}", "4") == 1.0
    assert deepscaler_reward(r"<think>\boxed{4}</think> \boxed{5}", "4") == 0.0
    assert deepscaler_reward(r"###Response \boxed{4}", "4") == 1.0
    assert deepscaler_reward(r"\boxed{4}", "4") == 0.0  # no </think> nor ###Response


def test_f1_reward():
    assert token_f1("The cat sat", "cat sat on mat") == pytest.approx(2 / 3)
    assert f1_reward("<think>blah</think> the Cat, sat!", ["dog", "cat sat"]) == 1.0
    assert f1_reward("nothing", "cat") == 0.0


def test_dapo_reward():
    assert dapo_reward("work...\nAnswer: $1,000$", "1000") == {"score": 1.0, "acc": True, "pred": "1000"}
    assert dapo_reward("Answer: 7", r"\boxed{8}") == {"score": -1.0, "acc": False, "pred": "7"}
    assert dapo_reward("no final line", "3")["score"] == -1.0
    assert dapo_reward("Answer: 3" + " " * 400, "3")["acc"] is False  # only the last 300 characters count


def test_gpqa_reward():
    assert gpqa_reward("Long thought. The answer is (C).", "C") == 1.0
    assert gpqa_reward(r"\boxed{B}", 1) == 1.0
    assert gpqa_reward("I pick B", 2) == 0.0
    assert gpqa_reward("it is paris", "paris", {"choices": ["rome", "paris", "oslo", "bern"]}) == 1.0


def test_dispatch_builtin_types():
    assert _rm(_args(rm_type="math"), r"\boxed{2}", "2") == 1.0
    assert _rm(_args(rm_type="deepscaler"), r"</think>\boxed{2}", "2") == 1.0
    assert _rm(_args(rm_type="f1"), "a b", "a b") == 1.0
    assert _rm(_args(rm_type="dapo"), "Answer: 2", "2")["score"] == 1.0
    assert _rm(_args(rm_type="gpqa"), "answer: A", "A") == 1.0
    assert _rm(_args(rm_type="toy"), "five is next", "five") == 1.0
    assert _rm(_args(rm_type="toy"), "six", "five") == 0.0
    assert {_rm(_args(rm_type="random"), "", "") for _ in range(40)} == {0.0, 1.0}
    assert _rm(_args(rm_type="boxed_f1"), r"reasoning... \boxed{the cat}", "cat") == 1.0
    assert _rm(_args(rm_type="boxed_f1"), "the cat", "cat") == 0.0
    assert _rm(_args(rm_type="boxed_math"), r"\boxed{2}", "2") == 1.0
    assert RM_TYPES >= {"math", "deepscaler", "f1", "random", "remote_rm", "toy"}


def test_dispatch_precedence():
    # metadata custom_rm_path > --custom-rm-path > metadata rm_type > --rm-type
    args = _args(rm_type="f1", custom_rm_path=f"{HERE}:reward_seven")
    assert _rm(args, "x", "y", {"custom_rm_path": f"{HERE}:reward_eight"}) == 8.0
    assert _rm(args, "x", "y") == 7.0
    assert _rm(_args(rm_type="f1"), r"\boxed{3}", "3", {"rm_type": "math"}) == 1.0
    assert _rm(_args(rm_type="f1"), "x y", "x y") == 1.0
    with pytest.raises(ValueError, match="--rm-type"):
        _rm(_args(), "x", "y")
    with pytest.raises(ValueError, match="not a known reward type"):
        _rm(_args(rm_type="nope"), "x", "y")


def test_validate_rm_type():
    validate_rm_type("boxed_f1")
    validate_rm_type(None)
    with pytest.raises(ValueError, match="--rm-type 'mathh'.*choose one of"):
        validate_rm_type("mathh")


def test_batched_group_rm():
    samples = [Sample(response=str(i)) for i in range(3)]
    args = _args(group_rm=True, custom_rm_path=f"{HERE}:group_reward")
    assert asyncio.run(batched_async_rm(args, samples)) == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="returned 1 values for 3 samples"):
        asyncio.run(batched_async_rm(_args(group_rm=True, custom_rm_path=f"{HERE}:group_reward_wrong_length"), samples))
    # without --group-rm each sample is graded on its own
    per_sample = [Sample(response=r"\boxed{1}", label="1"), Sample(response=r"\boxed{2}", label="1")]
    assert asyncio.run(batched_async_rm(_args(rm_type="math"), per_sample)) == [1.0, 0.0]


class _RewardServer:
    """A scripted reward server: fails the first `fail_first` POSTs with 500, then answers 0.75."""

    def __init__(self, fail_first: int):
        self.payloads: list[dict] = []
        self.fail_first = fail_first
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.payloads.append(body)
                failing = len(outer.payloads) <= outer.fail_first
                data = b"overloaded" if failing else b"0.75"
                self.send_response(500 if failing else 200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/reward"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_remote_rm_retries_then_succeeds():
    server = _RewardServer(fail_first=1)
    try:
        args = _args(rm_type="remote_rm", rm_url=server.url)
        assert _rm(args, "resp", "lab") == 0.75
        assert len(server.payloads) == 2
        assert server.payloads[-1] == {"prompt": "", "response": "resp", "label": "lab"}
        args.rm_retries = 0
        server.fail_first = 10
        with pytest.raises(RuntimeError, match=r"/reward.*HTTP 500: overloaded"):
            _rm(args, "resp", "lab")
    finally:
        server.close()
    with pytest.raises(ValueError, match="--rm-url"):
        _rm(_args(rm_type="remote_rm"), "x", "y")
