"""Every `*-path` flag goes through load_function: dotted paths, `file.py` and `file.py:fn`."""

from __future__ import annotations

import sys

import pytest

from slime.utils.misc import load_function


def test_dotted_path():
    from slime.rollout.rm_hub.toy import toy_reward

    assert load_function("slime.rollout.rm_hub.toy.toy_reward") is toy_reward
    assert load_function("slime.rollout.rm_hub.toy:toy_reward") is toy_reward


def test_python_file_forms(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def my_reward(args, sample):\n    return 1.0\n\ndef other():\n    return 2\n")
    monkeypatch.chdir(tmp_path)
    assert load_function("my_reward.py")(None, None) == 1.0  # the function named like the file
    assert load_function("my_reward.py:other")() == 2
    assert load_function(str(tmp_path / "my_reward.py") + ":other")() == 2
    assert load_function("my_reward.other")() == 2  # a module in the working directory


def test_custom_generate_file_may_name_its_function_generate(tmp_path):
    (tmp_path / "custom_generate.py").write_text("async def generate(args, sample, sampling_params):\n    return sample\n")
    fn = load_function(str(tmp_path / "custom_generate.py"), "--custom-generate-function-path")
    assert fn.__name__ == "generate"
    with pytest.raises(AttributeError, match="has no attribute 'custom_generate'"):  # only for that flag
        load_function(str(tmp_path / "custom_generate.py"), "--rollout-function-path")


def test_errors_name_the_flag_and_what_exists(tmp_path):
    (tmp_path / "rm.py").write_text("def score(args, sample):\n    return 0.0\n")
    with pytest.raises(AttributeError, match=r"--custom-rm-path=.*rm\.py:nope.*score"):
        load_function(f"{tmp_path}/rm.py:nope", "--custom-rm-path")
    with pytest.raises(ImportError, match=r"--custom-rm-path=.*missing\.py"):
        load_function(f"{tmp_path}/missing.py", "--custom-rm-path")
    with pytest.raises(ImportError, match="no_such_module"):
        load_function("no_such_module.fn", "--rollout-function-path")
    with pytest.raises(ValueError, match="not a dotted path"):
        load_function("justaname")


def test_a_broken_plugin_file_reports_its_error_every_time(tmp_path):
    (tmp_path / "broken_rm.py").write_text("def broken_rm(args, sample):\n    return 1.0\n\nraise RuntimeError('no db')\n")
    for _ in range(2):  # the half-executed module is not kept: the second load fails the same way
        with pytest.raises(ImportError, match=r"--custom-rm-path=.*cannot import .*RuntimeError: no db \(at .*"
                                              r"broken_rm\.py:4\)"):
            load_function(str(tmp_path / "broken_rm.py"), "--custom-rm-path")


def test_a_broken_plugin_module_reports_its_error_every_time(tmp_path, monkeypatch):
    (tmp_path / "broken_pkg_mod.py").write_text("import no_such_dependency_xyz\n\ndef fn():\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for _ in range(2):
        with pytest.raises(ImportError, match="No module named 'no_such_dependency_xyz'"):
            load_function("broken_pkg_mod.fn", "--rollout-function-path")
    sys.modules.pop("broken_pkg_mod", None)
