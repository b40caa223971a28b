"""Generation, one sample and one group at a time: `GenerateState`, `generate`, `generate_and_rm[_group]`, the
sampling params, the /generate request, abort and failure accounting. The training rollout
(`slime.rollout.train_rollout`) and the eval rollout (`slime.rollout.eval_rollout`) are built on it; slime's
plugins reach all of it at slime's path, `slime.rollout.sglang_rollout`.

Generation goes to the router (`--sglang-router-ip` / `--sglang-router-port`, filled in by the RolloutManager
for a router it starts) over SGLang's native `/generate` API; an abort (`/abort_request`) goes to every engine
the router lists (`GET /workers`) directly, because sglang-router does not proxy it.

Choices and simplifications:
- A sample whose generate or reward function raises is marked FAILED (exception text in
  `metadata["error"]`, reward 0.0) and kept in its group; `check_failed_ratio` fails a rollout once more than
  `--max-failed-ratio` of its samples have failed, quoting the first exception.
- The abort flag is per rollout call (a context variable), so an eval running at the same time in the same
  process is not marked aborted by a training rollout finishing (though the engines' `abort_all` still
  hits its in-flight requests).
- A custom generate function that returns several samples for one leaves them side by side in the group
  (slime nests them one level deeper); they share the input's `rollout_id` (else its index).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import inspect
import logging
import re
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import httpx

from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.router import RouterClient, url_of
from slime.rollout.sample_hooks import apply_rollout_sample_hooks, current_rollout_id
from slime.utils.backend_specs import engine_spec
from slime.utils.http_utils import HTTPRequestError, post
from slime.utils.hooks import hooks_of, sample_hook
from slime.utils.misc import SingletonMeta
from slime.utils.image_tokens import collapse_image_runs
from slime.utils.processing_utils import (
    build_processor_kwargs,
    encode_image_for_rollout_engine,
    load_processor,
    load_tokenizer,
)
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

GENERATE_BACKOFF_S = 1.0  # first retry delay of a failed /generate (doubling, capped at 5 s)
_FINISHED = (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
_FINISH_REASONS = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED, "stop": Sample.Status.COMPLETED}

_abort_event: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("slime_rollout_abort", default=None)
_semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[int, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


# --- shared state ---------------------------------------------------------------------------------------


def _aborted() -> bool:
    event = _abort_event.get()
    return event is not None and event.is_set()


def engine_count(args) -> int:
    """Engines behind the router: the external ones, or one per --rollout-num-gpus-per-engine GPUs."""
    if args.rollout_external_engine_addrs:
        return len(args.rollout_external_engine_addrs)
    return max(1, args.rollout_num_gpus // args.rollout_num_gpus_per_engine)


def router_url(args) -> str:
    """The router every /generate goes to: --sglang-router-ip / --sglang-router-port (filled in by the
    RolloutManager for a router it starts, as in slime)."""
    if not args.sglang_router_ip or not args.sglang_router_port:
        raise ValueError("no router address: --sglang-router-ip / --sglang-router-port are unset (the RolloutManager "
                         "fills them in for the router it starts; a rollout function called outside it needs them)")
    return url_of(args.sglang_router_ip, args.sglang_router_port)


def _semaphore(args) -> asyncio.Semaphore:
    """One semaphore per event loop bounding concurrent requests: concurrency per engine x engines."""
    size = args.sglang_server_concurrency * engine_count(args)
    loop = asyncio.get_running_loop()
    entry = _semaphores.get(loop)
    if entry is None or entry[0] != size:
        entry = (size, asyncio.Semaphore(size))
        _semaphores[loop] = entry
    return entry[1]


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str):
    return load_tokenizer(path, trust_remote_code=True)


def get_tokenizer(args):
    if not args.hf_checkpoint:
        raise ValueError("generate needs --hf-checkpoint (its tokenizer turns prompts into input_ids)")
    return _load_tokenizer(args.hf_checkpoint)


@functools.lru_cache(maxsize=4)
def _load_processor(path: str):
    return load_processor(path, trust_remote_code=True)


def get_processor(args):
    """--hf-checkpoint's multimodal processor (None for a text-only model), loaded once per process."""
    return _load_processor(args.hf_checkpoint)


