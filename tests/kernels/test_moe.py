"""The MoE expert computation against a naive per-token oracle: the grouped reference, the Triton kernels
(under TRITON_INTERPRET=1, set by conftest.py), the host-side alignment, the counts, the dispatcher and the
input checks. Sizes stay tiny: the interpreter is slow."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
import triton

from conveyor.kernels import moe, triton_moe
from conveyor.kernels.moe import expert_token_counts, fused_moe, resolve_moe_backend
from conveyor.kernels.moe_reference import fused_moe_ref
from conveyor.kernels.triton_moe import MoeBlocks, align_by_expert, fused_moe_triton


@dataclass(frozen=True)
class MoeCase:
    x: torch.Tensor  # [T, H]
    w_gate_up: torch.Tensor  # [E, 2I, H]
    w_down: torch.Tensor  # [E, H, I]
    topk_weights: torch.Tensor  # [T, K]
    topk_ids: torch.Tensor  # [T, K]

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.x, self.w_gate_up, self.w_down, self.topk_weights, self.topk_ids)


def make_case(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, *,
    ids: list[list[int]] | None = None, dtype: torch.dtype = torch.float32, seed: int = 0,
) -> MoeCase:
    """Random weights scaled so every output is O(1); each token routed to `top_k` distinct random experts
    unless `ids` [T][K] is given."""
    gen = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = [torch.randperm(experts, generator=gen)[:top_k].tolist() for _ in range(tokens)]
    return MoeCase(
        x=torch.randn(tokens, hidden, generator=gen).to(dtype),
        w_gate_up=(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype),
        w_down=(torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype),
        topk_weights=torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1),
        topk_ids=torch.tensor(ids, dtype=torch.int64).reshape(tokens, top_k),
    )


def naive_moe(case: MoeCase) -> torch.Tensor:
    """[T, H] fp32: a loop over tokens and their k experts, each a plain F.linear SwiGLU in fp32."""
    x, w_gate_up, w_down = case.x.float(), case.w_gate_up.float(), case.w_down.float()
    inter = w_down.shape[2]
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for k in range(case.topk_ids.shape[1]):
            e = int(case.topk_ids[t, k])
            gate, up = F.linear(x[t], w_gate_up[e, :inter]), F.linear(x[t], w_gate_up[e, inter:])
            out[t] += float(case.topk_weights[t, k]) * F.linear(F.silu(gate) * up, w_down[e])
    return out


def assert_close(got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Max abs error within `tol` per unit of the output's magnitude (at least 1)."""
    assert got.shape == expected.shape
    scale = max(1.0, expected.abs().max().item())
    assert (got.float() - expected).abs().max().item() <= tol * scale


CASES = {
    "one token": lambda dtype: make_case(1, 32, 48, 4, 2, dtype=dtype),
    "ragged tokens, H and I off the blocks": lambda dtype: make_case(19, 40, 36, 6, 2, dtype=dtype),
    "idle experts, first and last among them": lambda dtype: make_case(
        12, 24, 20, 6, 2, ids=[[1, 4] if t % 2 else [4, 1] for t in range(12)], dtype=dtype),
    "every pair on one expert": lambda dtype: make_case(17, 24, 40, 5, 2, ids=[[3, 3]] * 17, dtype=dtype),
    "K=1, segments of several tiles": lambda dtype: make_case(20, 16, 24, 2, 1, dtype=dtype),
    "K=4": lambda dtype: make_case(13, 48, 32, 6, 4, dtype=dtype),
}


def duplicated_rows(dtype: torch.dtype) -> MoeCase:
    """Tokens 0, 5 and 9 equal in x and in routing: their outputs must be equal too."""
    case = make_case(10, 32, 24, 4, 2, dtype=dtype, seed=3)
    x, ids, weights = case.x.clone(), case.topk_ids.clone(), case.topk_weights.clone()
    for t in (5, 9):
        x[t], ids[t], weights[t] = x[0], ids[0], weights[0]
    return replace(case, x=x, topk_ids=ids, topk_weights=weights)


CASES["duplicated rows"] = duplicated_rows


# the grouped reference


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_the_naive_loop(name: str) -> None:
    case = CASES[name](torch.float32)
    assert_close(fused_moe_ref(*case.args()), naive_moe(case), 2e-6)


def test_reference_fp16_and_int32_ids_and_bf16_routing_weights(tolerance) -> None:
    case = CASES["K=4"](torch.float16)
    case = replace(case, topk_ids=case.topk_ids.int(), topk_weights=case.topk_weights.bfloat16())
    got = fused_moe_ref(*case.args())
    assert got.dtype == torch.float16
    assert_close(got, naive_moe(case), 2 * tolerance[torch.float16])  # the reference rounds h to fp16 too


