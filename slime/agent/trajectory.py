"""An agent session's turns as training Samples (slime's `slime.agent.trajectory`).

Contract: an adapter calls `TrajectoryManager.record_turn(sid, turn=TurnRecord(...), prompt_messages=...,
response_message=...)` once per `/generate` it served, and `get_trajectory(sid, base_sample=...)` at the end.

How turns become rows:
- The messages of each turn's prompt are routed into a per-session tree (matched by role and dict equality), the
  generated assistant message hung under them. A sub-agent or a compacted history that does not extend an earlier
  prompt starts a new branch; every leaf is one chain of turns.
- A chain's generated turns are concatenated into token rows. A turn whose `prompt_ids` extend the row's tokens
  exactly appends its new prompt tokens (loss 0) and its output (loss 1, the engine's log-probs). When the prompt
  re-tokenizes the previous response differently (the chat template re-renders it) and the difference starts inside
  that response and the new output is shorter than `fork_threshold_tokens`, the drifted span is replaced by the
  prompt's tokens with loss 0 ("realign"); any other difference closes the row and starts a new one ("fork").
- Row layout: `tokens` = first prompt + everything after it; `loss_mask` / `rollout_log_probs` cover the part after
  the first prompt (`response_length` tokens). A row with no trained token is dropped. A turn shared by several
  leaves is trained in the first row that reaches it and is loss-0 context in the others.
- A client replaying a short generated assistant message re-rendered (not equal to what we stored) would leave
  the original as a dead-end leaf trained twice; instead the stored message is replaced by the replay and stops
  being trained (`metadata["merged_rewrite"]` records it). Longer responses (>= the threshold) fork instead.
- `reward` goes in full to every row of the session. `max_sample_tokens` > 0 truncates each row's tokens.

The manager holds no tokenizer; adapters decode `response` themselves.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from slime.utils.types import Sample

logger = logging.getLogger(__name__)

DEFAULT_FORK_THRESHOLD_TOKENS = 1024


@dataclass(frozen=True)
class TurnRecord:
    """One `/generate` call: the prompt sent, the tokens generated with their log-probs, and why it stopped."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    output_log_probs: list[float] = field(default_factory=list)
    ill_formed: bool = False


class DriftKind(enum.Enum):
    CLEAN = "clean"
    REALIGN = "realign"
    FORK = "fork"


class MessageNode:
    """A message in a session's routing tree. `turn` is set only on assistant messages the model generated and
    that still train; every other node (system / user / tool, a replayed foreign assistant) only routes."""

    def __init__(self, role: str | None = None, message: dict | None = None, metadata: dict | None = None):
        self.role = role
        self.message = message
        self.metadata = dict(metadata or {})
        self.parent: MessageNode | None = None
        self.children: list[MessageNode] = []
        self.turn: TurnRecord | None = None
        self.turn_index: int | None = None
        self.response_trained = False

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def add_child(self, child: MessageNode) -> MessageNode:
        child.parent = self
        self.children.append(child)
        return child

    def path_from_root(self) -> list[MessageNode]:
        path = []
        node = self
        while node is not None and not node.is_root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def leaves(self) -> list[MessageNode]:
        if not self.children:
            return [self]
        return [leaf for child in self.children for leaf in child.leaves()]


class TurnShapeError(ValueError, AssertionError):
    """A turn whose log-probs do not pair with its output tokens. An AssertionError too: slime asserts this."""


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case, done at C speed
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


_common_prefix_len = common_prefix_len  # slime's name (its tests import it)


class _Row:
    """The tokens of one training row as turns are appended."""

    def __init__(self, fork_threshold: int):
        self.fork_threshold = fork_threshold
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.log_probs: list[float] = []
        self.first_prompt_len = 0
        self.last_response_start: int | None = None

    def drift(self, turn: TurnRecord) -> DriftKind:
        if not self.tokens:
            return DriftKind.CLEAN
        shared = common_prefix_len(self.tokens, turn.prompt_ids)
        if shared == len(self.tokens):
            return DriftKind.CLEAN
        start = self.last_response_start
        if start is not None and shared >= start and len(turn.output_ids) < self.fork_threshold:
            return DriftKind.REALIGN
        return DriftKind.FORK

    def append(self, turn: TurnRecord, kind: DriftKind, trained: bool) -> None:
        if kind is DriftKind.FORK:
            raise ValueError("a turn that forks starts a new row; it cannot be appended to this one")
        if self.last_response_start is None:
            self.first_prompt_len = len(turn.prompt_ids)
        if kind is DriftKind.REALIGN:  # the drifted response is replaced by the prompt's rendering of it
            del self.tokens[self.last_response_start:], self.loss_mask[self.last_response_start:]
            del self.log_probs[self.last_response_start:]
        self._extend(turn.prompt_ids[len(self.tokens):], 0, None)
        self.last_response_start = len(self.tokens)
        self._extend(turn.output_ids, int(trained), turn.output_log_probs if trained else None)

    def _extend(self, ids: list[int], mask: int, log_probs: list[float] | None) -> None:
        self.tokens += ids
        self.loss_mask += [mask] * len(ids)
        self.log_probs += list(log_probs) if log_probs else [0.0] * len(ids)

    def has_trained_token(self) -> bool:
        return any(self.loss_mask[self.first_prompt_len:])

    def to_sample(self, base: Sample, metadata: dict, max_tokens: int) -> Sample:
        end = max_tokens if max_tokens and len(self.tokens) > max_tokens else len(self.tokens)
        start = self.first_prompt_len
        return Sample(
            index=base.index,
            group_index=base.group_index,
            rollout_id=base.rollout_id if base.rollout_id is not None else base.index,
            prompt=base.prompt,
            label=base.label,
            tokens=self.tokens[:end],
            response_length=max(end - start, 0),
            loss_mask=self.loss_mask[start:end],
            rollout_log_probs=self.log_probs[start:end],
            reward=0.0,
            status=Sample.Status.COMPLETED,
            metadata=dict(metadata),
        )


