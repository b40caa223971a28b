"""Coding-agent CLIs run in a sandbox (Claude Code, Codex)."""

from slime.agent.harness.claude_code import ClaudeCodeHarness
from slime.agent.harness.codex import CodexHarness
from slime.agent.harness.common import BaseHarness, HarnessContext

__all__ = ["BaseHarness", "ClaudeCodeHarness", "CodexHarness", "HarnessContext"]
