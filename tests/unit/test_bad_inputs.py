"""Bad inputs (issue #9, item 3): each gives an error naming the file:line / flag / value and the fix, before
anything is started where it can be, and writes or loses nothing.

Every case in `CASES` drives the real code path in-process: `parse_args` (which checks what it can before Ray:
hooks, the head of --prompt-data, the chat template, the --load folder), the data source constructor, the
rollout's /generate call against a real local HTTP server (a scripted peer: the one fake allowed, standing in for
a broken engine), and the checkpoint finders. A case passes when the error holds every expected substring and
the case's folder (inputs, --save) is unchanged afterwards. A reward function that raises is also covered end
to end by tests/e2e_cpu/test_train_e2e.py::test_failing_reward_function_stops_the_run_and_reaps_everything.

    python tests/unit/test_bad_inputs.py    # prints | bad input | error shown | nothing written/lost |
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from slime.config.arguments import SlimeArgumentError, parse_args
from tests.unit.test_sglang_rollout import ScriptedEngine
from tests.args import make_args, router_fields

# --- the environment: tokenizers, a model folder, a scripted engine ------------------------------------------


class Engine(ScriptedEngine):
    """A local HTTP server answering /generate as its `mode` says: `ok` (two tokens), `500` (an engine error),
    `html` (200 with a body that is not JSON)."""

    def __init__(self):
        super().__init__(vocab={})
        self.mode = "ok"

    def answer(self, path: str, body):
        mode = self.mode
        if mode == "500":
            return 500, b"engine crashed: CUDA out of memory"
        if mode == "html":
            return 200, b"<html><body>502 Bad Gateway</body></html>"
        return 200, {"text": "one two", "meta_info": {"finish_reason": {"type": "stop"},
                     "output_token_logprobs": [[-0.5, 5, "one"], [-0.25, 6, "two"]]}}  # fmt: skip

    def close(self):
        from slime.utils.http_utils import close_client, run_sync

        run_sync(close_client())  # the rollout's aiohttp session on the background loop
        super().close()


@dataclass
class Env:
    model_dir: str  # tokenizer (with a chat template) + config.json: enough for parse_args and the data source
    no_template_dir: str  # the same tokenizer without a chat template
    engine: Engine


def make_env(root: str, tokenizer_dir: str) -> Env:
    model = os.path.join(root, "model")
    shutil.copytree(tokenizer_dir, model)
    with open(os.path.join(model, "config.json"), "w") as f:
        f.write("{}")
    bare = os.path.join(root, "no-template")
    shutil.copytree(model, bare)
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(bare, name)):
            os.remove(os.path.join(bare, name))
    config = os.path.join(bare, "tokenizer_config.json")
    with open(config) as f:
        data = json.load(f)
    data.pop("chat_template", None)
    with open(config, "w") as f:
        json.dump(data, f)
    return Env(model, bare, Engine())


# --- helpers the cases use ------------------------------------------------------------------------------------

GOOD_ROWS = [{"prompt": "what comes after one?", "label": "two"}, {"prompt": "count to three", "label": "3"}]


def write_rows(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def argv(env: Env, d: Path, *extra: str, data: str | None = None) -> list[str]:
    """A valid CPU command line (fsdp + hf engine) writing only under d/save."""
    data = data or write_rows(d / "train.jsonl", GOOD_ROWS)
    return ["--hf-checkpoint", env.model_dir, "--prompt-data", data, "--input-key", "prompt",
            "--label-key", "label", "--rollout-batch-size", "2", "--num-rollout", "1",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--save", str(d / "save"), *extra]  # fmt: skip


def source_args(env: Env, data: str, **kw) -> argparse.Namespace:
    """Parsed args the data source reads (`kw` set before validation)."""
    return make_args(**{"hf_checkpoint": env.model_dir, "prompt_data": data, "input_key": "prompt",
                        "label_key": "label", **kw})


def make_source(args):
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    return RolloutDataSourceWithBuffer(args)


def rollout_args(env: Env, mode: str, **kw) -> argparse.Namespace:
    """Parsed args for generate / generate_and_rm, the router at the engine, which answers as `mode` says."""
    env.engine.mode = mode
    return make_args(hf_checkpoint=env.model_dir, **router_fields(env.engine.url), sglang_server_concurrency=8,
                     rollout_max_response_len=4, rm_type="toy", **kw)


def generate_once(env: Env, mode: str) -> None:
    from slime.rollout import generation, sglang_rollout
    from slime.utils.http_utils import run_sync
    from slime.utils.types import Sample

    args = rollout_args(env, mode)
    # keep the retries quick (read in its home module; sglang_rollout is slime's facade onto it)
    saved, generation.GENERATE_BACKOFF_S = generation.GENERATE_BACKOFF_S, 0.01
    try:
        params = sglang_rollout.build_sampling_params(args)
        failed = run_sync(sglang_rollout.generate_and_rm(args, Sample(prompt="one two", label="two"), params))
        assert failed.status == Sample.Status.FAILED and failed.reward == 0.0, failed  # marked, not raised
        run_sync(sglang_rollout.generate(args, Sample(prompt="one two", label="two"), params))  # the error itself
    finally:
        generation.GENERATE_BACKOFF_S = saved


# --- the cases: each writes its inputs under d and returns the call that must fail ------------------------------


def malformed_line_at_parse(env, d):
    a = argv(env, d, data=write_rows(d / "bad.jsonl", [GOOD_ROWS[0], "", '{"prompt": "two", "label": ', GOOD_ROWS[1]]))
    return lambda: parse_args(a)


def malformed_line_at_load(env, d):
    rows = GOOD_ROWS * 100 + ['{"prompt": "x" "label": "y"}']  # row 201: past the 100 rows parse_args reads
    args = source_args(env, write_rows(d / "big.jsonl", rows))
    return lambda: make_source(args)


def missing_input_key(env, d):
    a = argv(env, d, "--input-key", "question")
    return lambda: parse_args(a)


def missing_label_key(env, d):
    args = source_args(env, write_rows(d / "train.jsonl", GOOD_ROWS), label_key="answer")
    return lambda: make_source(args)


def empty_dataset(env, d):
    a = argv(env, d, data=write_rows(d / "empty.jsonl", ["", "  "]))
    return lambda: parse_args(a)


def empty_slice(env, d):
    args = source_args(env, write_rows(d / "train.jsonl", GOOD_ROWS) + "@[5:]")
    return lambda: make_source(args)


def all_too_long(env, d):
    args = source_args(env, write_rows(d / "train.jsonl", GOOD_ROWS), rollout_max_prompt_len=2)
    return lambda: make_source(args)


def unknown_rm_type(env, d):
    a = argv(env, d, "--rm-type", "mathh")
    return lambda: parse_args(a)


def hook_does_not_import(env, d):
    (d / "broken_rm.py").write_text(
        "import os\nWEIGHTS = undefined_name\n\ndef broken_rm(args, sample):\n    return 1.0\n"
    )
    a = argv(env, d, "--custom-rm-path", "broken_rm.py")
    return lambda: parse_args(a)


def hook_missing_file(env, d):
    a = argv(env, d, "--custom-generate-function-path", "my_generate.py")
    return lambda: parse_args(a)


def hook_wrong_name(env, d):
    (d / "hooks.py").write_text("def generate(args, sample, sampling_params):\n    return sample\n")
    a = argv(env, d, "--custom-generate-function-path", "hooks.genrate")
    return lambda: parse_args(a)


def hook_wrong_signature_rollout(env, d):
    (d / "my_rollout.py").write_text("def my_rollout(args, rollout_id):\n    return []\n")
    a = argv(env, d, "--rollout-function-path", "my_rollout.py")
    return lambda: parse_args(a)


def hook_wrong_signature_rm(env, d):
    (d / "my_rm.py").write_text("async def score(sample):\n    return 1.0\n")
    a = argv(env, d, "--custom-rm-path", "my_rm.py:score")
    return lambda: parse_args(a)


def no_chat_template_at_parse(env, d):
    a = argv(env, d, "--apply-chat-template")
    a[a.index("--hf-checkpoint") + 1] = env.no_template_dir
    return lambda: parse_args(a)


def no_chat_template_at_load(env, d):
    args = source_args(env, write_rows(d / "train.jsonl", GOOD_ROWS), hf_checkpoint=env.no_template_dir,
                       apply_chat_template=True)  # fmt: skip
    return lambda: make_source(args)


def reward_raises(env, d):
    (d / "raising_rm.py").write_text("async def raising_rm(args, sample):\n    raise KeyError('no such field')\n")
    args = rollout_args(env, "ok", custom_rm_path=str(d / "raising_rm.py"))

    def call():
        from slime.rollout.sglang_rollout import build_sampling_params, check_failed_ratio, generate_and_rm
        from slime.utils.http_utils import run_sync
        from slime.utils.types import Sample

        params = build_sampling_params(args)
        samples = [run_sync(generate_and_rm(args, Sample(index=i, prompt="one two", label="two"), params))
                   for i in range(2)]  # fmt: skip
        assert all(s.status == Sample.Status.FAILED and "KeyError: 'no such field'" in s.metadata["error"]
                   for s in samples)  # fmt: skip
        check_failed_ratio(args, samples[:1], 100, "rollout 0")  # 1 of 100 failed: within 0.05, the run goes on
        check_failed_ratio(args, samples, 20, "rollout 0")  # 2 of 20: past it

    return call


def engine_http_500(env, d):
    return lambda: generate_once(env, "500")


def engine_not_json(env, d):
    return lambda: generate_once(env, "html")


def _checkpoint_folder(d: Path, latest: str, complete: tuple[int, ...], partial: tuple[int, ...]) -> str:
    root = d / "ckpt"
    root.mkdir()
    for i in complete:
        (root / f"iter_{i:07d}").mkdir()
        (root / f"iter_{i:07d}" / "config.json").write_text("{}")
        (root / f"iter_{i:07d}" / "model.safetensors").write_bytes(b"\0" * 8)
    for i in partial:
        (root / f"iter_{i:07d}").mkdir()
        (root / f"iter_{i:07d}" / "config.json").write_text("{}")  # the weights never got written
    (root / "latest_checkpointed_iteration.txt").write_text(latest)
    return str(root)


def load_partial_iteration(env, d):
    a = argv(env, d, "--load", _checkpoint_folder(d, "7", complete=(3,), partial=(7,)))
    return lambda: parse_args(a)


def load_missing_iteration(env, d):
    a = argv(env, d, "--load", _checkpoint_folder(d, "9", complete=(), partial=()))
    return lambda: parse_args(a)


def load_megatron_missing_iteration(env, d):
    root = _checkpoint_folder(d, "5", complete=(), partial=())
    (Path(root) / "iter_0000002").mkdir()
    (Path(root) / "iter_0000002" / "metadata.json").write_text("{}")

    def call():
        from slime.backends.megatron_utils.checkpoint import find_checkpoint

        find_checkpoint(root)

    return call


@dataclass(frozen=True)
class Case:
    name: str  # the bad input
    provoke: str  # how the case provokes it, through which code path
    setup: Callable[[Env, Path], Callable[[], None]]  # writes the inputs, returns the call that must raise
    expect: tuple[str, ...]  # substrings of the error: where (file:line / flag / value) and the fix
    error: type = Exception


CASES = [
    Case("malformed JSONL line", "parse_args, line 3 of --prompt-data is cut short", malformed_line_at_parse,
         ("bad.jsonl:3", "malformed JSON", "fix or delete this line"), SlimeArgumentError),
    Case("malformed JSONL line (past the rows parse_args reads)", "data source constructor, row 201",
         malformed_line_at_load, ("big.jsonl:201", "malformed JSON", "fix or delete this line"), ValueError),
    Case("missing --input-key", "parse_args --input-key question", missing_input_key,
         ("train.jsonl:1", "missing key 'question' (--input-key question)", "keys present: ['label', 'prompt']",
          "set --input-key to the key"), SlimeArgumentError),
    Case("missing --label-key", "data source constructor, label_key=answer", missing_label_key,
         ("train.jsonl:1", "missing key 'answer' (--label-key answer)", "keys present", "set --label-key"),
         ValueError),
    Case("empty dataset", "parse_args, --prompt-data has only blank lines", empty_dataset,
         ("--prompt-data", "empty.jsonl", "no prompts left", "the file has no rows", "give a JSONL file"),
         SlimeArgumentError),
    Case("empty dataset (row slice selects none)", "data source constructor, train.jsonl@[5:]", empty_slice,
         ("--prompt-data", "train.jsonl@[5:]", "the row slice selects no rows", "widen or drop the slice"),
         ValueError),
    Case("all prompts longer than --rollout-max-prompt-len", "data source constructor, limit 2 tokens",
         all_too_long, ("--prompt-data", "all 2 prompts are longer than --rollout-max-prompt-len=2",
                        "the shortest has 3", "raise --rollout-max-prompt-len", "to at least 3"), ValueError),
    Case("unknown --rm-type", "parse_args --rm-type mathh", unknown_rm_type,
         ("--rm-type mathh", "unknown reward type", "'math'", "--custom-rm-path"), SlimeArgumentError),
    Case("hook that does not import", "parse_args --custom-rm-path broken_rm.py (NameError at line 2)",
         hook_does_not_import, ("--custom-rm-path=broken_rm.py", "NameError", "broken_rm.py:2",
                                "fix the error in that module"), SlimeArgumentError),
    Case("hook file that does not exist", "parse_args --custom-generate-function-path my_generate.py",
         hook_missing_file, ("--custom-generate-function-path=my_generate.py", "FileNotFoundError",
                             "fix the path"), SlimeArgumentError),
    Case("hook with a misspelt name", "parse_args --custom-generate-function-path hooks.genrate",
         hook_wrong_name, ("--custom-generate-function-path=hooks.genrate", "no attribute 'genrate'",
                           "['generate']", "fix the name"), SlimeArgumentError),
    Case("hook with the wrong signature", "parse_args --rollout-function-path my_rollout.py: fn(args, rollout_id)",
         hook_wrong_signature_rollout, ("--rollout-function-path=my_rollout.py", "my_rollout(args, rollout_id)",
                                        "fn(args, rollout_id, data_source, evaluation=False)",
                                        "change its parameters"), SlimeArgumentError),
    Case("reward hook with the wrong signature", "parse_args --custom-rm-path my_rm.py:score: fn(sample)",
         hook_wrong_signature_rm, ("--custom-rm-path=my_rm.py:score", "score(sample)", "fn(args, sample)",
                                   "change its parameters"), SlimeArgumentError),
    Case("--apply-chat-template without a chat template", "parse_args, tokenizer files have no template",
         no_chat_template_at_parse, ("--apply-chat-template", "no-template", "has no chat template",
                                     "drop --apply-chat-template"), SlimeArgumentError),
    Case("--apply-chat-template without a chat template (loaded tokenizer)", "data source constructor",
         no_chat_template_at_load, ("--apply-chat-template", "has no chat template", "drop --apply-chat-template"),
         ValueError),
    Case("reward function that raises", "generate_and_rm against the local engine, then the failure ratio "
         "(end to end: test_train_e2e.py)", reward_raises,
         ("rollout 0: 2 samples failed", "--max-failed-ratio=0.05", "reward: KeyError: 'no such field'",
          "raise --max-failed-ratio"), RuntimeError),
    Case("engine answers HTTP 500", "generate against the local HTTP server", engine_http_500,
         ("/generate", "HTTP 500", "CUDA out of memory", "see the engine's log", "--use-fault-tolerance")),
    Case("engine answers malformed JSON", "generate against the local HTTP server (200, HTML body)",
         engine_not_json, ("/generate", "not JSON", "502 Bad Gateway", "SGLang's native /generate"),
         ValueError),
    Case("--load: latest names a partial iteration", "parse_args --load, iter 7 has no weights",
         load_partial_iteration, ("--load", "names iteration 7", "missing: the weights", "write 3",
                                  "Nothing was loaded or written"), SlimeArgumentError),
    Case("--load: latest names a missing iteration", "parse_args --load, iter 9 absent", load_missing_iteration,
         ("--load", "names iteration 9", "missing: the folder itself", "point --load at a complete checkpoint"),
         SlimeArgumentError),
    Case("--load (megatron): latest names a missing iteration", "megatron find_checkpoint",
         load_megatron_missing_iteration, ("--load", "names 5", "does not exist", "write 2"), FileNotFoundError),
]


# --- running a case ---------------------------------------------------------------------------------------------


def _snapshot(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in d.rglob("*") if "__pycache__" not in p.parts}  # fmt: skip


@contextlib.contextmanager
def _inside(d: Path):
    """cwd = d (plugins load from there) and sys.path restored afterwards."""
    cwd, path = os.getcwd(), list(sys.path)
    os.chdir(d)
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.path[:] = path


def run_case(case: Case, env: Env, d: Path) -> tuple[BaseException | None, list[str]]:
    """(the error the case's call raised, the files under d it created, changed or removed)."""
    d.mkdir(parents=True, exist_ok=True)
    with _inside(d):
        call = case.setup(env, d)
        before = _snapshot(d)
        error = None
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - the case's result
            error = e
        after = _snapshot(d)
    changed = sorted(set(after) ^ set(before)) + sorted(k for k in after if k in before and after[k] != before[k])
    return error, changed


@pytest.fixture(scope="module")
def env(tokenizer_dir, tmp_path_factory):
    e = make_env(str(tmp_path_factory.mktemp("env")), tokenizer_dir)
    yield e
    e.engine.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case, env, tmp_path):
    error, changed = run_case(case, env, tmp_path / "case")
    assert error is not None, f"{case.name}: no error raised"
    assert isinstance(error, case.error), f"{case.name}: {type(error).__name__}: {error}"
    message = str(error)
    missing = [s for s in case.expect if s not in message]
    assert not missing, f"{case.name}: {missing} not in: {message}"
    assert not (tmp_path / "case" / "save").exists(), f"{case.name}: --save folder was created"
    assert changed == [], f"{case.name}: files changed: {changed}"


