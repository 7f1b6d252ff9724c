"""`python -m conveyor.engine --model PATH --prompt "..."`: generate from the command line.

`--demo` builds a tiny random-weight model in a temporary folder when no --model is given (gibberish text,
but the whole engine runs).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from conveyor.engine.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _demo_model(Path(tmp), args.demo)
        from conveyor.engine.llm import LLM

        llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                  num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
        )
        prompts = args.prompt or ["Hello"]
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outputs, strict=True):
            print(f"--- {prompt!r} -> {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
            print(out.text)


def _demo_model(folder: Path, demo: bool) -> str:
    if not demo:
        raise SystemExit("error: --model is required (or pass --demo for a tiny random model)")
    from conveyor.engine.demo import build_tiny_model

    return str(build_tiny_model(folder / "tiny-llama"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conveyor.engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local Hugging Face model folder")
    p.add_argument("--demo", action="store_true", help="build a tiny random model when --model is absent")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap the first prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    return p


if __name__ == "__main__":
    main()
