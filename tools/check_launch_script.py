"""Check a slime launch script against this implementation, without running anything.

    python tools/check_launch_script.py scripts/run-qwen3-4B.sh [more.sh ...]
    python tools/check_launch_script.py --all /path/to/slime        # its scripts/run-*.sh, scripts/low_precision/*.sh
    python tools/check_launch_script.py my-run.sh --env BASE_DIR=/data --gpus 4

The script runs in bash with the commands that would start or stop things replaced by stubs (`ray`, `python`,
`python3`, `pkill`, `sleep`, `nvidia-smi`, `ssh`, ...; `nvidia-smi -L` lists `--gpus` GPUs). The command line
the script hands to `train.py` / `train_async.py` (directly or through `ray job submit -- python3 train.py`) is
recorded, then parsed and validated by slime's parser exactly as `train.py --dry-run` would on a GPU machine
(`--dry-run-cuda` semantics). One line per script:

    OK            the command line parses and passes validation
    REFUSED       it parses, and validation refuses it: the reason and the fix
    PARSE ERROR   an unknown flag or a value of the wrong type
    NO TRAIN LINE the script exited (or finished) without calling train.py

The `--*-path` plugins are imported with the PYTHONPATH train.py would get: the one `ray job submit
--runtime-env-json '{"env_vars": {"PYTHONPATH": ...}}'` sets (slime's example scripts put their folder there),
else the script's environment's (`export PYTHONPATH=...`).

Paths that do not exist on this machine (`--hf-checkpoint`, `--prompt-data`, `--ref-load`, ...) are replaced by
small stand-ins (an HF folder with an empty config.json, a one-row JSONL with the script's keys), and the line
says which, so a script can be checked away from its data; `--strict-paths` checks the paths as given.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from slime.config.arguments import SlimeArgumentError, check_before_start, parse_command_line, validate_args  # noqa: E402
from train_async import check_async_args  # noqa: E402

ENTRY_POINTS = ("train.py", "train_async.py")
# Commands a launch script uses to start, stop or wait for things; each becomes a stub that does nothing.
SILENT = ("ray", "pkill", "killall", "sleep", "ssh", "scp", "pdsh", "mpirun", "pip", "pip3", "hf",
          "huggingface-cli", "wget", "rocm-smi", "ibstat", "ibv_devinfo")  # fmt: skip
# Environment a multi-node script insists on; defaults here when the caller's environment has none.
ENV_DEFAULTS = {"MASTER_ADDR": "127.0.0.1", "BASE_DIR": "/root", "BASE_FOLDER": "/root", "WORKER_IP": "127.0.0.1"}

_RECORDER = r'''
import json, os, re, subprocess, sys
name, argv = sys.argv[1], sys.argv[2:]
entries = {entries!r}


def runtime_env_pythonpath(before):
    """PYTHONPATH of `ray job submit --runtime-env-json`'s env_vars (Ray expands ${{VAR}} in them); None without."""
    for i, token in enumerate(before):
        if token.startswith("--runtime-env-json"):
            value = token.split("=", 1)[1] if "=" in token else (before[i + 1] if i + 1 < len(before) else "{{}}")
            try:
                path = (json.loads(value).get("env_vars") or {{}}).get("PYTHONPATH")
            except (ValueError, AttributeError):
                return None
            if path is not None:
                return re.sub(r"\$\{{(\w+)\}}", lambda m: os.environ.get(m.group(1), ""), str(path))
    return None


for i, token in enumerate(argv):
    if os.path.basename(token) in entries:
        path = runtime_env_pythonpath(argv[:i]) if name == "ray" else None
        path = os.environ.get("PYTHONPATH", "") if path is None else path
        path = os.pathsep.join(os.path.abspath(p) for p in path.split(os.pathsep) if p)
        with open(os.environ["SLIME_CHECK_RECORD"], "a") as f:
            f.write(json.dumps({{"entry": os.path.basename(token), "argv": argv[i + 1:], "pythonpath": path}}) + "\n")
        sys.exit(0)
if name in ("python", "python3") and argv[:1] == ["-c"]:
    sys.exit(subprocess.call([{python!r}] + argv))  # an inline expression a script may compute a value with
if name in ("pip", "pip3") and argv[:1] in (["list"], ["show"], ["freeze"]):
    sys.exit(subprocess.call([{python!r}, "-m", "pip"] + argv))  # read-only queries answer truthfully
if name == "nvidia-smi" and "-L" in argv:
    for i in range(int(os.environ["SLIME_CHECK_GPUS"])):
        print(f"GPU {{i}}: stand-in GPU (UUID: GPU-check-{{i}})")
