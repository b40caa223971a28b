"""check_failed_ratio's fix follows the first error: engines that did not answer /generate (5xx, the router's 503,
a refused connection) point at the engines; a request refused with a 4xx or a raising reward function point at
the generate / reward function."""

from __future__ import annotations

import pytest

from slime.rollout.sglang_rollout import _mark_failed, check_failed_ratio
from slime.utils.http_utils import HTTPRequestError
from slime.utils.types import Sample
from tests.args import make_args

URL = "http://10.0.0.5:29102/generate"
ROUTER_503 = HTTPRequestError(URL, f"POST {URL} failed after 4 attempt(s): HTTP 503: {{\"error\":{{\"code\":"
                                   "\"no_available_workers\"}}; see the engine's log for the cause")
REFUSED = HTTPRequestError(URL, f"POST {URL} failed after 4 attempt(s): ClientConnectorError: Cannot connect to host")
BAD_REQUEST = HTTPRequestError(URL, f"POST {URL} -> HTTP 400: max_new_tokens must be >= 0", 400)


def failed_samples(error: BaseException, what: str = "generate") -> list[Sample]:
    samples = [Sample(index=i, prompt="p") for i in range(2)]
    for s in samples:
        _mark_failed(s, error, what)
    return samples


@pytest.mark.parametrize("error", [ROUTER_503, REFUSED])
def test_engine_side_failures_point_at_the_engines(error):
    with pytest.raises(RuntimeError) as info:
        check_failed_ratio(make_args(), failed_samples(error), 4, "rollout 7")
    text = str(info.value)
    assert text.startswith("rollout 7: 2 samples failed, more than --max-failed-ratio=0.05 of 4; first error (sample "
                           "0): generate: HTTPRequestError: POST ")
    assert "The engines failed to answer /generate: an engine that died or logged an error is named above" in text
    assert "Fix the generate/reward function" not in text


@pytest.mark.parametrize("error,what", [(BAD_REQUEST, "generate"), (KeyError("no such field"), "reward")])
def test_request_and_reward_failures_point_at_the_functions(error, what):
    with pytest.raises(RuntimeError, match="Fix the generate/reward function, or raise --max-failed-ratio") as info:
        check_failed_ratio(make_args(), failed_samples(error, what), 4, "rollout 7")
    assert "engines failed to answer" not in str(info.value)