def test_duplicated_rows_give_equal_outputs() -> None:
    """Equal to the last bits, not bitwise: a BLAS may block a matmul's rows by their position (seen on an
    AMD EPYC: row 9 of 16 one ulp away from row 0)."""
    case = duplicated_rows(torch.float32)
    for out in (fused_moe_ref(*case.args()), fused_moe_triton(*case.args())):
        for row in (5, 9):
            torch.testing.assert_close(out[row], out[0], rtol=1e-6, atol=1e-6)


def test_no_tokens_and_no_picks_give_zeros() -> None:
    empty = make_case(0, 16, 16, 3, 2)
    with_no_picks = make_case(4, 16, 16, 3, 0)
    for fn in (fused_moe_ref, fused_moe_triton):
        assert fn(*empty.args()).shape == (0, 16)
        assert torch.equal(fn(*with_no_picks.args()), torch.zeros(4, 16))


# the Triton kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_the_naive_loop(name: str, dtype: torch.dtype, tolerance) -> None:
    case = CASES[name](dtype)
    got = fused_moe_triton(*case.args())
    assert got.dtype == dtype
    assert_close(got, naive_moe(case), tolerance[dtype])


def test_triton_with_small_blocks_loops_over_column_tiles_and_reduction_steps(tolerance) -> None:
    case = make_case(19, 40, 36, 3, 2)  # 3 column tiles of 16 over H and I, 3 reduction steps, masked tails
    got = fused_moe_triton(*case.args(), blocks=MoeBlocks(16, 16, 16))
    assert_close(got, naive_moe(case), tolerance[torch.float32])


def test_triton_bf16_and_strided_inputs() -> None:
    case = make_case(9, 24, 20, 4, 2, dtype=torch.bfloat16)
    wide = torch.zeros(9, 48, dtype=torch.bfloat16)
    wide[:, ::2] = case.x  # x as a view with a column stride of 2
    case = replace(case, x=wide[:, ::2], topk_weights=case.topk_weights.half())
    assert_close(fused_moe_triton(*case.args()), naive_moe(case), 2e-2)


def test_alignment_pads_each_expert_to_whole_tiles() -> None:
    ids = torch.tensor([[2, 0], [2, 4], [0, 2], [2, 2], [4, 0]])  # pairs t * 2 + k; experts 1 and 3 idle
    sorted_pairs, tile_experts = align_by_expert(ids, 5, 4)
    # expert 0: pairs 1, 4, 9 (one tile); expert 2: 0, 2, 5, 6, 7 (two); expert 4: 3, 8 (one); padding = 10
    tiles = sorted_pairs.view(-1, 4).tolist()
    assert tiles[:4] == [[1, 4, 9, 10], [0, 2, 5, 6], [7, 10, 10, 10], [3, 8, 10, 10]]
    # the bound cdiv(10 + min(10, 5) * 3, 4) = 7 tiles, the last three past the last segment
    assert tile_experts.tolist() == [0, 2, 2, 4, -1, -1, -1]
    assert sorted_pairs.view(-1, 4)[4:].eq(10).all()


@pytest.mark.parametrize("block_m", [16, 32])
def test_alignment_tiles_hold_one_expert_each(block_m: int) -> None:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 7, (37, 3), generator=gen)
    sorted_pairs, tile_experts = align_by_expert(ids, 7, block_m)
    flat = ids.reshape(-1)
    assert sorted_pairs.shape == (tile_experts.shape[0] * block_m,)
    for tile, expert in enumerate(tile_experts.tolist()):
        pairs = [p for p in sorted_pairs[tile * block_m:(tile + 1) * block_m].tolist() if p < flat.numel()]
        assert (expert == -1) == (not pairs)
        assert all(int(flat[p]) == expert for p in pairs)
    assert sorted(p for p in sorted_pairs.tolist() if p < flat.numel()) == list(range(flat.numel()))


def test_bad_blocks_are_value_errors() -> None:
    case = make_case(2, 16, 16, 2, 1)
    with pytest.raises(ValueError, match=r"blocks\.block_k must be a power of 2"):
        fused_moe_triton(*case.args(), blocks=MoeBlocks(16, 16, 24))


# counts


