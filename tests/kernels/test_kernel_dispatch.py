"""The one dispatch point: Triton on CUDA, the C++ kernels (or the reference) on CPU, or as forced."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conveyor.kernels import paged_attention as dispatcher
from conveyor.kernels.paged_attention import (
    paged_attention,
    reshape_and_cache,
    resolve_backend,
)


def test_backend_resolution() -> None:
    assert resolve_backend(None, torch.device("cpu")) in ("cpu", "torch")
    assert resolve_backend(None, torch.device("cuda")) == "triton"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    assert resolve_backend("torch", torch.device("cuda")) == "torch"


def test_cpu_tensors_use_the_resolved_cpu_backend_by_default(paged_batch, monkeypatch) -> None:
    calls: list[str] = []
    chosen = resolve_backend(None, torch.device("cpu"))
    entry = {"cpu": "paged_attention_cpu", "torch": "paged_attention_ref"}[chosen]
    original = getattr(dispatcher, entry)

    def spy(*args, **kwargs):
        calls.append(chosen)
        return original(*args, **kwargs)

    monkeypatch.setattr(dispatcher, entry, spy)
    batch = paged_batch([2, 1], [6, 9], head_dim=16)
    paged_attention(*batch.args())
    assert calls == [chosen]


def test_forced_backends_agree_on_cpu(paged_batch) -> None:
    batch = paged_batch([3, 1], [8, 20], head_dim=16)
    torch_out = paged_attention(*batch.args(), backend="torch")
    triton_out = paged_attention(*batch.args(), backend="triton")
    assert (torch_out - triton_out).abs().max().item() <= 2e-5

    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    caches = [torch.zeros(2, 16, 2, 16) for _ in range(4)]
    reshape_and_cache(k, v, caches[0], caches[1], torch.tensor([3, 20]), backend="torch")
    reshape_and_cache(k, v, caches[2], caches[3], torch.tensor([3, 20]), backend="triton")
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_unknown_backend_is_a_value_error(paged_batch) -> None:
    batch = paged_batch([1], [4], head_dim=16)
    with pytest.raises(ValueError, match="backend"):
        paged_attention(*batch.args(), backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        reshape_and_cache(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), batch.k_cache, batch.v_cache,
                                  torch.tensor([0]), backend="flash")


def test_importing_kernels_does_not_import_triton() -> None:
    # CPU-only installs may lack triton: only a dispatch to the Triton backend may import it.
    code = "import sys, conveyor.kernels.paged_attention; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_forcing_the_cpu_backend_on_a_gpu_is_refused_at_resolution() -> None:
    with pytest.raises(ValueError, match="attention backend 'cpu' runs on CPU tensors; the device is cuda"):
        resolve_backend("cpu", torch.device("cuda"))
