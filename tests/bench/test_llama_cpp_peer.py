"""The llama.cpp peer's continuous batching, against a stand-in for the `llama_cpp` module (the real one is
built from source by pip in minutes, too slow for the suite): every request gets exactly its tokens, each
sequence's positions run on without a gap or a repeat, prompts longer than a step's budget are prefilled in
chunks, a slot is cleared before it is given to the next request, and no step exceeds its token budget."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from conveyor.bench.llama_cpp_peer import LlamaCpp, gguf_path
from conveyor.bench.workload import BenchRequest

VOCAB = 64


def next_token(token: int) -> int:
    return (3 * token + 1) % VOCAB


class FakeLlamaCpp(ModuleType):
    """The calls the peer makes. The model's next token is next_token(the row's token), scored only where a
    row asks for logits; the cache is one list of tokens per sequence, kept in `histories` when cleared."""

    def __init__(self) -> None:
        super().__init__("llama_cpp")
        self.cache: dict[int, list[int]] = {}
        self.steps: list[int] = []  # tokens per llama_decode
        self.cleared: list[int] = []
        self.histories: list[list[int]] = []
        self.rows: dict[int, int] = {}  # batch row -> its token, for the logits asked of it

    def llama_backend_init(self) -> None: ...
    def llama_model_default_params(self) -> Any: return SimpleNamespace()
    def llama_model_load_from_file(self, path: bytes, params: Any) -> Any: return object()
    def llama_context_default_params(self) -> Any: return SimpleNamespace()
    def llama_init_from_model(self, model: Any, params: Any) -> Any: return object()
    def llama_model_get_vocab(self, model: Any) -> Any: return object()
    def llama_vocab_n_tokens(self, vocab: Any) -> int: return VOCAB
    def llama_model_size(self, model: Any) -> int: return 1234
    def llama_get_memory(self, ctx: Any) -> Any: return object()

    def llama_memory_seq_rm(self, memory: Any, seq: int, p0: int, p1: int) -> None:
        assert (p0, p1) == (-1, -1)
        self.cleared.append(seq)
        if self.cache.get(seq):
            self.histories.append(self.cache[seq])
        self.cache[seq] = []

    def llama_batch_init(self, n_tokens: int, embd: int, n_seq_max: int) -> Any:
        return SimpleNamespace(token=[0] * n_tokens, pos=[0] * n_tokens, n_seq_id=[0] * n_tokens,
                               seq_id=[[0] for _ in range(n_tokens)], logits=[False] * n_tokens, n_tokens=0)

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        self.steps.append(batch.n_tokens)
        self.rows = {}
        for i in range(batch.n_tokens):
            seq = batch.seq_id[i][0]
            assert batch.n_seq_id[i] == 1 and batch.pos[i] == len(self.cache[seq]), "positions run on"
            self.cache[seq].append(batch.token[i])
            if batch.logits[i]:
                self.rows[i] = batch.token[i]
        return 0

    def llama_get_logits_ith(self, ctx: Any, i: int) -> Any:
        logits = (ctypes.c_float * VOCAB)()
        logits[next_token(self.rows[i])] = 1.0
        self._keep = logits  # alive until the peer has read it
        return ctypes.cast(logits, ctypes.POINTER(ctypes.c_float))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeLlamaCpp:
    module = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    return module


def test_continuous_batching_over_slots(fake: FakeLlamaCpp) -> None:
    prompts = [[1, 2, 3], list(range(10, 30)), [40], [5, 6, 7, 8, 9, 10, 11]]  # 20 tokens > the budget of 8
    requests = [BenchRequest(request_id=f"r{i}", group="interactive", arrival_s=0.0, max_tokens=n,
                             prompt_token_ids=p)
                for i, (p, n) in enumerate(zip(prompts, [4, 3, 6, 2], strict=True))]
    llama = LlamaCpp(Path("model.gguf"), slots=2, max_len=64, batch_tokens=8, threads=1)
    result = llama.run(requests, prompts)
    assert [r.status for r in result.records] == ["completed"] * 4
    assert [r.output_tokens for r in result.records] == [4, 3, 6, 2]
    assert max(fake.steps) <= 8 and len(fake.cleared) == 4  # a clear per request, slots reused
    assert llama.weight_bytes == 1234
    # What each sequence fed: its prompt, then its greedy tokens but the last (sampled, never fed back).
    fed = sorted([*fake.histories, *fake.cache.values()])
    expected = []
    for prompt, n in zip(prompts, [4, 3, 6, 2], strict=True):
        tokens = list(prompt)
        for _ in range(n - 1):
            tokens.append(next_token(tokens[-1]))
        expected.append(tokens)
    assert fed == sorted(expected)


def test_only_gguf_models_and_an_installed_package(monkeypatch: pytest.MonkeyPatch, llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="runs GGUF files"):
        gguf_path(str(llama_dir))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    with pytest.raises(ValueError, match="needs the llama-cpp-python package"):
        LlamaCpp(Path("model.gguf"), slots=1, max_len=8, batch_tokens=8, threads=1)
