"""`python -m slime.rollout.launch_sglang_router ARGS`: start sglang-router's Rust router, as
`python -m sglang_router.launch_router ARGS` does, without importing SGLang.

`sglang_router.launch_router` imports its Python debugging balancer (`sglang_router.mini_lb`) at the top, and that
imports all of SGLang (torch, transformers): with sglang-router 0.3.2 the router answered /health ~5 s of CPU after
its start instead of ~0.1 s, on every run. This launcher takes the same flags through the same parser
(`RouterArgs.add_cli_args`), renames the process `sglang::router` and starts the same `Router`; only `--mini-lb`
(the Python balancer, which needs SGLang) is handed to sglang-router's own launcher.
"""

from __future__ import annotations

import argparse
import sys

import setproctitle
from sglang_router.router import Router
from sglang_router.router_args import RouterArgs


def parse_router_args(argv: list[str]) -> RouterArgs:
    parser = argparse.ArgumentParser(description="sglang-router (see python -m sglang_router.launch_router --help)")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)


def main(argv: list[str] | None = None) -> None:
    router_args = parse_router_args(sys.argv[1:] if argv is None else argv)
    if router_args.mini_lb:  # only this path needs SGLang: imported here, never on the Rust router's start
        from sglang_router.launch_router import launch_router

        launch_router(router_args)
        return
    setproctitle.setproctitle("sglang::router")
    router_args._validate_router_args()
    Router.from_args(router_args).start()


if __name__ == "__main__":
    main()
