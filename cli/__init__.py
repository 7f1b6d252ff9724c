"""The `conveyor` command line: the one place that wires api/ and worker/ together (see cli/main.py)."""
