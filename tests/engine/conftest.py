"""Shared engine fixtures: tiny random-weight Hugging Face model folders, built once per test session."""

from __future__ import annotations

import os

# Must precede any import of the Triton kernels: lets the "triton" backend run on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.demo import build_tiny_model

TinyModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """`tiny_model_dir(arch, **build_tiny_model_kwargs)` -> folder; one build per distinct argument set."""
    built: dict[str, Path] = {}

    def build(arch: str = "LlamaForCausalLM", **kwargs: Any) -> Path:
        key = repr((arch, sorted(kwargs.items())))
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp(arch), arch, **kwargs)
        return built[key]

    return build


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir: TinyModelFactory) -> Path:
    """The default tiny Llama (untied embeddings, 2 layers, 4 query heads over 2 KV heads, vocab 512)."""
    return tiny_model_dir("LlamaForCausalLM")
