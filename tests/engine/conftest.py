"""Engine tests run the Triton backend on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before any Triton kernel module is imported; the model folders come from the
root conftest (tiny_model_dir, llama_dir).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