def test_good_inputs_pass_the_same_checks(env, tmp_path):
    """The checks above refuse only what is wrong: hooks of the right shape, a template, a checkpoint folder
    whose marker names a complete iteration, and the default --input-key left to the data source."""
    d = tmp_path
    (d / "good_hooks.py").write_text(
        "async def generate(args, sample, sampling_params, evaluation=False):\n    return sample\n"
        "def rollout(args, rollout_id, data_source, evaluation=False):\n    return []\n"
        "def score(args, sample, **kwargs):\n    return 1.0\n"
        "class Source:\n    def __init__(self, args):\n        self.args = args\n"
    )
    ckpt = _checkpoint_folder(d, "3", complete=(3,), partial=(7,))
    with _inside(d):
        args = parse_args(argv(env, d, "--custom-generate-function-path", "good_hooks.generate",
                               "--rollout-function-path", "good_hooks.py:rollout",
                               "--custom-rm-path", "good_hooks.score", "--data-source-path", "good_hooks.Source",
                               "--apply-chat-template", "--load", ckpt))  # fmt: skip
        assert args.load == ckpt and args.apply_chat_template
        a = argv(env, d)
        del a[a.index("--input-key") : a.index("--input-key") + 2]  # default "input": not in the rows, not checked
        assert parse_args(a).input_key == "input"
    assert not (d / "save").exists()


