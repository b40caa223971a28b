"""slime's launcher helpers for example and test scripts (`command_utils`, `typer_utils`): not part of a training
run; they build and run the shell commands that start one (docs/troubleshooting.md lists what is left out)."""
