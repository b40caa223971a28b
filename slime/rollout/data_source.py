"""Where rollout prompts come from: the global dataset (`RolloutDataSource`) and, in front of it, a buffer
of groups handed back by the rollout (`RolloutDataSourceWithBuffer`).

A group is `n_samples_per_prompt` deep copies of one prompt `Sample`, numbered with a running
`group_index` and a running sample `index`. Epochs wrap: when the dataset is used up the next epoch
starts, reshuffled with `--rollout-seed + epoch` when `--rollout-shuffle` is set. The dataset is a
`slime.utils.data.Dataset` (every prompt built when the source is made, with `--num-data-workers`
processes), or with `--streaming-data` a `StreamingDataset` that reads, templates and length-filters
prompts as they are handed out; there the offset counts rows of the file (over-long prompts are skipped
when read) and the shuffle is windowed (see `StreamingDataset`).

State (dataset offset, epoch, counters and, unlike slime, the buffer) is written at each checkpoint as
JSON to `{--save}/rollout/data_source_state_{rollout_id}.json` and read back from `--load`, so a resumed
run is handed the same prompts it would have been handed without the interruption.

With `--disable-rollout-global-dataset` (or no `--prompt-data`) there is no dataset: groups are copies
of an empty `Sample` and a `--custom-generate-function-path` makes up the prompts.
"""

from __future__ import annotations

import abc
import copy
import json
import logging
import os

from slime.utils.checkpoint_layout import data_source_state_path
from slime.utils.data import Dataset, StreamingDataset
from slime.utils.hooks import hooks_of
from slime.utils.processing_utils import load_processor, load_tokenizer
from slime.utils.types import Sample

logger = logging.getLogger(__name__)


def state_path(root: str, rollout_id: int) -> str:
    return data_source_state_path(root, rollout_id)


class DataSource(abc.ABC):
    """What `--data-source-path` names: a class built as `DataSource(args)` by the RolloutManager. The rollout
    function asks it for groups (`get_samples`) and may hand unfinished ones back (`add_samples`); `save` /
    `load` run at each checkpoint and on resume; `len()` is the number of prompts it holds (it sizes
    `--num-rollout` from `--num-epoch` when that is not given)."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """The next `num_samples` groups."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Take groups back (e.g. partial ones after an abort)."""

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Write the state reached after `rollout_id`."""

    @abc.abstractmethod
    def load(self, rollout_id: int | None = None) -> None:
        """Restore the state written for `rollout_id`."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Prompts held (may change as groups are handed out and back)."""