class TrajectoryManager:
    """Per-session routing trees of recorded turns; see the module docstring for how they become Samples."""

    def __init__(self, *, fork_threshold_tokens: int | None = None):
        self._fork_threshold = DEFAULT_FORK_THRESHOLD_TOKENS if fork_threshold_tokens is None else fork_threshold_tokens
        self._trees: dict[str, MessageNode] = {}
        self._turns: dict[str, int] = {}

    def has_session(self, sid: str) -> bool:
        return sid in self._trees

    def turn_count(self, sid: str) -> int:
        return self._turns.get(sid, 0)

    def record_turn(
        self,
        sid: str,
        *,
        turn: TurnRecord,
        prompt_messages: list[dict[str, Any]],
        response_message: dict[str, Any] | None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if not prompt_messages:
            logger.warning("session %s: a turn with no prompt messages is not recorded", sid)
            return
        if turn.output_log_probs and len(turn.output_log_probs) != len(turn.output_ids):
            raise TurnShapeError(f"session {sid}: output_log_probs has {len(turn.output_log_probs)} entries for "
                                 f"{len(turn.output_ids)} output tokens; the engine's output_token_logprobs must "
                                 "have one per token")
        node = self._trees.setdefault(sid, MessageNode())
        depth = 0
        while depth < len(prompt_messages):
            msg = prompt_messages[depth]
            match = next((c for c in node.children if c.role == msg.get("role") and c.message == msg), None)
            if match is None:
                break
            node, depth = match, depth + 1
        if depth < len(prompt_messages) and self._absorb_rewrite(sid, node, prompt_messages[depth]):
            node, depth = next(c for c in node.children if c.role == "assistant"), depth + 1
        for msg in prompt_messages[depth:]:
            node = node.add_child(MessageNode(msg.get("role"), msg))
        leaf = node.add_child(MessageNode("assistant", response_message, metadata))
        leaf.turn = turn
        leaf.turn_index = self._turns[sid] = self._turns.get(sid, 0) + 1

    def _absorb_rewrite(self, sid: str, node: MessageNode, msg: dict) -> bool:
        """Replace node's single short generated assistant leaf by `msg` (a re-rendered replay of it)."""
        if self._fork_threshold <= 0 or msg.get("role") != "assistant":
            return False
        assistants = [c for c in node.children if c.role == "assistant"]
        if len(assistants) != 1:
            if assistants:
                logger.warning("session %s: %d assistant messages could be the one replayed; keeping both branches",
                               sid, len(assistants))
            return False
        old = assistants[0]
        if old.children or old.turn is None or len(old.turn.output_ids) >= self._fork_threshold:
            return False
        old.metadata["merged_rewrite"] = {"abandoned_turn_index": old.turn_index,
                                          "abandoned_response_tokens": len(old.turn.output_ids)}
        old.turn, old.turn_index, old.message = None, None, msg
        return True

    def get_trajectory(
        self,
        sid: str,
        *,
        base_sample: Sample,
        reward: float = 0.0,
        extra_metadata: dict[str, Any] | None = None,
        max_sample_tokens: int = 0,
    ) -> list[Sample]:
        """The session's rows (each with the full `reward`); the session is forgotten, so a second call gives [].

        A `base_sample` with images is refused: the rows hold the session's tokens only (the agent was given a text
        prompt), so the sample's images would be dropped from training without a word."""
        images = (base_sample.multimodal_inputs or {}).get("images")
        if images:
            raise ValueError(
                f"session {sid}: sample {base_sample.index} has {len(images)} image(s) (--multimodal-keys), but an "
                "agent session's rows are text only (the agent CLI gets a text prompt and the adapters refuse image "
                "blocks), so its images would be dropped; drop --multimodal-keys for agent rollouts, or train with "
                "images through a custom generate built on slime.rollout.multi_turn (docs/vlm.md)")
        root = self._trees.pop(sid, None)
        self._turns.pop(sid, None)
        if root is None:
            return []
        samples = []
        for leaf in root.leaves():
            if not leaf.is_root:
                samples += self._chain_samples(leaf.path_from_root(), base_sample, extra_metadata, max_sample_tokens)
        for s in samples:
            s.reward = reward
        return samples

    def drop_session(self, sid: str) -> None:
        self._trees.pop(sid, None)
        self._turns.pop(sid, None)

    def _chain_samples(self, chain: list[MessageNode], base: Sample, extra: dict | None, max_tokens: int):
        generated = [n for n in chain if n.role == "assistant" and n.turn is not None]
        metadata = {
            **(extra or {}),
            "truncated": bool(generated) and generated[-1].turn.finish_reason == "length",
            "use_tool": any((n.message or {}).get("tool_calls") for n in generated),
            "ill_formed": any(n.turn.ill_formed for n in generated),
        }
        rows: list[_Row] = []
        for node in generated:
            trained, node.response_trained = not node.response_trained, True
            kind = rows[-1].drift(node.turn) if rows else DriftKind.FORK
            if kind is DriftKind.FORK:
                rows.append(_Row(self._fork_threshold))
                kind = DriftKind.CLEAN
            rows[-1].append(node.turn, kind, trained)
        return [r.to_sample(base, metadata, max_tokens) for r in rows if r.has_trained_token()]


__all__ = ["DriftKind", "MessageNode", "TrajectoryManager", "TurnRecord"]
