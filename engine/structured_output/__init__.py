"""Structured outputs: what a constrained request asks for (constraint.py), its grammar compiled off the
stepping thread (compile_queue.py, grammar.py, tested first in a child process: probe.py), each request's
matcher (manager.py), and the batch's logits masked to what the grammars allow (mask.py)."""