def test_expert_token_counts() -> None:
    ids = torch.tensor([[0, 3], [3, 1], [3, 0]], dtype=torch.int32)
    counts = expert_token_counts(ids, 5)
    assert counts.dtype == torch.int64 and counts.tolist() == [2, 1, 0, 3, 0]
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 6, (20, 4), generator=gen)
    expected = Counter(ids.reshape(-1).tolist())
    assert expert_token_counts(ids, 6).tolist() == [expected[e] for e in range(6)]
    assert expert_token_counts(torch.zeros(0, 2, dtype=torch.int64), 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("bad", [[[0, 5]], [[-1, 0]]])
def test_expert_token_counts_refuses_ids_out_of_range(bad: list[list[int]]) -> None:
    with pytest.raises(ValueError, match=r"topk_ids values must lie in \[0, 5\)"):
        expert_token_counts(torch.tensor(bad), 5)


# the dispatcher


def test_backend_resolution() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_moe_backend(None, cpu) == resolve_moe_backend("auto", cpu) == "torch"
    assert resolve_moe_backend(None, cuda) == resolve_moe_backend("auto", cuda) == "triton"
    assert resolve_moe_backend("torch", cuda) == "torch"
    assert resolve_moe_backend("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_moe_backend("cpu", cpu)


@pytest.mark.parametrize(("backend", "expected"), [(None, "torch"), ("auto", "torch"), ("torch", "torch"),
                                                   ("triton", "triton")])
def test_dispatch_on_cpu_tensors(backend: str | None, expected: str, monkeypatch) -> None:
    calls: list[str] = []

    def spy(name: str, original):
        def call(*args: torch.Tensor) -> torch.Tensor:
            calls.append(name)
            return original(*args)
        return call

    monkeypatch.setattr(moe, "fused_moe_ref", spy("torch", fused_moe_ref))
    monkeypatch.setattr(triton_moe, "fused_moe_triton", spy("triton", fused_moe_triton))
    case = CASES["one token"](torch.float32)
    assert_close(fused_moe(*case.args(), backend=backend), naive_moe(case), 2e-5)
    assert calls == [expected]


def test_dispatch_refuses_unknown_backends_and_triton_on_cpu_without_the_interpreter(monkeypatch) -> None:
    case = CASES["one token"](torch.float32)
    with pytest.raises(ValueError, match="backend"):
        fused_moe(*case.args(), backend="cuda")
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        fused_moe(*case.args(), backend="triton")


def test_importing_the_moe_dispatcher_does_not_import_triton() -> None:
    code = "import sys, conveyor.kernels.moe; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# input checks


def _bad_inputs() -> dict[str, tuple[dict[str, torch.Tensor], str]]:
    """Each: the arguments replaced in a valid case (T=3, H=8, I=4, E=2, K=2) and the name in the error."""
    return {
        "x rank": ({"x": torch.zeros(3, 8, 1)}, "x must be"),
        "x dtype": ({"x": torch.zeros(3, 8, dtype=torch.int64)}, "x must be a floating"),
        "w_gate_up rank": ({"w_gate_up": torch.zeros(8, 8)}, "w_gate_up must be"),
        "w_down rank": ({"w_down": torch.zeros(2, 8)}, "w_down must be"),
        "2I": ({"w_gate_up": torch.zeros(2, 6, 8)}, r"w_gate_up rows \(6\) must be 2 \* I = 8"),
        "experts": ({"w_gate_up": torch.zeros(3, 8, 8)}, "w_gate_up has 3 experts"),
        "H of w_gate_up": ({"w_gate_up": torch.zeros(2, 8, 6)}, "w_gate_up hidden size 6"),
        "H of w_down": ({"w_down": torch.zeros(2, 6, 4)}, "w_down hidden size 6"),
        "weight dtype": ({"w_down": torch.zeros(2, 8, 4, dtype=torch.float16)}, "w_down dtype"),
        "weights rank": ({"topk_weights": torch.zeros(6)}, "topk_weights must be"),
        "weights T": ({"topk_weights": torch.zeros(4, 2), "topk_ids": torch.zeros(4, 2, dtype=torch.int64)},
                      "topk_weights must be"),
        "weights dtype": ({"topk_weights": torch.zeros(3, 2, dtype=torch.int64)},
                          "topk_weights must be floating"),
        "ids shape": ({"topk_ids": torch.zeros(3, 1, dtype=torch.int64)}, "topk_ids shape"),
        "ids dtype": ({"topk_ids": torch.zeros(3, 2)}, "topk_ids must be int32 or int64"),
        "device": ({"topk_ids": torch.zeros(3, 2, dtype=torch.int64, device="meta")}, "topk_ids is on meta"),
    }


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_bad_inputs_are_value_errors_naming_the_argument(name: str, backend: str) -> None:
    replaced, message = _bad_inputs()[name]
    case = make_case(3, 8, 4, 2, 2)
    with pytest.raises(ValueError, match=message):
        fused_moe(*replace(case, **replaced).args(), backend=backend)


def test_reference_refuses_expert_ids_out_of_range() -> None:
    case = make_case(3, 8, 4, 2, 2, ids=[[0, 1], [1, 2], [0, 1]])
    with pytest.raises(ValueError, match=r"topk_ids values must lie in \[0, 2\)"):
        fused_moe_ref(*case.args())