class RolloutDataSource(DataSource):
    def __init__(self, args):
        self.args = args
        self.epoch_id = 0
        self.sample_offset = 0
        self.sample_group_index = 0
        self.sample_index = 0
        self.dataset = None
        # slime's order: without the global dataset, --prompt-data is not read at all
        if args.rollout_global_dataset and args.prompt_data:
            self.dataset = self._load_dataset(args)
            if len(self.dataset) == 0:
                raise ValueError(
                    f"--prompt-data {args.prompt_data}: no prompts left (empty file, or every prompt is longer "
                    f"than --rollout-max-prompt-len={args.rollout_max_prompt_len}); give a file "
                    "with rows, or raise --rollout-max-prompt-len (and --rollout-max-context-len)"
                )
            if args.rollout_shuffle:
                self.dataset.shuffle(self.epoch_id)

    @staticmethod
    def _load_dataset(args):
        tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        if args.dump_details is not None:  # slime's --dump-details keeps the tokenizer next to the dumps
            tokenizer.save_pretrained(os.path.join(args.dump_details, "tokenizer"))
        common = {
            "tokenizer": tokenizer,
            # with --multimodal-keys the rows' images are read for the model's processor (and count in
            # --rollout-max-prompt-len as the image tokens they expand to)
            "processor": load_processor(args.hf_checkpoint, trust_remote_code=True) if args.multimodal_keys else None,
            "multimodal_keys": args.multimodal_keys,
            "max_length": args.rollout_max_prompt_len,
            "prompt_key": args.input_key,
            "label_key": args.label_key,
            "metadata_key": args.metadata_key,
            "tool_key": args.tool_key,
            "apply_chat_template": args.apply_chat_template,
            "apply_chat_template_kwargs": args.apply_chat_template_kwargs,
            "seed": args.rollout_seed,
        }
        if args.streaming_data:
            return StreamingDataset(args.prompt_data, **common)
        return Dataset(args.prompt_data, num_workers=args.num_data_workers, **common)

    @property
    def dataset_size(self) -> int:
        return len(self.dataset) if self.dataset is not None else 0

    def __len__(self) -> int:
        return self.dataset_size

    def _next_prompts(self, num_groups: int) -> list[Sample]:
        if self.dataset is None:
            return [Sample() for _ in range(num_groups)]
        prompts: list[Sample] = []
        fruitless = 0  # positions read in a row that gave no prompt (a streaming dataset drops long ones on read)
        while len(prompts) < num_groups:
            if self.sample_offset >= len(self.dataset):
                self.epoch_id += 1
                self.sample_offset = 0
                if self.args.rollout_shuffle:
                    self.dataset.shuffle(self.epoch_id)
            take = min(num_groups - len(prompts), len(self.dataset) - self.sample_offset)
            got = self.dataset.read(self.sample_offset, self.sample_offset + take)
            self.sample_offset += take
            prompts.extend(got)
            fruitless = 0 if got else fruitless + take
            if fruitless >= 2 * len(self.dataset):  # two epochs' worth of positions always span one whole epoch
                raise ValueError(
                    f"--prompt-data {self.args.prompt_data}: no prompts left (every prompt is longer than "
                    f"--rollout-max-prompt-len={self.args.rollout_max_prompt_len}); raise "
                    "--rollout-max-prompt-len (and --rollout-max-context-len) or shorten the prompts"
                )
        return prompts

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """The next `num_groups` groups of `n_samples_per_prompt` fresh copies each."""
        n = self.args.n_samples_per_prompt
        groups = []
        for prompt in self._next_prompts(num_groups):
            group = []
            for _ in range(n):
                sample = copy.deepcopy(prompt)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        raise RuntimeError(
            f"{type(self).__name__} has no buffer; use RolloutDataSourceWithBuffer (the default --data-source-path) "
            "to hand groups back (e.g. with --partial-rollout)"
        )

    # --- checkpointing -------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "sample_offset": self.sample_offset,
            "epoch_id": self.epoch_id,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "dataset_size": self.dataset_size,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("dataset_size", self.dataset_size) != self.dataset_size:
            logger.warning(
                "data source state was saved with %d prompts in --prompt-data, now there are %d: the restored "
                "offset points into a different dataset, so the next prompts differ from the interrupted run's",
                state["dataset_size"],
                self.dataset_size,
            )
        self.sample_offset = state["sample_offset"]
        self.epoch_id = state["epoch_id"]
        self.sample_group_index = state["sample_group_index"]
        self.sample_index = state["sample_index"]
        if self.dataset is not None and self.args.rollout_shuffle:
            self.dataset.shuffle(self.epoch_id)

    def save(self, rollout_id: int) -> str | None:
        """Write the state for `rollout_id` under `--save`; returns the path (None without --save)."""
        root = self.args.save
        if not root:
            return None
        path = state_path(root, rollout_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            text = json.dumps(self.state_dict())
        except TypeError as e:
            raise TypeError(
                f"data source state for rollout {rollout_id} is not JSON-serialisable ({e}): keep Sample.metadata "
                "and rewards of buffered groups to JSON types"
            ) from e
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: a crash mid-write never leaves a half-written state behind
        return path

    def load(self, rollout_id: int | None = None) -> bool:
        """Restore the state saved for `rollout_id` under `--load`; False (with a log line) when there is none."""
        root = self.args.load
        if not root or rollout_id is None:
            return False
        path = state_path(root, rollout_id)
        if not os.path.exists(path):
            logger.warning("no data source state at %s: starting from the beginning of --prompt-data", path)
            return False
        with open(path) as f:
            self.load_state_dict(json.load(f))
        logger.info("data source state restored from %s: %s", path, self.state_dict())
        return True


def pop_first(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """Default `--buffer-filter-path`: the oldest `num_samples` groups (FIFO), removed from the buffer."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """Serves buffered groups first (through `--buffer-filter-path`), then fresh groups from the dataset."""

    def __init__(self, args):
        super().__init__(args)
        self.buffer: list[list[Sample]] = []
        self.buffer_filter = hooks_of(args).buffer_filter or pop_first

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = self._get_from_buffer(num_groups)
        if len(groups) < num_groups:
            groups += super().get_samples(num_groups - len(groups))
        return groups

    def _get_from_buffer(self, num_groups: int) -> list[list[Sample]]:
        if not self.buffer or num_groups <= 0:
            return []
        groups = self.buffer_filter(self.args, None, self.buffer, num_groups)
        if len(groups) > num_groups:
            raise ValueError(f"--buffer-filter-path returned {len(groups)} groups; at most {num_groups} were asked for")
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Append complete groups (each exactly `n_samples_per_prompt` samples) to the buffer."""
        n = self.args.n_samples_per_prompt
        for i, group in enumerate(groups):
            if not isinstance(group, list) or not all(isinstance(s, Sample) for s in group):
                raise TypeError(f"add_samples: group {i} must be a list of Sample, got {type(group).__name__}")
            if len(group) != n:
                raise ValueError(
                    f"add_samples: group {i} (group_index {group[0].group_index if group else None}) has "
                    f"{len(group)} samples; the buffer takes only complete groups of --n-samples-per-prompt={n}"
                )
        self.buffer.extend(groups)

    def get_buffer_length(self) -> int:
        return len(self.buffer)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["buffer"] = [[s.to_dict() for s in group] for group in self.buffer]
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.buffer = [[Sample.from_dict(d) for d in group] for group in state.get("buffer", [])]
