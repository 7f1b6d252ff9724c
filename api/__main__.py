"""`python -m api ...` is the `conveyor` command, for checkouts where the entry point is not installed."""

from api.cli import app

app(prog_name="conveyor")
