"""The same requests through llama.cpp (the `llama-cpp-python` package: `pip install 'conveyor[llama-cpp]'`,
built from source by pip in minutes), on the same GGUF file, with continuous batching as
`llama-server --parallel N` does it: N sequence slots in one context, every step one `llama_decode` of a
batch holding each running sequence's next token and prompt chunks of the ones still prefilling, a finished
sequence's slot cleared and given to the next request. Greedy with EOS ignored (argmax of each sequence's
logits), as the engine's run.

`--peer llama.cpp`: the model must be a GGUF file (or package:DIST holding one); llama.cpp runs its own
quantized kernels on it with the bench's thread count.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.bench.peers import ProgressFn, _record
from conveyor.bench.records import RunResult
from conveyor.bench.workload import BenchRequest
from conveyor.engine.config import EngineConfig

NAME = "llama.cpp"


def gguf_path(model: str) -> Path:
    """The GGUF file behind the bench's --model; ValueError for a model that is not one."""
    from conveyor.checkpoints.sources import SourceKind, parse_source

    source = parse_source(model)
    if source.kind is not SourceKind.GGUF or source.path is None:
        raise ValueError(f"--peer {NAME} runs GGUF files; --model {model} is a {source.kind.value} source")
    return source.path


class LlamaCpp:
    """One llama.cpp model and context, sized for `slots` sequences of up to `max_len` tokens each."""

    def __init__(self, path: Path, *, slots: int, max_len: int, batch_tokens: int, threads: int) -> None:
        try:
            import llama_cpp
        except ImportError as exc:
            raise ValueError(f"--peer {NAME} needs the llama-cpp-python package (pip install "
                             "'conveyor[llama-cpp]': pip builds llama.cpp from source, minutes)") from exc
        self.lib: Any = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(),
                                                          llama_cpp.llama_model_default_params())
        if not self.model:
            raise ValueError(f"--peer {NAME}: llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = slots * max_len, slots
        params.n_batch = params.n_ubatch = batch_tokens
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # one cache shared by the slots, as llama-server's default
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(batch_tokens, 0, 1)
        self.batch_tokens, self.slots = batch_tokens, slots

    @property
    def weight_bytes(self) -> int:
        return int(self.lib.llama_model_size(self.model))

    def run(self, requests: list[BenchRequest], prompts: list[list[int]],
            progress: ProgressFn | None = None) -> RunResult:
        progress = progress or (lambda n: None)
        records = [_record(r, len(p)) for r, p in zip(requests, prompts, strict=True)]
        start = time.time()
        for rec in records:
            rec.arrival_time = start
        waiting = list(range(len(requests)))
        running: dict[int, _Slot] = {}  # slot -> its request
        free = list(range(self.slots))
        while waiting or running:
            while waiting and free:
                slot, index = free.pop(), waiting.pop(0)
                self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), slot, -1, -1)
                running[slot] = _Slot(index, prompts[index], requests[index].max_tokens)
                records[index].first_scheduled_time = time.time()
            sampled = self._step(running)
            now = time.time()
            for slot, token in sampled.items():
                seq = running[slot]
                seq.tokens.append(token)
                record = records[seq.index]
                record.first_token_time = record.first_token_time or now
                if len(seq.tokens) - len(prompts[seq.index]) >= seq.max_tokens:
                    record.finished_time, record.status = now, "completed"
                    record.output_tokens = seq.max_tokens
                    del running[slot]
                    free.append(slot)
                    progress(1)
        return RunResult(target=NAME, records=records, samples=[], start_time=start,
                         end_time=max(r.finished_time or start for r in records))

    def _step(self, running: dict[int, _Slot]) -> dict[int, int]:
        """One llama_decode: each decoding slot's last token, then prompt chunks within the batch's tokens;
        the next token of every slot whose logits were asked for."""
        batch, asked = self.batch, {}
        n = 0
        for slot, seq in sorted(running.items(), key=lambda item: not item[1].decoding):
            take = 1 if seq.decoding else min(len(seq.tokens) - seq.done, self.batch_tokens - n)
            for i in range(take):
                batch.token[n], batch.pos[n] = seq.tokens[seq.done + i], seq.done + i
                batch.n_seq_id[n], batch.seq_id[n][0] = 1, slot
                batch.logits[n] = seq.done + i == len(seq.tokens) - 1
                if batch.logits[n]:
                    asked[slot] = n
                n += 1
            seq.done += take
            if n == self.batch_tokens:
                break
        batch.n_tokens = n
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError(f"{NAME}: llama_decode failed")
        return {slot: self._argmax(i) for slot, i in asked.items()}

    def _argmax(self, row: int) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, row)  # [vocab] floats of batch row `row`
        return int(np.ctypeslib.as_array(logits, shape=(self.vocab_size,)).argmax())


class LlamaCppPeer:
    """The bench's llama.cpp peer: the engine's requests (tokenized by the model's own tokenizer, whose ids
    are the GGUF file's), as many slots as the engine's max_num_seqs, its token budget per step, torch's
    thread count."""

    def __init__(self, gguf: Path, folder: str, requests: list[BenchRequest], cfg: EngineConfig) -> None:
        import torch
        from transformers import AutoTokenizer

        from conveyor.bench.peers import token_ids

        self.requests = requests
        self.prompts = token_ids(requests, AutoTokenizer.from_pretrained(folder).encode)
        longest = max(len(p) + r.max_tokens for p, r in zip(self.prompts, requests, strict=True))
        self.llama = LlamaCpp(gguf, slots=min(cfg.max_num_seqs, len(requests)), max_len=longest,
                              batch_tokens=max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
                              threads=torch.get_num_threads())

    def run_round(self, console: Any) -> dict[str, RunResult]:
        del console
        result = self.llama.run(self.requests, self.prompts)
        result.weights = (self.llama.weight_bytes, "the GGUF file's own types")
        return {NAME: result}


class _Slot:
    def __init__(self, index: int, prompt: list[int], max_tokens: int) -> None:
        self.index, self.tokens, self.max_tokens = index, list(prompt), max_tokens
        self.done = 0  # tokens already in the cache

    @property
    def decoding(self) -> bool:
        """Every token but the last sampled one is in the cache."""
        return self.done == len(self.tokens) - 1
