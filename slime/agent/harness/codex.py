"""The Codex harness (slime's `slime.agent.harness.codex`): `codex exec PROMPT`, talking to the OpenAIAdapter.
Codex reads a custom provider's base_url only from its config.toml (environment variables reach only its default
OpenAI provider), so the URL is written there; the session id rides as `OPENAI_API_KEY` (sent as the bearer).

Environment: SLIME_AGENT_NODE_TARBALL, SLIME_AGENT_CODEX_TARBALL (install); SLIME_AGENT_CODEX_EXTRA_ARGS,
SLIME_AGENT_CODEX_EXTRA_ENVS (a JSON object merged last).
"""

from __future__ import annotations

import base64
import shlex

from slime.agent.harness.common import BaseHarness, HarnessContext, host_file_from_env, install_npm_cli
from slime.agent.sandbox import Sandbox


class CodexHarness(BaseHarness):
    name = "codex"
    cli_path = "codex"
    cli_tarball_env = "SLIME_AGENT_CODEX_TARBALL"
    extra_args_env = "SLIME_AGENT_CODEX_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CODEX_EXTRA_ENVS"
    exec_flags = "--skip-git-repo-check"
    config_toml = ('model = "{model}"\nmodel_provider = "slime"\n\n[model_providers.slime]\nname = "slime"\n'
                   'base_url = "{base_url}"\nenv_key = "OPENAI_API_KEY"\nwire_api = "chat"\n')

    async def install_cli(self, sb: Sandbox) -> None:
        await install_npm_cli(
            sb, node_runtime=host_file_from_env(self.node_tarball_env, "the Node 22 tarball (node-v22.*.tar.xz)"),
            npm_package=host_file_from_env(self.cli_tarball_env, "the Codex CLI npm tarball"),
            check_cmd="codex --version")

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        toml = self.config_toml.format(model=ctx.model_label, base_url=f"{ctx.adapter_url}/v1")
        encoded = base64.b64encode(toml.encode()).decode()  # no quoting of the TOML through the shell
        await sb.exec(f"mkdir -p /home/agent/.codex && echo {encoded} | base64 -d > /home/agent/.codex/config.toml "
                      f"&& chown -R agent:agent /home/agent/.codex", user="root", check=True, timeout=60)

    def base_command_and_env(self, ctx: HarnessContext, prompt: str) -> tuple[str, dict[str, str]]:
        cmd = f"codex exec {self.exec_flags} {shlex.quote(prompt)}"
        return cmd, {"OPENAI_API_KEY": ctx.session_id, "OPENAI_BASE_URL": f"{ctx.adapter_url}/v1"}
