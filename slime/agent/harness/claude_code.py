"""The Claude Code harness (slime's `slime.agent.harness.claude_code`): `claude -p PROMPT` headless, talking to
the AnthropicAdapter (`ANTHROPIC_BASE_URL`; the session id rides as `ANTHROPIC_AUTH_TOKEN`).

Environment: SLIME_AGENT_NODE_TARBALL, SLIME_AGENT_CC_TARBALL (install); SLIME_AGENT_CC_EXTRA_ARGS (appended to
the command line), SLIME_AGENT_CC_EXTRA_ENVS (a JSON object merged last into the CLI's environment).
"""

from __future__ import annotations

import json
import shlex

from slime.agent.harness.common import BaseHarness, HarnessContext, host_file_from_env, install_npm_cli
from slime.agent.sandbox import Sandbox


class ClaudeCodeHarness(BaseHarness):
    name = "claude_code"
    cli_path = "/usr/local/bin/claude"
    cli_tarball_env = "SLIME_AGENT_CC_TARBALL"
    extra_args_env = "SLIME_AGENT_CC_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CC_EXTRA_ENVS"
    launch_flags = ("--permission-mode bypassPermissions --output-format stream-json --include-partial-messages "
                    "--include-hook-events --verbose")
    static_env = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
                  "CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}

    async def install_cli(self, sb: Sandbox) -> None:
        await install_npm_cli(
            sb, node_runtime=host_file_from_env(self.node_tarball_env, "the Node 22 tarball (node-v22.*.tar.xz)"),
            npm_package=host_file_from_env(self.cli_tarball_env, "the Claude Code CLI npm tarball"),
            check_cmd=f"ls -la {self.cli_path} && {self.cli_path} --version")

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Onboarding and the bypass-permissions prompt pre-acknowledged, so the CLI starts headless."""
        settings = shlex.quote(json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True}))
        await sb.exec(f"mkdir -p /home/agent/.claude && echo {settings} | tee /home/agent/.claude.json "
                      f"/home/agent/.claude/settings.json > /dev/null && "
                      f"chown -R agent:agent /home/agent/.claude /home/agent/.claude.json",
                      user="root", check=True, timeout=60)

    def base_command_and_env(self, ctx: HarnessContext, prompt: str) -> tuple[str, dict[str, str]]:
        cmd = f"{self.cli_path} -p {shlex.quote(prompt)} {self.launch_flags}"
        env = {"ANTHROPIC_BASE_URL": ctx.adapter_url, "ANTHROPIC_AUTH_TOKEN": ctx.session_id,
               "ANTHROPIC_MODEL": ctx.model_label, **self.static_env}
        return cmd, env
