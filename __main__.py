"""`python -m conveyor ...` is the `conveyor` command, for checkouts where the entry point is not
installed."""

from conveyor.cli.main import app

app(prog_name="conveyor")