@functools.lru_cache(maxsize=4)
def _vision_markers(path: str) -> tuple[int, int]:
    """A vision-language model's vision start and end token ids (they bound each image's run of image tokens)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    return config.vision_start_token_id, config.vision_end_token_id


def sample_images(sample: Sample) -> list:
    """The sample's images (`Sample.multimodal_inputs["images"]`, read by the dataset), [] for a text sample."""
    media = sample.multimodal_inputs or {}
    return list(media.get("images") or [])


def get_model_url(args, model_name: str, endpoint: str = "/generate") -> str:
    """URL of `endpoint` on the router serving `model_name` (slime's helper for rollouts that address several
    models): `args.sglang_model_routers[model_name]` (ip, port) when a multi-model deployment filled that
    mapping in, else the one router every request goes to."""
    routers = getattr(args, "sglang_model_routers", None) or {}  # only multi-model deployments set it
    if model_name in routers:
        ip, port = routers[model_name]
        return f"{url_of(ip, port)}{endpoint}"
    return f"{router_url(args)}{endpoint}"


def sglang_flag_on(args, field: str) -> bool:
    """Whether a forwarded boolean `--sglang-<field>` flag is on (a bare flag, or true/1/yes/on as text; the
    SGLang launcher checks the value's type against SGLang's ServerArgs)."""
    value = args.sglang_args.get(field)
    return value is True or (isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"))


class GenerateState(metaclass=SingletonMeta):
    """The rollout's per-process state, as slime's plugins reach it: `GenerateState(args)` (one instance per
    process, built from the first args it is given).

    - `tokenizer` and `processor` (of `--hf-checkpoint`; the processor is None for a text-only model);
    - `sampling_params`: the rollout's SGLang sampling parameters (`build_sampling_params`), a fresh copy to
      edit is `dict(state.sampling_params)`;
    - `semaphore`: bounds concurrent requests to `--sglang-server-concurrency` x engines (one per event loop);
    - `aborted`: whether the rollout being generated has been aborted (per rollout call, not process-wide:
      an eval running next to a training rollout is not marked aborted when the training rollout ends);
    - `group_sampling_seeds`: per-sample-of-a-group seeds with `--sglang-enable-deterministic-inference`;
    - `dp_rank_context()`: picks the least busy of the engines' `--sglang-dp-size` data-parallel ranks.
    """

    def __init__(self, args) -> None:
        self.args = args
        self.group_sampling_seeds = [args.rollout_seed + i for i in range(args.n_samples_per_prompt)]
        self.dp_counts = [0] * int(args.sglang_args.get("dp_size") or 1)
        self.dp_rank = 0

    @functools.cached_property
    def sampling_params(self) -> dict[str, Any]:
        """Built on first use (a rollout made only of custom generate functions may set no response limit)."""
        return build_sampling_params(self.args)

    @property
    def tokenizer(self):
        return get_tokenizer(self.args)

    @functools.cached_property
    def processor(self):
        """The multimodal processor of --hf-checkpoint; None for a text-only model."""
        return _load_processor(self.args.hf_checkpoint)

    @property
    def semaphore(self) -> asyncio.Semaphore:
        return _semaphore(self.args)

    @property
    def aborted(self) -> bool:
        return _aborted()

    @aborted.setter
    def aborted(self, value: bool) -> None:
        event = _abort_event.get()
        if event is None:
            if value:  # outside a rollout call there is nothing in flight that the flag could stop
                logger.warning("GenerateState.aborted set outside a rollout call; ignored")
            return
        event.set() if value else event.clear()

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        rank = min(range(len(self.dp_counts)), key=lambda r: (self.dp_counts[r], r))
        self.dp_counts[rank] += 1
        self.dp_rank = rank
        try:
            yield rank
        finally:
            self.dp_counts[rank] -= 1

    def reset(self) -> None:
        """Clear the abort flag of the current rollout call."""
        self.aborted = False


# --- sampling parameters and one request -----------------------------------------------------------------


def build_sampling_params(args, evaluation: bool = False) -> dict[str, Any]:
    """SGLang sampling params from the rollout flags (eval flags override them when `evaluation`)."""

    def pick(name: str, eval_name: str):
        value = getattr(args, eval_name) if evaluation else None
        return getattr(args, name) if value is None else value

    # No response limit: up to the context length (parse_args sets it from the model when it can); `generate`
    # lowers max_new_tokens by the prompt so prompt + response fit.
    max_new_tokens = pick("rollout_max_response_len", "eval_max_response_len")
    if max_new_tokens is None:
        max_new_tokens = args.rollout_max_context_len
    if max_new_tokens is None:
        raise ValueError("set --rollout-max-response-len (the max_new_tokens of every generation) or "
                         "--rollout-max-context-len")
    params = {
        "temperature": pick("rollout_temperature", "eval_temperature"),
        "top_p": pick("rollout_top_p", "eval_top_p"),
        "top_k": pick("rollout_top_k", "eval_top_k"),
        "max_new_tokens": int(max_new_tokens),
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    return {k: v for k, v in params.items() if v is not None}


def prompt_ids(args, prompt: str | list[dict]) -> list[int]:
    """Token ids of a prompt string (no special tokens added), or of chat messages through the chat template."""
    tokenizer = get_tokenizer(args)
    if isinstance(prompt, list):
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


_GENERATE_FIX = (
    "--router-url / the engines must serve SGLang's native /generate API (sglang-router in front of "
    "`sglang.launch_server` or the built-in hf engine)"
)


def _parse_generate_answer(url: str, answer: Any) -> tuple[str, list[int], list[float], Sample.Status, Any]:
    if isinstance(answer, str):  # http_utils hands back the body as text when it is not JSON
        raise ValueError(
            f"{url}: malformed /generate answer: not JSON (body starts {answer[:200]!r}); {_GENERATE_FIX}"
        )
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("output_token_logprobs"), list):
        got = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
        raise ValueError(
            f"{url}: malformed /generate answer: expected meta_info.output_token_logprobs (return_logprob=true), "
            f"got {got}; {_GENERATE_FIX}"
        )
    try:
        tokens = [int(e[1]) for e in meta["output_token_logprobs"]]
        logprobs = [float(e[0]) for e in meta["output_token_logprobs"]]
    except (TypeError, IndexError, ValueError) as e:
        raise ValueError(
            f"{url}: malformed output_token_logprobs entry (expected [logprob, token_id, ...]): {e}"
        ) from e
    reason = meta.get("finish_reason")
    reason_type = reason.get("type") if isinstance(reason, dict) else reason
    status = _FINISH_REASONS.get(reason_type, Sample.Status.COMPLETED)
    return str(answer.get("text") or ""), tokens, logprobs, status, meta.get("weight_version")


def _image_processor(args, sample: Sample):
    processor = _load_processor(args.hf_checkpoint)
    if processor is None:
        raise ValueError(f"sample {sample.index} has images but --hf-checkpoint {args.hf_checkpoint} has no "
                         "multimodal processor; use a vision-language model or drop --multimodal-keys")
    return processor


def image_prompt_text(args, sample: Sample) -> str:
    """The prompt of a sample with images as text, one placeholder per image (a message list through the
    processor's chat template)."""
    prompt = sample.prompt
    if isinstance(prompt, list):
        prompt = _image_processor(args, sample).apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt


def processed_image_prompt(args, sample: Sample) -> tuple[list[int], dict]:
    """A prompt with images through --hf-checkpoint's processor: its ids with each image placeholder expanded to
    the image's tokens, and the processed images (`pixel_values`, `image_grid_thw`). Changes nothing."""
    processor = _image_processor(args, sample)
    out = processor(text=image_prompt_text(args, sample), **build_processor_kwargs({"images": sample_images(sample)}))
    return list(out["input_ids"][0]), {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def image_prompt_ids(args, sample: Sample) -> list[int]:
    """`processed_image_prompt`'s ids; the processed images are kept for training in
    `sample.multimodal_train_inputs`."""
    ids, sample.multimodal_train_inputs = processed_image_prompt(args, sample)
    return ids


def short_image_ids(args, sample: Sample) -> list[int] | None:
    """`sample.tokens` with each of its images' runs of image tokens cut to one (`collapse_image_runs`), or None when
    its image tokens are not one marked run per image of `sample_images(sample)`."""
    image_token = _image_processor(args, sample).image_token_id
    return collapse_image_runs(sample.tokens, image_token, *_vision_markers(args.hf_checkpoint),
                               len(sample_images(sample)))


def image_request(args, sample: Sample) -> tuple[list[str], str | list[int] | None]:
    """What a sample's next /generate carries besides its ids: its images as PNG data URLs (`image_data`; [] for a
    text sample) and the prompt sent instead of the sample's ids (None: the ids themselves).

    A sample with images and no response yet goes as its prompt's text, one placeholder per image (slime's request).
    A sample with images and a response (a partial rollout resumed, a multi-turn rollout's later turn, whose response
    may hold observation images) goes as its ids with each image's run of image tokens cut to one
    (`collapse_image_runs`): SGLang 0.5.16 keeps such ids as sent and expands the k-th image token to image k's
    tokens (its `SGLANG_MM_AVOID_RETOKENIZE`, on by default), which gives back exactly the sample's ids; ids holding
    the expanded runs it would expand a second time. When the policy sampled image tokens itself, the short form
    cannot tell them from the images': the ids go expanded to an engine that takes them (the hf engine), and the
    request is refused for the others, naming the engine."""
    images = sample_images(sample)
    if not images:
        return [], None
    data = [encode_image_for_rollout_engine(image) for image in images]
    if sample.response_length == 0:
        return data, image_prompt_text(args, sample)
    short = short_image_ids(args, sample)
    if short is not None:
        return data, short
    engine = engine_spec(args)
    if engine.takes_expanded_image_ids:
        return data, None
    raise ValueError(
        f"sample {sample.index} has images and a response holding image tokens (id "
        f"{_image_processor(args, sample).image_token_id}) the policy sampled: "
        f"its ids cannot be sent with each image as one image token, and the {engine.name} engine would expand the "
        "images' runs of the full ids a second time; such rollouts need --rollout-backend hf (docs/vlm.md)")


def init_response(args, sample: Sample) -> None:
    """Make `sample` ready to append a response to: the prompt's ids when it has no tokens yet (put into its
    empty token list, which a plugin may hold; through the processor for a prompt with images), empty loss mask
    and log-prob lists when it has none."""
    if not sample.tokens:
        ids = image_prompt_ids(args, sample) if sample_images(sample) else prompt_ids(args, sample.prompt)
        if isinstance(sample.tokens, list):
            sample.tokens.extend(ids)
        else:
            sample.tokens = ids
    if sample.loss_mask is None:
        sample.loss_mask = []
    if sample.rollout_log_probs is None:
        sample.rollout_log_probs = []


def append_model_tokens(
    sample: Sample, token_ids: list[int], log_probs: list[float], text: str = "", weight_version: Any = None
) -> None:
    """Append tokens the policy generated: loss mask 1, their log-probs (`Sample.append_response_tokens` with
    `trainable=True`), and the weight version they came from (per token, and once per call in `weight_versions`)."""
    meta = None if weight_version is None else {"weight_version": weight_version}
    sample.append_response_tokens(tokens=token_ids, log_probs=log_probs, trainable=True, text=text, meta_info=meta)
    if weight_version is not None:
        sample.weight_versions.append(str(weight_version))


_engine_adapter: str | None = None


def set_engine_adapter(name: str | None) -> None:
    """The LoRA adapter the engines hold, named in every /generate from now on (set by the RolloutManager after
    each push; None until the first, when the engines hold none)."""
    global _engine_adapter
    _engine_adapter = name


def complete_generate_body(args, payload: dict) -> dict:
    """A `/generate` body a plugin built itself, as the policy's engines need it (`post` applies this to bodies for
    the policy's router and engines; the RolloutManager sets it up): the LoRA adapter the engines hold named when
    the body names none, and for an engine that expands each image token of `input_ids` to an image's tokens
    (SGLang), ids holding the images' expanded runs (as slime's geo3k_vlm_multi_turn plugin sends them) cut to one
    image token per image. A new dict when something changes, `payload` itself otherwise; our own requests
    (`generate_payload`) need no change."""
    out = payload
    if _engine_adapter is not None and "lora_path" not in payload:
        out = {**out, "lora_path": _engine_adapter}
    engine = engine_spec(args)
    if not engine.takes_expanded_image_ids:
        short = _short_plugin_ids(args, out, engine.name)
        if short is not None:
            out = {**out, "input_ids": short}
    return out


def _short_plugin_ids(args, payload: dict, engine: str) -> list[int] | None:
    images, ids = payload.get("image_data"), payload.get("input_ids")
    if not images or not isinstance(ids, list) or not ids or not isinstance(ids[0], int):
        return None  # no images, text, or a batch (left as sent)
    processor = get_processor(args)
    if processor is None or getattr(processor, "image_token_id", None) is None:
        return None
    num_images, image_token = 1 if isinstance(images, str) else len(images), processor.image_token_id
    count = ids.count(image_token)
    if count <= num_images:
        return None  # one image token per image already (or fewer: the engine answers that itself)
    short = collapse_image_runs(ids, image_token, *_vision_markers(args.hf_checkpoint), num_images)
    if short is None:
        raise ValueError(
            f"a /generate with {num_images} image(s) has input_ids holding {count} image tokens "
            f"(id {image_token}) that are not one run per image between the vision start and end tokens: the "
            f"{engine} engine expands each image token of input_ids to an image's tokens, so it cannot "
            "take these ids; send one image token per image (slime.utils.image_tokens.collapse_image_runs) or use "
            "--rollout-backend hf (docs/vlm.md)")
    return short


def generate_payload(input_ids: list[int], params: dict, image_data: list[str] | None = None,
                     prompt: str | list[int] | None = None) -> dict:
    """The body of a rollout's `/generate`: the prompt, sampling params, log-probs on, the images (data URIs) if
    any, and with LoRA the adapter the engines hold (`lora_path`: SGLang serves a request with the adapter it names,
    the base model without one).

    The prompt is `input_ids`, or `prompt` when given (`image_request`): text with one placeholder per image, or ids
    with each image's run of image tokens cut to one; the server expands the images itself."""
    if prompt is None:
        payload = {"input_ids": list(input_ids)}
    else:
        payload = {"text": prompt} if isinstance(prompt, str) else {"input_ids": list(prompt)}
    payload.update({"sampling_params": params, "return_logprob": True})
    if image_data:
        payload["image_data"] = list(image_data)
    if _engine_adapter is not None:
        payload["lora_path"] = _engine_adapter
    return payload


async def post_generate(args, input_ids: list[int], params: dict, image_data: list[str] | None = None,
                        prompt: str | list[int] | None = None):
    """POST `{router}/generate` for these token ids (or `prompt`, text or short ids from which the server makes
    them: they must be `input_ids`; and images, as data URIs: `image_data`) -> (text, new tokens, their log-probs,
    status, weight version). Retried (60 times under --use-fault-tolerance, else 3) with backoff."""
    url = f"{router_url(args)}/generate"
    payload = generate_payload(input_ids, params, image_data, prompt)
    fault_tolerant = args.use_fault_tolerance
    retries = 60 if fault_tolerant else 3
    try:
        answer = await post(url, payload, retries=retries, backoff=GENERATE_BACKOFF_S)
    except HTTPRequestError as e:
        if e.status_code is not None and e.status_code < 500:
            raise  # the request itself was refused: the message says why
        hint = "see the engine's log for the cause" + (
            "" if fault_tolerant else "; --use-fault-tolerance retries 60 times and restarts engines that die"
        )
        raise HTTPRequestError(url, f"{e}; {hint}", e.status_code, e.response_text) from e
    if prompt is not None:
        check_prompt_tokens(url, answer, len(input_ids))
    return _parse_generate_answer(url, answer)


def check_prompt_tokens(url: str, answer, expected: int) -> None:
    """A prompt whose images the server expanded (sent as text, or as ids with one image token per image): its
    token count (`meta_info.prompt_tokens`) must be the count of the ids the sample trains on, else the response's
    log-probs were computed after another prompt."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    got = meta.get("prompt_tokens") if isinstance(meta, dict) else None
    if got is not None and got != expected:
        raise ValueError(
            f"{url}: the server made {got} prompt tokens of the prompt with images, --hf-checkpoint's processor "
            f"made {expected}: the engine's processor expands the images differently (another image processor "
            "config or min/max pixels?); serve the same model folder as --hf-checkpoint"
        )


def mask_offpolicy(args, sample: Sample) -> None:
    """With --mask-offpolicy-in-partial-rollout, a partial sample about to be continued keeps the tokens an
    earlier rollout (older weights) generated as context only: loss mask 0. Idempotent."""
    resuming = sample.status == Sample.Status.ABORTED and sample.response_length > 0
    if resuming and args.partial_rollout and args.mask_offpolicy_in_partial_rollout:
        if isinstance(sample.loss_mask, list):
            sample.loss_mask[:] = [0] * sample.response_length  # in place: a plugin may hold the list
        else:
            sample.loss_mask = [0] * sample.response_length


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """One /generate call that appends its tokens, text, log-probs and loss mask to `sample`.

    A sample that already has a response (a partial rollout handed back, or an earlier turn) is continued
    from all its tokens, with `max_new_tokens` reduced by what it already generated.
    """
    if _aborted():
        sample.status = Sample.Status.ABORTED
        return sample
    mask_offpolicy(args, sample)
    init_response(args, sample)

    params = dict(sampling_params)
    max_new = int(params["max_new_tokens"]) - sample.response_length
    context_len = args.rollout_max_context_len
    if context_len:
        max_new = min(max_new, int(context_len) - len(sample.tokens))
    if max_new <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    params["max_new_tokens"] = max_new

    images, prompt = image_request(args, sample)
    text, tokens, logprobs, status, weight_version = await post_generate(args, sample.tokens, params, images, prompt)

    append_model_tokens(sample, tokens, logprobs, text, weight_version)
    sample.status = status
    return sample


def sampling_seed(args, sample: Sample, evaluation: bool = False) -> int:
    """The `sampling_seed` of one sample's generation: a 63-bit hash of (`--seed`, the current rollout id, the
    sample's index, train or eval). The engines draw a request's random numbers from its seed alone, so which
    sample gets which random stream does not depend on the order in which requests reach the engine; a sample
    continued in a later rollout (partial rollouts) draws anew. Plugins call the rollout helpers with args objects of
    their own, which may lack `seed`: such a sample is seeded by the rest alone."""
    key = f"{getattr(args, 'seed', None)}:{current_rollout_id()}:{sample.index}:{'eval' if evaluation else 'train'}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


# --- one sample, one group -------------------------------------------------------------------------------


def _mark_failed(sample: Sample, error: BaseException, what: str) -> None:
    sample.status = Sample.Status.FAILED
    sample.reward = 0.0
    sample.metadata = dict(sample.metadata or {})
    sample.metadata["error"] = f"{what}: {type(error).__name__}: {error}"
    logger.warning(
        "sample %s (group %s) failed in %s: %s: %s", sample.index, sample.group_index, what, type(error).__name__, error
    )


async def _reward_one(args, sample: Sample) -> None:
    try:
        sample.reward = await async_rm(args, sample)
    except Exception as e:  # noqa: BLE001 - a bad reward marks this sample; the rollout decides on the ratio
        _mark_failed(sample, e, "reward")


async def generate_and_rm(
    args, sample: Sample, sampling_params: dict, evaluation: bool = False
) -> Sample | list[Sample]:
    """Generate (unless already finished), run the `--rollout-sample-hook-path` hooks, and grade one sample.

    The generate function is the sample's own `generate_function_path` (e.g. from an eval dataset's config),
    else `--custom-generate-function-path`, else `generate`; it gets `evaluation=` when its signature has that
    parameter. It may return several samples for this one (one prompt split into trajectories): they come back
    as a list, every sibling with the same `rollout_id` (the input's, else its index). With `--group-rm` the
    group is graded in `generate_and_rm_group` instead. Errors mark the sample FAILED instead of raising.
    The generate function's sampling params carry the sample's `sampling_seed` (unless they set one), so a
    fixed `--seed` gives a fixed run.
    """
    if sample.status == Sample.Status.FAILED:
        return sample
    mask_offpolicy(args, sample)
    if sample.status in _FINISHED:
        if sample.reward is None and not args.group_rm:
            await _reward_one(args, sample)
        return sample

    state = GenerateState(args)
    path = sample.generate_function_path or args.custom_generate_function_path
    params = dict(sampling_params)
    params.setdefault("sampling_seed", sampling_seed(args, sample, evaluation))
    try:
        async with state.semaphore:
            if state.aborted:
                sample.status = Sample.Status.ABORTED
                return sample
            with state.dp_rank_context():
                result = await _call_generate(_generate_function(args, sample), args, sample, params, evaluation)
        _check_generated(result, sample, path)
        result = await apply_rollout_sample_hooks(args, result, evaluation=evaluation)
        samples = result if isinstance(result, list) else [result]
    except Exception as e:  # noqa: BLE001 - see _mark_failed
        _mark_failed(sample, e, path or "generate")
        return sample

    if not args.group_rm:
        for s in samples:
            if s.status not in (Sample.Status.ABORTED, Sample.Status.FAILED) and s.reward is None:
                await _reward_one(args, s)
    return result


def _generate_function(args, sample: Sample):
    """The sample's own generate function (loaded once per distinct path), else the process's
    --custom-generate-function-path, else None (the default `generate`)."""
    if sample.generate_function_path:
        return sample_hook(sample.generate_function_path, "--custom-generate-function-path",
                           "sample.generate_function_path")
    return hooks_of(args).custom_generate_function


async def _call_generate(fn, args, sample: Sample, params: dict, evaluation: bool):
    if fn is None:
        return await generate(args, sample, params)
    if "evaluation" in inspect.signature(fn).parameters:
        result = fn(args, sample, params, evaluation=evaluation)
    else:
        result = fn(args, sample, params)
    return await result if inspect.isawaitable(result) else result


def _check_generated(result: Any, sample: Sample, path: str | None) -> None:
    """A generate function returned a Sample or a non-empty list of them for `sample`; the siblings of a list
    get one `rollout_id`."""
    samples = result if isinstance(result, list) else [result]
    where = f"--custom-generate-function-path={path}" if path else "generate"
    if not samples or not all(isinstance(s, Sample) for s in samples):
        got = [type(s).__name__ for s in samples] if isinstance(result, list) else type(result).__name__
        raise TypeError(f"{where} returned {got} for sample {sample.index}; return the Sample or a non-empty "
                        "list[Sample]")
    if isinstance(result, list):
        ids = {s.rollout_id for s in samples if s.rollout_id is not None}
        if len(ids) > 1:
            raise ValueError(f"{where} returned {len(samples)} samples for sample {sample.index} with different "
                             f"rollout_id values {sorted(ids)}; samples split from one rollout share one rollout_id")
        shared = ids.pop() if ids else (sample.rollout_id if sample.rollout_id is not None else sample.index)
        for s in samples:
            s.rollout_id = shared


async def generate_and_rm_group(
    args, group: list[Sample], sampling_params: dict, evaluation: bool = False
) -> list[Sample]:
    """All samples of a group concurrently; with --group-rm the group is graded at once afterwards.

    Each sample gets a `session_id` (the routing key of consistent-hashing routers) and, with
    `--sglang-enable-deterministic-inference`, the `sampling_seed` of its place in the group. A custom generate
    function that returns several samples for one makes the group longer (flat, siblings next to each other;
    slime nests them one level deeper). A rollout already aborted returns the group untouched."""
    state = GenerateState(args)
    if state.aborted:
        return group
    deterministic = sglang_flag_on(args, "enable_deterministic_inference")
    tasks = []
    for i, s in enumerate(group):
        if s.session_id is None:
            s.session_id = str(uuid.uuid4())
        params = dict(sampling_params)
        if deterministic:  # the i-th sample of every group draws with the same seed
            params["sampling_seed"] = args.rollout_seed + i
        tasks.append(generate_and_rm(args, s, params, evaluation))
    results = await asyncio.gather(*tasks)
    flat: list[Sample] = []
    for r in results:
        flat.extend(r if isinstance(r, list) else [r])
    if args.group_rm and not any(s.status == Sample.Status.ABORTED for s in flat):
        targets = [s for s in flat if s.status != Sample.Status.FAILED]
        if targets:
            try:
                rewards = await batched_async_rm(args, targets)
            except Exception as e:  # noqa: BLE001 - see _mark_failed
                for s in targets:
                    _mark_failed(s, e, "group reward")
            else:
                for s, r in zip(targets, rewards):
                    s.reward = r
    return flat


# --- failure accounting, abort ---------------------------------------------------------------------------


def check_failed_ratio(args, failed: list[Sample], total: int, where: str) -> None:
    """Raise when more than --max-failed-ratio of `total` samples failed, quoting the first error. When that error
    is the engines' side failing (/generate answered 5xx, e.g. the router's 503 no_available_workers, or not at
    all), the fix points at the engines instead of the generate / reward function: the rollout manager puts the
    failed engine's own report above this error (slime/ray/rollout.py)."""
    ratio = args.max_failed_ratio
    if failed and len(failed) > ratio * total:
        first = failed[0].metadata.get("error", "unknown error")
        if _engine_side(first):
            fix = ("The engines failed to answer /generate: an engine that died or logged an error is named above "
                   "this line by the rollout manager; else see the engine logs ($SLIME_ENGINE_LOG_DIR, by default "
                   "the temp dir's slime_engine_logs/)")
        else:
            fix = "Fix the generate/reward function, or raise --max-failed-ratio to tolerate more failures"
        raise RuntimeError(
            f"{where}: {len(failed)} samples failed, more than --max-failed-ratio={ratio} of {total}; "
            f"first error (sample {failed[0].index}): {first}. {fix}"
        )


def _engine_side(error: str) -> bool:
    """A sample error (`_mark_failed`'s text) of a request the engines did not serve: an HTTPRequestError with a
    5xx answer or none (connection refused, reset, timed out after the retries). A 4xx is the request's fault."""
    return "HTTPRequestError: " in error and not re.search(r"-> HTTP 4\d\d", error)


async def abort_engines(args) -> None:
    """POST /abort_request {"abort_all": true} to every engine the router lists (it does not forward aborts).
    Without a router address there is no engine to abort (a custom generate function that calls none)."""
    if not args.sglang_router_ip:
        return
    router = RouterClient(router_url(args), api_key=args.engine_api_key)
    try:
        urls = await asyncio.to_thread(router.list_workers)
    except (httpx.HTTPError, ValueError) as e:
        logger.warning("abort: cannot list the router's engines (%s); nothing aborted", e)
        return
    finally:
        router.close()  # one client per abort: its connection is not left open
    results = await asyncio.gather(
        *(post(f"{u}/abort_request", {"abort_all": True}, retries=2, timeout=30) for u in urls), return_exceptions=True
    )
    for url, r in zip(urls, results):
        if isinstance(r, BaseException):
            logger.warning("abort on %s failed: %s", url, r)
