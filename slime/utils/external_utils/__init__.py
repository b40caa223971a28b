"""slime's launcher helpers for example and test scripts (`command_utils`, `typer_utils`): not part of a training
run; they build and run the shell commands that start one (docs/arguments.md says what differs from slime's)."""
