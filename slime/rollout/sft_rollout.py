"""slime's SFT rollout: `--rollout-function-path slime.rollout.sft_rollout.generate_rollout`.

Supervised fine-tuning through the RL loop, with no engine (`--debug-train-only`): each rollout takes the next
`--rollout-batch-size` chat rows of `--prompt-data` (`--input-key messages`, the messages kept as a list: no
`--apply-chat-template`; tools from `--tool-key` in `metadata["tools"]`), renders them with the tokenizer of
`--hf-checkpoint` and marks what is trained with `--loss-mask-type` (slime.utils.mask_utils). The sample's
response starts at the first trained token (slime's `get_response_lengths`); everything before it is the prompt,
and the response's loss mask keeps later untrained tokens (user turns, tool results) at 0. Rewards are 0; train
with `--loss-type sft_loss --disable-compute-advantages-and-returns` (docs/sft.md).

The data source is the default one, so epochs wrap (reshuffled with `--rollout-shuffle`), `--num-epoch` sizes
the run and a checkpoint saves the position in the data: a run resumed with `--load` continues mid-epoch with the
next rows.

Checked where slime asserts: no evaluation rollout, the global dataset, one sample per prompt. Added: a row with
nothing to train on, or whose first token would be trained (it has no prediction), is an error naming the row.
"""

from __future__ import annotations

import logging
from typing import Any

from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample

__all__ = ["generate_rollout"]

logger = logging.getLogger(__name__)

_GENERATORS: dict[tuple[str, str], MultiTurnLossMaskGenerator] = {}  # (--hf-checkpoint, --loss-mask-type)
_logged = False  # the first sample of the process is logged, as in slime


def mask_generator(args: Any) -> MultiTurnLossMaskGenerator:
    """The loss-mask generator of `--hf-checkpoint`'s tokenizer and `--loss-mask-type`, made once per process."""
    key = (args.hf_checkpoint, args.loss_mask_type)
    if key not in _GENERATORS:
        tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        _GENERATORS[key] = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type=args.loss_mask_type)
    return _GENERATORS[key]


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list[list[Sample]]:
    """The next `--rollout-batch-size` conversations as training samples (groups of one)."""
    if evaluation:
        raise ValueError("slime.rollout.sft_rollout has no evaluation rollout: drop --eval-interval / "
                         "--eval-prompt-data, or give --eval-function-path a function that evaluates")
    if not args.rollout_global_dataset:
        raise ValueError("slime.rollout.sft_rollout reads the conversations of --prompt-data: drop "
                         "--disable-rollout-global-dataset")
    if args.n_samples_per_prompt != 1:
        raise ValueError(f"--n-samples-per-prompt {args.n_samples_per_prompt}: slime.rollout.sft_rollout trains each "
                         "conversation once; use --n-samples-per-prompt 1")
    generator = mask_generator(args)
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            to_sft_sample(sample, generator)
    global _logged
    if not _logged and groups:
        _logged = True
        sample = groups[0][0]
        logger.info("sft_rollout: first sample of rollout %d: %d tokens, response %d, trained %d; trained text %r",
                    rollout_id, len(sample.tokens), sample.response_length, sum(sample.loss_mask),
                    generator.get_text_from_loss_mask(sample.tokens[sample.prompt_length:], sample.loss_mask))
    return groups


def to_sft_sample(sample: Sample, generator: MultiTurnLossMaskGenerator) -> Sample:
    """Fill `sample` (its prompt: the chat messages) with the tokens, response and loss mask to train on."""
    messages = sample.prompt
    if not isinstance(messages, list):
        raise ValueError(f"sample {sample.index}: slime.rollout.sft_rollout needs chat messages (a list of "
                         f"{{'role', 'content'}}) under --input-key, got {type(messages).__name__}; do not pass "
                         "--apply-chat-template (it renders them to text)")
    tools = (sample.metadata or {}).get("tools")
    token_ids, loss_mask = generator.get_loss_mask(messages, tools=tools)
    if len(token_ids) != len(loss_mask):
        raise ValueError(f"sample {sample.index}: --loss-mask-type {generator.tokenizer_type} gave {len(token_ids)} "
                         f"tokens but {len(loss_mask)} mask entries")
    response_length = generator.get_response_lengths([loss_mask])[0]
    if response_length == 0:
        raise ValueError(f"sample {sample.index}: nothing to train on with --loss-mask-type "
                         f"{generator.tokenizer_type} (no assistant message, or every one has step_loss_mask 0); "
                         "drop the row or give it an assistant turn")
    if response_length == len(token_ids):
        raise ValueError(f"sample {sample.index}: its first token would be trained on, but nothing predicts it; "
                         "the conversation needs a prompt before the first assistant turn")
    sample.tokens = list(token_ids)
    sample.response_length = response_length
    sample.loss_mask = list(loss_mask[-response_length:])
    sample.reward = 0
    return sample
