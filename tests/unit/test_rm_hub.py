"""Reward hub dispatch: which function grades a sample, the boxed_ prefix, batched rewards, remote_rm over HTTP.

The graders themselves are tested in test_rm_graders.py and test_rm_ifbench.py."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime.rollout.rm_hub import RM_TYPES, async_rm, batched_async_rm, remote_rm, validate_rm_type
from slime.utils.types import Sample
from tests.args import make_args

HERE = __file__


def _args(**kw):
    base = dict(rm_type=None, custom_rm_path=None, group_rm=False, rm_url=None)
    base.update(kw)
    return make_args(validate=False, **base)


def _rm(args, response, label, metadata=None):
    return asyncio.run(async_rm(args, Sample(response=response, label=label, metadata=metadata or {})))


# plugins used through --custom-rm-path / sample.custom_rm_path
async def reward_seven(args, sample):
    return 7.0


def reward_eight(args, sample):  # sync plugins are accepted too
    return 8.0


async def group_reward(args, samples):
    return [float(i) for i in range(len(samples))]


async def group_reward_wrong_length(args, samples):
    return [1.0]


def test_dispatch_builtin_types():
    assert _rm(_args(rm_type="math"), r"\boxed{2}", "2") == 1
    assert _rm(_args(rm_type="math"), r"\boxed{4}", ["3", "4"]) == 1  # a list label: any of its answers
    assert _rm(_args(rm_type="deepscaler"), r"</think>\boxed{2}", "2") == 1
    assert _rm(_args(rm_type="f1"), "a b", "a b") == 1.0
    assert _rm(_args(rm_type="f1"), "the Cat, sat!", ["dog", "cat sat"]) == 1.0
    assert _rm(_args(rm_type="f1"), "42", 42) == 1.0  # a number label is compared as text
    assert _rm(_args(rm_type="dapo"), "Answer: 2", "2") == {"score": 1.0, "acc": True, "pred": "2"}
    assert _rm(_args(rm_type="gpqa"), "answer: A", "A") == 1.0
    assert _rm(_args(rm_type="gpqa"), "it is oslo", "C", {"choices": ["rome", "paris", "oslo"]}) == 1.0
    assert _rm(_args(rm_type="ifbench"), "text", None, {}) == 0.0  # no instructions in the metadata
    assert _rm(_args(rm_type="toy"), "five is next", "five") == 1.0
    assert _rm(_args(rm_type="toy"), "six", "five") == 0.0
    assert {_rm(_args(rm_type="random"), "", "") for _ in range(40)} == {0, 1}
    assert _rm(_args(rm_type=" math "), r"\boxed{2}", "2") == 1  # surrounding spaces are ignored
    assert RM_TYPES == {"math", "deepscaler", "dapo", "f1", "gpqa", "ifbench", "random", "remote_rm", "toy"}


def test_boxed_prefix():
    # the last \boxed{} content is graded; "" when there is none
    assert _rm(_args(rm_type="boxed_f1"), r"reasoning... \boxed{the cat}", "cat") == 1.0
    assert _rm(_args(rm_type="boxed_f1"), "the cat", "cat") == 0
    assert _rm(_args(rm_type="boxed_dapo"), "Answer: 7", "7")["score"] == -1.0
    assert _rm(_args(rm_type="boxed_gpqa"), r"A or B? \boxed{B}", "B") == 1.0
    # boxed_math grades the response itself (slime's unboxed answer would have no box left to grade)
    assert _rm(_args(rm_type="boxed_math"), r"\boxed{2}", "2") == 1


def test_dispatch_precedence():
    # sample.custom_rm_path > --custom-rm-path > metadata rm_type > --rm-type
    args = _args(rm_type="f1", custom_rm_path=f"{HERE}:reward_seven")
    sample = Sample(response="x", label="y", custom_rm_path=f"{HERE}:reward_eight")
    assert asyncio.run(async_rm(args, sample)) == 8.0
    assert _rm(args, "x", "y") == 7.0
    assert _rm(_args(rm_type="f1"), r"\boxed{3}", "3", {"rm_type": "math"}) == 1
    assert _rm(_args(rm_type="f1"), "x y", "x y") == 1.0
    with pytest.raises(NotImplementedError, match="no reward type: set --rm-type"):
        _rm(_args(), "x", "y")
    with pytest.raises(NotImplementedError, match="reward type 'nope' is not implemented; choose one of"):
        _rm(_args(rm_type="nope"), "x", "y")


def test_validate_rm_type():
    validate_rm_type("boxed_f1")
    validate_rm_type(None)
    with pytest.raises(ValueError, match="--rm-type 'mathh'.*choose one of"):
        validate_rm_type("mathh")


def test_batched_rm():
    samples = [Sample(response=str(i)) for i in range(3)]
    args = _args(group_rm=True, custom_rm_path=f"{HERE}:group_reward")
    assert asyncio.run(batched_async_rm(args, samples)) == [0.0, 1.0, 2.0]
    # as in slime, a --custom-rm-path function is called with the list whether or not --group-rm is set
    assert asyncio.run(batched_async_rm(_args(custom_rm_path=f"{HERE}:group_reward"), samples)) == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="called with 3 samples .* returned 1 values; it must return one reward per"):
        asyncio.run(batched_async_rm(_args(group_rm=True, custom_rm_path=f"{HERE}:group_reward_wrong_length"), samples))
    # without a custom function each sample is graded on its own
    per_sample = [Sample(response=r"\boxed{1}", label="1"), Sample(response=r"\boxed{2}", label="1")]
    assert asyncio.run(batched_async_rm(_args(rm_type="math"), per_sample)) == [1, 0]


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
        server.fail_first = 10
        with pytest.raises(RuntimeError, match=r"/reward failed after 1 attempt\(s\): HTTP 500: overloaded"):
            asyncio.run(remote_rm(args, Sample(response="resp"), max_retries=1))
    finally:
        server.close()
    with pytest.raises(ValueError, match="--rm-url"):
        _rm(_args(rm_type="remote_rm"), "x", "y")
