"""The save folder's layout (slime/utils/checkpoint_layout.py), the one both trainers, the data source, the resume
checks and --save-hf use: slime's names on disk, the latest marker written atomically and read strictly, and both
trainers' checkpoint finders reading folders laid out by it."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from slime.backends.fsdp_utils import checkpoint as fsdp_checkpoint
from slime.backends.megatron_utils import checkpoint as megatron_checkpoint
from slime.backends.training.hf_save import hf_save_path
from slime.rollout.data_source import state_path
from slime.utils import checkpoint_layout as layout


def test_the_names_on_disk_are_slimes(tmp_path):
    root = str(tmp_path)
    assert layout.iteration_dir(root, 7) == os.path.join(root, "iter_0000007")
    assert layout.iteration_dir(root, 12345678) == os.path.join(root, "iter_12345678")
    assert layout.iteration_dir(root, None) == os.path.join(root, "release")
    assert layout.latest_path(root) == os.path.join(root, "latest_checkpointed_iteration.txt")
    assert layout.critic_dir(root) == os.path.join(root, "critic")
    assert layout.save_folders(root, with_critic=True) == [root, os.path.join(root, "critic")]
    assert layout.save_folders(root, with_critic=False) == [root]
    assert layout.data_source_state_path(root, 3) == os.path.join(root, "rollout", "data_source_state_3.json")
    assert layout.hf_export_dir("/out/hf_{rollout_id}", 7) == "/out/hf_7"


def test_the_users_of_the_layout_name_the_same_folders(tmp_path):
    root = str(tmp_path)
    assert state_path(root, 3) == layout.data_source_state_path(root, 3)
    assert hf_save_path(argparse.Namespace(save_hf="/out/hf_{rollout_id}"), 4) == "/out/hf_4"
    assert hf_save_path(argparse.Namespace(save_hf=None), 4) is None
    assert fsdp_checkpoint.iteration_dir(root, 5) == megatron_checkpoint.iteration_dir(root, 5)
    assert fsdp_checkpoint.LATEST_FILE == megatron_checkpoint.LATEST_FILE == "latest_checkpointed_iteration.txt"


def test_iteration_folders_are_recognised_by_name(tmp_path):
    for name in ("iter_0000002", "iter_0000010", "iter_abc", "iter_", "release", "rollout", "critic"):
        (tmp_path / name).mkdir()
    assert layout.iteration_of("iter_0000010") == 10 and layout.iteration_of("iter_x1") is None
    assert layout.iterations(str(tmp_path)) == [(2, str(tmp_path / "iter_0000002")),
                                                (10, str(tmp_path / "iter_0000010"))]


def test_the_latest_marker_is_written_atomically_and_read_strictly(tmp_path):
    root = str(tmp_path)
    assert not layout.has_checkpoint(root) and not layout.has_checkpoint(None) and not layout.has_checkpoint("")
    layout.write_latest(root, 7)
    assert sorted(os.listdir(root)) == ["latest_checkpointed_iteration.txt"]  # no temporary file left behind
    assert layout.has_checkpoint(root) and layout.read_latest(root) == 7
    layout.write_latest(root, None)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert layout.read_latest(root, release_ok=True) == layout.RELEASE
    with pytest.raises(ValueError, match=r"iteration.txt:1: expected a rollout id, found 'release'"):
        layout.read_latest(root)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("seven\n")
    with pytest.raises(ValueError, match=r"expected a rollout id or 'release', found 'seven'; fix or delete"):
        layout.read_latest(root, release_ok=True)


def _hf_iteration(root, rollout_id: int, weights: bool = True) -> str:
    folder = layout.iteration_dir(str(root), rollout_id)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("{}")
    if weights:
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"\0" * 8)
    return folder


def test_both_trainers_find_the_checkpoint_the_layout_names(tmp_path):
    fsdp_root, megatron_root = tmp_path / "fsdp", tmp_path / "megatron"
    folder = _hf_iteration(fsdp_root, 3)
    _hf_iteration(fsdp_root, 4, weights=False)  # an interrupted save
    layout.write_latest(str(fsdp_root), 3)
    found = fsdp_checkpoint.find_checkpoint(str(fsdp_root))
    assert (found.iteration, found.path) == (3, folder)
    assert fsdp_checkpoint.complete_iterations(str(fsdp_root)) == [3]
    layout.write_latest(str(fsdp_root), 4)
    with pytest.raises(FileNotFoundError, match=r"names iteration 4 .* write 3 \(the newest complete one"):
        fsdp_checkpoint.find_checkpoint(str(fsdp_root))

    for rollout_id in (None, 2):
        os.makedirs(layout.iteration_dir(str(megatron_root), rollout_id))
        with open(os.path.join(layout.iteration_dir(str(megatron_root), rollout_id), "metadata.json"), "w") as f:
            f.write("{}")
    layout.write_latest(str(megatron_root), None)
    release = megatron_checkpoint.find_checkpoint(str(megatron_root))
    assert (release.iteration, release.path) == (None, str(megatron_root / "release"))
    layout.write_latest(str(megatron_root), 2)
    assert megatron_checkpoint.find_checkpoint(str(megatron_root)).path == str(megatron_root / "iter_0000002")
    assert megatron_checkpoint.complete_iterations(str(megatron_root)) == [2]


@pytest.fixture
def one_rank(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_an_fsdp_save_is_laid_out_as_the_layout_says_and_reloads(tmp_path, one_rank):
    """A real save (one gloo rank, a plain module, AdamW state through DCP): the folder names are the layout's."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()

    def write_folder(model, state, path, hf_checkpoint):
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{}")

    save = str(tmp_path / "save")
    path = fsdp_checkpoint.save_checkpoint(model, optimizer, save, 6, None, {"global_step": 1}, write_folder)
    assert path == os.path.join(save, "iter_0000006")
    assert sorted(os.listdir(save)) == ["iter_0000006", "latest_checkpointed_iteration.txt"]
    assert {"model.safetensors", "config.json", "optimizer", "trainer_state.json"} <= set(os.listdir(path))
    found = fsdp_checkpoint.find_checkpoint(save)
    assert (found.iteration, found.trainer_state["rollout_id"], found.trainer_state["global_step"]) == (6, 6, 1)
