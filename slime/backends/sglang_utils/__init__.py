"""The SGLang rollout engine, at slime's path: `sglang_engine.SGLangEngine` launches real SGLang servers;
`arguments` checks and renders `--sglang-<flag>` flags against the installed sglang's own command line. The
trainer's side of SGLang's weight-update calls is `slime.weight_sync`. See docs/sglang_backend.md.

Importing this package imports none of its modules (slime's package does not either): import
`slime.backends.sglang_utils.sglang_engine` or `.arguments` by name. Neither imports sglang at import time.
"""
