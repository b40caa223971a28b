"""Agent rollouts (slime's `slime.agent`): token-capturing chat adapters, trajectories, sandboxes, harnesses.

What runs without outside services and what is refused is listed in docs/agent.md."""
