"""Typed contracts that cross process boundaries: `Sample` (rollout side) and `TrainBatch` (rollout → training).

`Sample` has slime's fields, methods and dict form (plugins written for slime build, read and append to it):

- identity: `group_index` (the prompt group), `index` (unique in the rollout), `rollout_id` (the rollout
  execution a training sample came from: several samples split from one execution share it; None means
  "same as index");
- prompt: `prompt` (text or chat messages), `tokens` (prompt + response ids), `multimodal_inputs` (raw media,
  e.g. images, as the engine takes them), `multimodal_train_inputs` / `multimodal_train_input_id` (processed
  media for the trainer), `apply_chat_template_kwargs`;
- response: `response`, `response_length`, `label`, `reward` (float, or a dict with `--reward-key` choosing),
  `loss_mask` and `rollout_log_probs` (one entry per response token), `weight_versions` (one per engine call),
  `token_policy_versions` (one per response token: the weight version that generated it, -1 where unknown, e.g.
  tool tokens or an engine that reports no integer version; a partial rollout resumed over several rollouts
  has one run of versions per segment), `policy_version` (read-only: the oldest integer version the sample was
  generated with, the one its staleness is measured by; None when it has none),
  `rollout_top_p_token_ids` / `rollout_top_p_token_offsets` (the ragged top-p nucleus of each response token:
  token i kept `ids[offsets[i]:offsets[i + 1]]`), `rollout_routed_experts` (MoE routing of the rollout),
  `teacher_log_probs` (on-policy distillation);
- control: `status`, `remove_sample` (drop from training), `metadata`, `generate_function_path` /
  `custom_rm_path` (per-sample overrides of the flags of those names), `train_metadata` (e.g. a per-sample
  loss type), `session_id` (routing key for consistent hashing), `non_generation_time` (seconds spent outside
  generation, e.g. in tools), `spec_info` (speculative decoding counters), `prefix_cache_info` (prompt tokens
  served from the engine's prefix cache).

`to_dict` / `from_dict` carry every attribute, unknown ones included (a newer producer's extra fields reach
an older consumer as attributes). `append_response_tokens` is the one way to extend a response: it keeps
`tokens`, `response_length`, `loss_mask`, `rollout_log_probs` and the top-p spans aligned and reads SGLang's
`meta_info` (finish reason -> status, weight version, cache and speculative counters, routed experts). It extends
the sample's `tokens`, `loss_mask`, `rollout_log_probs`, `token_policy_versions` and `weight_versions` lists in
place (a plugin may hold one and write it back); the top-p and routed-expert tensors are replaced by new ones.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

_TOP_P_IDS_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")
_TOP_P_OFFSETS_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")


def decode_int32_meta_array(meta_info: dict[str, Any], keys: str | Iterable[str]) -> torch.Tensor | None:
    """The first of `keys` present in SGLang's `meta_info`, as a flat int32 CPU tensor: the value may be
    base64 of little-endian int32 (SGLang's wire form), bytes, a tensor, an array or a list. None when absent."""
    for key in (keys,) if isinstance(keys, str) else keys:
        if key in meta_info:
            value = meta_info[key]
            break
    else:
        return None
    if value is None:
        return None
    if isinstance(value, str):
        value = base64.b64decode(value.encode("ascii"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return torch.frombuffer(bytearray(value), dtype=torch.int32)
    if torch.is_tensor(value):
        return value.detach().to(device="cpu", dtype=torch.int32).reshape(-1)
    if hasattr(value, "flags") and not value.flags.writeable:
        value = value.copy()  # torch.as_tensor warns on read-only numpy arrays
    return torch.as_tensor(value, dtype=torch.int32).reshape(-1)


def _int_list(values) -> list[int]:
    if values is None:
        return []
    if torch.is_tensor(values):
        return [int(v) for v in values.detach().cpu().reshape(-1).tolist()]
    return [int(v) for v in values]


def _float_list(values) -> list[float] | None:
    if values is None:
        return None
    if torch.is_tensor(values):
        return [float(v) for v in values.detach().cpu().reshape(-1).tolist()]
    return [float(v) for v in values]


def _extend(held, values: list) -> list:
    """`held` extended by `values`: in place when it is a list, so a caller holding the sample's list (and
    writing it back later) sees the appended entries; a tuple or tensor is copied into a new list."""
    if isinstance(held, list):
        held.extend(values)
        return held
    return (held.detach().cpu().reshape(-1).tolist() if torch.is_tensor(held) else list(held)) + values


def _as_version(value) -> int | None:
    """An engine's weight-version stamp as an int; None for a non-integer one ("default" before any push)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _int32(values, empty: list[int]) -> torch.Tensor:
    return torch.as_tensor(empty if values is None else values, dtype=torch.int32).reshape(-1)


@dataclass
class Sample:
    """One prompt + response (the fields are described in the module docstring)."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        # a recoverable failure (tool call, external API, parsing): the sample may hold partial output
        FAILED = "failed"

    @dataclass
    class SpecInfo:
        """Speculative-decoding counters summed over the engine calls of a sample."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num > 0 else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

        def to_dict(self) -> dict[str, int]:
            return dataclasses.asdict(self)

        @staticmethod
        def from_dict(data: dict) -> Sample.SpecInfo:
            names = {f.name for f in dataclasses.fields(Sample.SpecInfo)}
            return Sample.SpecInfo(**{k: v for k, v in data.items() if k in names})

    @dataclass
    class PrefixCacheInfo:
        """Prompt tokens sent to the engine and how many of them its prefix cache served."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

        def to_dict(self) -> dict[str, int]:
            return dataclasses.asdict(self)

        @staticmethod
        def from_dict(data: dict) -> Sample.PrefixCacheInfo:
            names = {f.name for f in dataclasses.fields(Sample.PrefixCacheInfo)}
            return Sample.PrefixCacheInfo(**{k: v for k, v in data.items() if k in names})

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | torch.Tensor | None = None
    rollout_top_p_token_offsets: list[int] | torch.Tensor | None = None
    rollout_routed_experts: list[list[int]] | torch.Tensor | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
    token_policy_versions: list[int] | None = None  # last: slime's fields keep their positions

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def policy_version(self) -> int | None:
        """The oldest integer weight version the response was generated with (its most off-policy part):
        from `weight_versions`, else from `token_policy_versions`; None when neither holds one (an engine's
        "default" stamp before the first push is not a version)."""
        versions = [v for v in (_as_version(w) for w in self.weight_versions or []) if v is not None]
        if not versions and self.token_policy_versions:
            versions = [int(v) for v in self.token_policy_versions if int(v) >= 0]
        return min(versions) if versions else None

    @property
    def effective_response_length(self) -> int:
        """Response tokens that are trained on (loss mask 1); all of them when there is no mask."""
        return int(sum(self.loss_mask)) if self.loss_mask is not None else self.response_length

    # --- dict form --------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every attribute (unknown ones too), with the status as its string value and the nested counters
        as dicts, plus the derived `policy_version` (for readers of dumps; `from_dict` recomputes it). Shallow:
        lists and tensors are shared with the sample."""
        d = dict(self.__dict__)
        d["policy_version"] = self.policy_version
        d["status"] = self.status.value
        d["spec_info"] = self.spec_info.to_dict()
        d["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return d

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        """The inverse of `to_dict`; keys that are not fields become attributes of the sample, except the derived
        `policy_version` (a producer's value is not kept: it is read from `weight_versions`)."""
        data = dict(data)
        data.pop("policy_version", None)
        data["status"] = Sample.Status(data.get("status", Sample.Status.PENDING.value))
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info") or {})
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(data.get("prefix_cache_info") or {})
        names = {f.name for f in dataclasses.fields(Sample)}
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args) -> Any:
        """slime's: the reward as set, or with a dict reward and `args.reward_key` (--reward-key) its entry; a dict
        reward without a key comes back whole (slime's OPD post-process reads it so). `args` may also be the reward
        key itself (a string or None). `scalar_reward` is the float the trainer uses."""
        reward_key = args if args is None or isinstance(args, str) else args.reward_key
        if reward_key and isinstance(self.reward, dict):
            if reward_key not in self.reward:
                raise ValueError(
                    f"sample {self.index}: --reward-key {reward_key} is not in the reward dict (keys "
                    f"{sorted(self.reward)}); set --reward-key to one of them"
                )
            return self.reward[reward_key]
        return self.reward

    def scalar_reward(self, reward_key: str | None) -> float:
        """The reward to train on (0.0 when unset); a dict reward needs --reward-key to pick the entry."""
        value = self.get_reward_value(reward_key)
        if isinstance(value, dict):
            raise ValueError(
                f"sample {self.index}: reward is a dict with keys {sorted(value)}; "
                "pass --reward-key to choose the scalar to train on"
            )
        return float(value if value is not None else 0.0)

    # --- extending the response ---------------------------------------------------------------------------

    def append_response_tokens(
        self,
        args=None,
        *,
        tokens=None,
        log_probs=None,
        trainable: bool = True,
        meta_info: dict | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens and keep the per-token fields aligned.

        Model tokens: `trainable=True` with their `log_probs` (and SGLang's `meta_info`). Tool / environment
        tokens: `trainable=False`, no log-probs (or all 0.0, the value they get: slime's own multi-turn VLM example
        passes zeros): they get loss mask 0, log-prob 0.0 and empty top-p spans.
        With `meta_info`, its top-p spans and routed experts are merged in; with `update_terminal_info` (the
        default; off for streamed chunks) its `finish_reason` sets the status (length -> TRUNCATED, abort ->
        ABORTED, stop -> COMPLETED, anything else leaves it), `weight_version` is appended, the prefix-cache
        counters are added, and the speculative counters too when `args.sglang_speculative_algorithm` is set.
        The new tokens' `token_policy_versions` entries are `meta_info["weight_version"]` (any chunk, terminal
        or not) when it is an integer, else -1.
        `args` is needed only to decode routed experts (`num_layers`, `moe_router_topk`).
        """
        tokens = _int_list(tokens)
        log_probs = _float_list(log_probs)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"append_response_tokens: {len(log_probs)} log_probs for {len(tokens)} tokens")
        if tokens and trainable and log_probs is None:
            raise ValueError("append_response_tokens: trainable response tokens require rollout log probabilities; "
                             "pass log_probs=..., or trainable=False for tool / environment tokens")  # fmt: skip
        if tokens and not trainable:
            if log_probs is not None and any(lp != 0.0 for lp in log_probs):
                raise ValueError("append_response_tokens: non-trainable response tokens should not pass rollout log "
                                 "probabilities (they get 0.0); drop log_probs or set trainable=True")
            log_probs = [0.0] * len(tokens)

        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:
            self.tokens = _extend(self.tokens, tokens)
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask = _extend(self.loss_mask, [1 if trainable else 0] * len(tokens))
            version = (meta_info or {}).get("weight_version") if trainable else None
            self._stamp_token_versions(before, len(tokens), version)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError(
                        f"append_response_tokens: the sample has {before} response tokens but no rollout_log_probs; "
                        "model tokens cannot be appended with log-probs the earlier ones lack"
                    )
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs = _extend(self.rollout_log_probs, log_probs)

        pad_top_p = bool(tokens and not trainable)
        if meta_info is not None or pad_top_p:
            self._apply_meta_info(args, meta_info or {}, len(tokens), pad_top_p, update_terminal_info)
        self._check_aligned()

    def _stamp_token_versions(self, before: int, new_tokens: int, weight_version: Any) -> None:
        """Give `new_tokens` appended after `before` response tokens the version that generated them. Entries
        a plugin left out (it extended the response without this method) are padded with -1 first."""
        held = self.token_policy_versions
        if held is None:
            held = []
        if len(held) < before:
            held = _extend(held, [-1] * (before - len(held)))
        elif len(held) > before:
            held = (held.detach().cpu().reshape(-1).tolist() if torch.is_tensor(held) else list(held))[:before]
        version = _as_version(weight_version)
        self.token_policy_versions = _extend(held, [-1 if version is None else version] * new_tokens)

    def _apply_meta_info(self, args, meta_info: dict, new_tokens: int, pad_top_p: bool, terminal: bool) -> None:
        merged = new_tokens > 0 and self._merge_top_p(meta_info, new_tokens)
        if pad_top_p and not merged and self.rollout_top_p_token_offsets is not None:
            offsets = _int32(self.rollout_top_p_token_offsets, [0])
            self.rollout_top_p_token_ids = _int32(self.rollout_top_p_token_ids, [])
            self.rollout_top_p_token_offsets = torch.cat([offsets, offsets.new_full((new_tokens,), int(offsets[-1]))])
        self._merge_routed_experts(args, meta_info)

        if not terminal or "finish_reason" not in meta_info:
            return
        if args is not None and getattr(args, "sglang_speculative_algorithm", None):
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        reason = meta_info["finish_reason"]
        status = _FINISH_STATUS.get(reason.get("type") if isinstance(reason, dict) else reason)
        if status is not None:
            self.status = status

    def _merge_top_p(self, meta_info: dict, new_tokens: int) -> bool:
        ids = decode_int32_meta_array(meta_info, _TOP_P_IDS_KEYS)
        offsets = decode_int32_meta_array(meta_info, _TOP_P_OFFSETS_KEYS)
        if ids is None and offsets is None:
            return False
        if ids is None or offsets is None:
            raise ValueError("SGLang top-p replay: meta_info has token ids or offsets but not both")
        if offsets.numel() != new_tokens + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
            raise ValueError(
                f"SGLang top-p replay: offsets {offsets[:3].tolist()}... (length {offsets.numel()}, last "
                f"{int(offsets[-1]) if offsets.numel() else None}) must start at 0, end at the {ids.numel()} token "
                f"ids and have one entry more than the {new_tokens} generated tokens"
            )
        if self.rollout_top_p_token_ids is None and self.rollout_top_p_token_offsets is None:
            self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets = ids, offsets
        else:
            base_ids = _int32(self.rollout_top_p_token_ids, [])
            base_offsets = _int32(self.rollout_top_p_token_offsets, [0])
            self.rollout_top_p_token_ids = torch.cat([base_ids, ids])
            self.rollout_top_p_token_offsets = torch.cat([base_offsets, offsets[1:] + int(base_offsets[-1])])
        return True

    def _merge_routed_experts(self, args, meta_info: dict) -> None:
        """SGLang's `routed_experts`: [tokens - 1 - start, num_layers, topk] ids; `routed_experts_start_len`
        > 0 continues the rows already held (a partial rollout resumed)."""
        experts = decode_int32_meta_array(meta_info, "routed_experts")
        if experts is None:
            return
        if args is None:
            raise ValueError("append_response_tokens: pass args (num_layers, moe_router_topk) to decode routed_experts")
        start = int(meta_info.get("routed_experts_start_len", 0) or 0)
        if start < 0:
            raise ValueError(f"SGLang routed_experts_start_len must be >= 0, got {start}")
        rows = max(0, len(self.tokens) - 1 - start)
        expected = rows * args.num_layers * args.moe_router_topk
        if experts.numel() != expected:
            raise ValueError(
                f"SGLang routed_experts element count {experts.numel()} does not match the sample: expected "
                f"{expected} = ({len(self.tokens)} tokens - 1 - routed_experts_start_len {start}) x num_layers "
                f"{args.num_layers} x moe_router_topk {args.moe_router_topk}"
            )
        experts = experts.reshape(rows, args.num_layers, args.moe_router_topk)
        if start == 0:
            self.rollout_routed_experts = experts
            return
        held = self.rollout_routed_experts
        if held is None:
            raise ValueError(f"SGLang routed_experts_start_len={start} continues routed experts the sample does not have")
        held = held if torch.is_tensor(held) else torch.as_tensor(held, dtype=experts.dtype)
        if held.shape[0] < start:
            raise ValueError(f"the sample holds {held.shape[0]} rows of routed experts, fewer than "
                             f"routed_experts_start_len={start}")  # fmt: skip
        self.rollout_routed_experts = torch.cat([held[:start], experts], dim=0)

    def _check_aligned(self) -> None:
        n = self.response_length
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries, response_length is {n}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != n:
            raise ValueError(f"rollout_log_probs has {len(self.rollout_log_probs)} entries, response_length is {n}")
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if ids is None and offsets is None:
            return
        if ids is None or offsets is None:
            raise ValueError("rollout top-p replay needs both rollout_top_p_token_ids and rollout_top_p_token_offsets")
        offsets = _int32(offsets, [])
        count = _int32(ids, []).numel()
        if offsets.numel() != n + 1 or int(offsets[-1]) != count:
            raise ValueError(
                f"rollout_top_p_token_offsets has {offsets.numel()} entries (last {int(offsets[-1])}); expected "
                f"response_length + 1 = {n + 1}, ending at the {count} top-p token ids"
            )


_FINISH_STATUS = {
    "length": Sample.Status.TRUNCATED,
    "abort": Sample.Status.ABORTED,
    "stop": Sample.Status.COMPLETED,
}


@dataclass(frozen=True)
class ParamInfo:
    """One trainer parameter as a weight push describes it (slime's record; HF name, dtype, shape)."""

    name: str
    dtype: torch.dtype
    shape: torch.Size
    attrs: dict
    size: int
    src_rank: int


# slime's dict-shaped rollout -> training batch, for plugins typed against it (here the batch is `TrainBatch`)
RolloutBatch = dict[str, list[torch.Tensor] | list[int] | list[float] | list[str]]


@dataclass
class MultimodalType:
    name: str  # the content type in chat messages, e.g. "image"
    placeholder: str  # its placeholder in prompt text, e.g. "<image>"


class MultimodalTypes:
    IMAGE = MultimodalType(name="image", placeholder="<image>")
    VIDEO = MultimodalType(name="video", placeholder="<video>")
    AUDIO = MultimodalType(name="audio", placeholder="<audio>")

    @classmethod
    def all(cls) -> list[MultimodalType]:
        return [cls.IMAGE, cls.VIDEO, cls.AUDIO]

    @classmethod
    def get(cls, name: str) -> MultimodalType | None:
        return next((m for m in cls.all() if m.name == name), None)


@dataclass
class TrainBatch:
    """What the rollout manager hands to training for one rollout: flat, ordered by (group_index, index).

    `rewards` are the values advantages are computed from (already group-normalised for GRPO-like
    estimators); `raw_rewards` are the reward function's values, for logging. `rollout_ids`: the rollout each
    row came from (rows a custom generate split from one rollout share its id; slime's `rollout_ids`); None:
    every row is a rollout of its own. Training counts --global-batch-size in rollouts and averages the loss per
    rollout (slime/backends/training/batching.py). `teacher_log_probs`: on-policy distillation's teacher
    log-probs of each response token (`Sample.teacher_log_probs`), when the rollout filled them.
    `policy_versions`: each row's `Sample.policy_version` (None: no version); `token_policy_versions`: the weight
    version of each response token (-1: unknown), when every sample carries them (slime/rollout/staleness.py
    reads both to bound and measure staleness).
    """

    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[list[int]]
    rewards: list[float]
    raw_rewards: list[float]
    truncated: list[bool]
    group_indices: list[int]
    rollout_log_probs: list[list[float]] | None = None
    rollout_ids: list[int] | None = None
    teacher_log_probs: list[list[float]] | None = None
    policy_versions: list[int | None] | None = None
    token_policy_versions: list[list[int]] | None = None
    # per row, the vision model's inputs of its prompt's images ({"pixel_values", "image_grid_thw"}, tensors from the
    # processor: `Sample.multimodal_train_inputs`), None for a text row; None: no row has images
    multimodal_train_inputs: list[dict | None] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def rollout_of_rows(self) -> list[int]:
        """The rollout of each row: `rollout_ids`, or each row's own index when there are none."""
        return list(self.rollout_ids) if self.rollout_ids is not None else list(range(len(self)))

    def __post_init__(self) -> None:
        n = len(self.tokens)
        per_row = ["response_lengths", "loss_masks", "rewards", "raw_rewards", "truncated", "group_indices"]
        optional = [name for name in ("rollout_ids", "teacher_log_probs", "policy_versions", "token_policy_versions",
                                      "multimodal_train_inputs") if getattr(self, name) is not None]
        for name in per_row + optional:
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries, tokens has {n}")
        for i, (mask, rl) in enumerate(zip(self.loss_masks, self.response_lengths)):
            if len(mask) != rl:
                raise ValueError(f"TrainBatch sample {i}: loss_mask has {len(mask)} entries, response_length={rl}")
        for i, (teacher, rl) in enumerate(zip(self.teacher_log_probs or [], self.response_lengths)):
            if len(teacher) != rl:
                raise ValueError(f"TrainBatch sample {i}: teacher_log_probs has {len(teacher)} entries, "
                                 f"response_length={rl}; on-policy distillation needs one per response token")
        for i, (versions, rl) in enumerate(zip(self.token_policy_versions or [], self.response_lengths)):
            if len(versions) != rl:
                raise ValueError(f"TrainBatch sample {i}: token_policy_versions has {len(versions)} entries, "
                                 f"response_length={rl}")

    def select(self, indices: list[int]) -> "TrainBatch":
        """A new batch holding the given rows, in the given order."""

        def pick(values):
            return None if values is None else [values[i] for i in indices]

        return TrainBatch(**{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)})
