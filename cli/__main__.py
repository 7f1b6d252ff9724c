"""`python -m cli ...` is the `conveyor` command, for checkouts where the entry point is not installed."""

from cli.main import app

app(prog_name="conveyor")
