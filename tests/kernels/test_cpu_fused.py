"""The cpu backend's fused element-wise ops against the eager code transformers runs (and the model keeps)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.engine.models.llama import MLP, LlamaSettings, RMSNorm, apply_rotation
from conveyor.kernels.cpu_fused import rms_norm_cpu, rotate_half_cpu_, silu_and_mul_cpu

# fp32: a few ulps (one pass rounds once where eager rounds per op); half precision: one unit of the dtype.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_rms_norm_matches_eager(built, dtype, rows) -> None:
    torch.manual_seed(rows)
    eager = RMSNorm(96, 1e-5, dtype)
    eager.weight.data = torch.randn(96).to(dtype)
    x = (torch.randn(rows, 2 * 96) * 3).to(dtype)[:, :96]  # rows of a wider tensor: strided
    close(rms_norm_cpu(x, eager.weight, eager.eps), eager(x))


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_rotation_in_place_matches_eager_on_views_of_a_projection(built, dtype) -> None:
    torch.manual_seed(0)
    tokens, q_heads, kv_heads, dim = 70, 4, 2, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim).to(dtype)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (q_heads + kv_heads) * dim :].clone()
    angles = torch.randn(tokens, 1, dim) * 10
    rotation = angles.cos().to(dtype), angles.sin().to(dtype)
    expected_q, expected_k = apply_rotation(q, rotation), apply_rotation(k, rotation)
    got_q, got_k = apply_rotation(q, rotation, fused=True), apply_rotation(k, rotation, fused=True)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    close(got_q, expected_q)
    close(got_k, expected_k)
    if dtype != torch.float32:  # each product rounded to the dtype where eager rounds it: the same bits
        assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("rows", [1, 150])
def test_silu_and_mul_matches_eager(built, dtype, rows) -> None:
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 176) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(silu_and_mul_cpu(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_stays_finite_far_from_zero(built, dtype) -> None:
    """Gates of -1e4..1e4 (a real model's activations can reach them): exp(-gate) overflows to inf for
    gates below -88.7, which must give silu = 0, not NaN (it did: a reciprocal estimate of inf, under
    -ffast-math)."""
    gate = torch.linspace(-1e4, 1e4, 257).to(dtype)
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)]).unsqueeze(0)
    got = silu_and_mul_cpu(gate_up)
    assert torch.isfinite(got).all()
    close(got, F.silu(gate.unsqueeze(0)) * 3.0)


def test_the_mlp_gives_the_same_output_fused_or_not(built) -> None:
    settings = LlamaSettings.from_hf({
        "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4, "num_hidden_layers": 1,
        "vocab_size": 32, "max_position_embeddings": 64,
    }, torch.float32, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
    eager, fused = MLP(settings, fused=False), MLP(settings, fused=True)
    torch.manual_seed(0)
    eager.gate_up_proj.weight.data = torch.randn(2 * 176, 64) * 0.1
    eager.down_proj.weight.data = torch.randn(64, 176) * 0.1
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(9, 64)
    close(fused(x), eager(x))


def test_bad_inputs_are_refused_with_what_is_wrong(built) -> None:
    with pytest.raises(RuntimeError, match=r"weight must be contiguous \[8\]"):
        rms_norm_cpu(torch.ones(2, 8), torch.ones(6), 1e-6)
    with pytest.raises(RuntimeError, match="x must be 2-D with contiguous rows"):
        rms_norm_cpu(torch.ones(2, 8).t(), torch.ones(2), 1e-6)
    with pytest.raises(RuntimeError, match=r"cos and sin must be contiguous \[3, 8\]"):
        rotate_half_cpu_(torch.ones(3, 2, 8), torch.ones(3, 4), torch.ones(3, 4))
    with pytest.raises(RuntimeError, match="even head dimension"):
        rotate_half_cpu_(torch.ones(3, 2, 7), torch.ones(3, 7), torch.ones(3, 7))
    with pytest.raises(RuntimeError, match="gate_up's last dimension must be even"):
        silu_and_mul_cpu(torch.ones(2, 5))