def _markdown(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main() -> int:
    """Run every case and print the table; the exit status is the number of cases that did not hold."""
    import logging

    from tools.make_tiny_model import build_tokenizer

    logging.disable(logging.WARNING)  # the retries and FAILED samples log warnings: the table says it all
    root = Path(tempfile.mkdtemp(prefix="bad-inputs-"))
    build_tokenizer(str(root / "tokenizer"))
    env = make_env(str(root), str(root / "tokenizer"))
    bad = 0
    print("| bad input | error shown | nothing written/lost |")
    print("|---|---|---|")
    try:
        for i, case in enumerate(CASES):
            error, changed = run_case(case, env, root / f"case{i}")
            message = f"{type(error).__name__}: {error}" if error is not None else "(no error)"
            ok = (error is not None and isinstance(error, case.error)
                  and all(s in str(error) for s in case.expect))  # fmt: skip
            bad += not ok or bool(changed)
            written = "yes" if not changed else f"NO: {', '.join(changed)}"
            flag = "" if ok else " **(expected text missing)**"
            print(f"| {_markdown(case.name)} ({_markdown(case.provoke)}) | {_markdown(message)}{flag} | {written} |")
    finally:
        env.engine.close()
        shutil.rmtree(root, ignore_errors=True)
    return bad


if __name__ == "__main__":
    sys.exit(main())