'''


@dataclass
class Result:
    script: str
    status: str  # OK, REFUSED, PARSE ERROR, NO TRAIN LINE
    detail: str = ""
    entry: str = ""
    argv: list[str] = field(default_factory=list)
    stand_ins: list[str] = field(default_factory=list)
    note: str = ""  # how the script was run, when not as given
    pythonpath: str = ""  # the PYTHONPATH train.py would get, its `--*-path` plugins resolved with it


def make_stubs(folder: str) -> None:
    recorder = os.path.join(folder, "_record.py")
    with open(recorder, "w") as f:
        f.write(_RECORDER.format(entries=ENTRY_POINTS, python=sys.executable))
    for name in SILENT + ("python", "python3", "nvidia-smi"):
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(recorder)} {name} "$@"\n')
        os.chmod(path, 0o755)


def _short(line: str, most: int = 160) -> str:
    return line if len(line) <= most else line[: most // 2] + " ... " + line[-most // 2 :]


def capture(script: str, cwd: str, gpus: int, env: dict[str, str], timeout: float = 120) -> tuple[list[dict], str]:
    """Run `script` with the stubs first on PATH; the train.py calls it made, and the tail of its output."""
    with tempfile.TemporaryDirectory(prefix="slime-check-") as tmp:
        stubs = os.path.join(tmp, "bin")
        os.makedirs(stubs)
        make_stubs(stubs)
        record = os.path.join(tmp, "calls.jsonl")
        full_env = {**ENV_DEFAULTS, **os.environ, **env, "PATH": stubs + os.pathsep + os.environ.get("PATH", ""),
                    "SLIME_CHECK_RECORD": record, "SLIME_CHECK_GPUS": str(gpus)}  # fmt: skip
        try:
            proc = subprocess.run(["bash", os.path.abspath(script)], cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=timeout)  # fmt: skip
            tail = [_short(line) for line in (proc.stdout + proc.stderr).strip().splitlines()[-2:]]
            out = f"exit {proc.returncode}: " + " | ".join(tail)
        except subprocess.TimeoutExpired:
            out = f"did not finish in {timeout:.0f} s"
        calls = []
        if os.path.isfile(record):
            with open(record) as f:
                calls = [json.loads(line) for line in f if line.strip()]
        return calls, out


def _stand_in_hf(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("{}\n")  # config.json fields absent are not cross-checked against MODEL_ARGS
    return folder


def _stand_in_jsonl(path: str, args: argparse.Namespace, input_key: str, label_key: str | None) -> str:
    prompt = [{"role": "user", "content": "stand-in prompt"}] if args.apply_chat_template else "stand-in prompt"
    row = {input_key: prompt, **({label_key: "0"} if label_key else {})}
    with open(path, "w") as f:
        f.write(json.dumps(row) + "\n")
    return path


def replace_missing_paths(args: argparse.Namespace, folder: str) -> list[str]:
    """Point path flags whose target is missing here at stand-ins under `folder`; the flags replaced."""
    done = []

    def missing(path: str | None) -> bool:
        return bool(path) and not os.path.exists(path.split("@[")[0])

    if missing(args.hf_checkpoint):
        done.append(f"--hf-checkpoint {args.hf_checkpoint}")
        args.hf_checkpoint = _stand_in_hf(os.path.join(folder, "hf"))
    for dest in ("ref_load", "critic_load", "load"):
        value = getattr(args, dest, None)
        if dest != "load" and missing(value):  # a missing --load is a fresh run, not an error
            done.append(f"--{dest.replace('_', '-')} {value}")
            setattr(args, dest, _stand_in_hf(os.path.join(folder, dest)))
    if missing(args.prompt_data):
        done.append(f"--prompt-data {args.prompt_data}")
        args.prompt_data = _stand_in_jsonl(os.path.join(folder, "prompts.jsonl"), args, args.input_key, args.label_key)
    if args.eval_prompt_data:
        values = list(args.eval_prompt_data)
        for i, value in enumerate(values):
            if (len(values) == 1 or i % 2 == 1) and missing(value):
                done.append(f"--eval-prompt-data {value}")
                values[i] = _stand_in_jsonl(os.path.join(folder, f"eval{i}.jsonl"), args,
                                            args.eval_input_key or args.input_key, args.eval_label_key or args.label_key)
        args.eval_prompt_data = values
    return done


@contextlib.contextmanager
def on_sys_path(pythonpath: str):
    """`pythonpath`'s folders first on sys.path, as train.py started with it would have them; afterwards sys.path
    is restored and the modules imported from those folders are forgotten (the next script has its own)."""
    folders = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]
    saved, known = list(sys.path), set(sys.modules)
    sys.path[:0] = folders
    try:
        yield
    finally:
        sys.path[:] = saved
        roots = tuple(os.path.join(f, "") for f in folders)
        for name in set(sys.modules) - known:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if origin.startswith(roots):
                del sys.modules[name]


def check_argv(argv: list[str], entry: str = "train.py", strict_paths: bool = False,
               pythonpath: str = "") -> tuple[str, str, list[str]]:  # fmt: skip
    """(status, detail, stand-ins) for one train.py / train_async.py command line; `pythonpath` is the PYTHONPATH
    train.py would run with (its folders are searched for the `--*-path` plugins)."""
    try:
        parser, args = parse_command_line(argv)
    except SlimeArgumentError as e:
        return "PARSE ERROR", str(e), []
    with tempfile.TemporaryDirectory(prefix="slime-stand-ins-") as folder, on_sys_path(pythonpath):
        stand_ins = [] if strict_paths else replace_missing_paths(args, folder)
        args.dry_run = True  # validate as train.py --dry-run would, planning the GPU run the script is for
        args.dry_run_cuda = args.dry_run_cuda or not args.use_cuda
        try:
            validate_args(args, parser)
            if entry == "train_async.py":
                check_async_args(args)
            check_before_start(args)
        except SlimeArgumentError as e:
            return "REFUSED", str(e), stand_ins
    return "OK", "", stand_ins


def checkout_root(script: str) -> str | None:
    """The slime checkout a script belongs to: the nearest folder above it holding scripts/models/."""
    folder = os.path.dirname(os.path.abspath(script))
    while folder != os.path.dirname(folder):
        if os.path.isdir(os.path.join(folder, "scripts", "models")):
            return folder
        folder = os.path.dirname(folder)
    return None


def capture_as_copy(script: str, root: str, gpus: int, env: dict[str, str]) -> tuple[list[dict], str, str]:
    """Some of slime's scripts source their model file relative to where they expect to be copied
    (`${SCRIPT_DIR}/scripts/models/...`: the checkout's root; `${SCRIPT_DIR}/../scripts/models/...`: a folder
    one level below it). Run the script as a copy at each place, in a mirror of the checkout (links, nothing
    written to the checkout); the first place where it calls train.py wins."""
    out = ""
    for where in (".", "copy"):
        with tempfile.TemporaryDirectory(prefix="slime-mirror-") as mirror:
            for name in os.listdir(root):
                os.symlink(os.path.join(root, name), os.path.join(mirror, name))
            os.makedirs(os.path.join(mirror, where), exist_ok=True)
            copy = os.path.join(mirror, where, os.path.basename(script))
            with open(script) as src, open(copy, "w") as dst:
                dst.write(src.read())
            calls, out = capture(copy, mirror, gpus, env)
            if calls:
                place = os.path.join(root, os.path.basename(script)) if where == "." else f"a folder of {root}"
                return calls, f"run as a copy in {place} (where its `source` lines expect it)", out
    return [], "", out


def check_script(script: str, cwd: str | None = None, gpus: int = 8, env: dict[str, str] | None = None,
                 strict_paths: bool = False) -> Result:  # fmt: skip
    env = env or {}
    calls, out = capture(script, cwd or os.getcwd(), gpus, env)
    note = ""
    root = checkout_root(script)
    if not calls and root and "No such file or directory" in out:
        calls, note, out = capture_as_copy(script, root, gpus, env)
    if not calls:
        return Result(script, "NO TRAIN LINE", f"the script never called {' or '.join(ENTRY_POINTS)} ({out})")
    if not out.startswith("exit 0:"):  # e.g. a line missing its `\` ends the train.py command early
        note = "; ".join(filter(None, [note, f"the script failed after its train.py call ({out})"]))
    call = calls[-1]
    status, detail, stand_ins = check_argv(call["argv"], call["entry"], strict_paths, call["pythonpath"])
    return Result(script, status, detail, call["entry"], call["argv"], stand_ins, note, call["pythonpath"])


def slime_scripts(checkout: str) -> list[str]:
    found = glob.glob(os.path.join(checkout, "scripts", "run-*.sh"))
    found += glob.glob(os.path.join(checkout, "scripts", "low_precision", "*.sh"))
    return sorted(found)


def format_result(result: Result, root: str | None = None) -> str:
    name = os.path.relpath(result.script, root) if root else result.script
    line = f"{name}: {result.status}" + (f" ({result.entry})" if result.entry else "")
    if result.note:
        line += f" [{result.note}]"
    if result.detail:
        line += f"\n    {result.detail}"
    if result.stand_ins:
        line += "\n    stand-ins for paths missing here: " + ", ".join(result.stand_ins)
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("scripts", nargs="*", help="launch scripts to check")
    parser.add_argument("--all", metavar="SLIME_CHECKOUT", help="check scripts/run-*.sh and scripts/low_precision/*.sh "
                        "of a slime checkout; prints a table")  # fmt: skip
    parser.add_argument("--gpus", type=int, default=8, help="GPUs the stub nvidia-smi lists (default 8)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="environment for the script")
    parser.add_argument("--strict-paths", action="store_true", help="no stand-ins: missing paths are refused")
    parser.add_argument("--show-argv", action="store_true", help="print each recorded command line")
    opts = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in opts.env)
    scripts, cwd = list(opts.scripts), None
    if opts.all:
        scripts += slime_scripts(opts.all)
        cwd = opts.all
    if not scripts:
        parser.error("give launch scripts, or --all SLIME_CHECKOUT")
    results = [check_script(s, cwd, opts.gpus, env, opts.strict_paths) for s in scripts]
    for result in results:
        print(format_result(result, opts.all))
        if opts.show_argv and result.argv:
            print("    " + shlex.join(result.argv))
            print("    PYTHONPATH=" + result.pythonpath)
    counts = {s: sum(r.status == s for r in results) for s in ("OK", "REFUSED", "PARSE ERROR", "NO TRAIN LINE")}
    print(f"\n{len(results)} script(s): " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0 if counts["OK"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
