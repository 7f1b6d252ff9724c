"""Random LoRA adapters for a tiny base model, saved by PEFT itself (adapter_config.json and
adapter_model.safetensors), and PEFT's own greedy generation with one applied unmerged: the oracle the
engine's LoRA is held to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_peft_adapter(base: Path, out: Path, *, rank: int, alpha: float, targets: list[str], seed: int,
                      **config: Any) -> Path:
    """A LoRA adapter of `base` with random A and B (init_lora_weights=False: B is not zero, so the adapter
    changes the output), saved to `out`; `config` goes to peft.LoraConfig (e.g. use_rslora)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                      lora_dropout=0.0, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, lora)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: list[int],
                ) -> list[list[int]]:
    """transformers' greedy generate of each prompt with `adapter` applied unmerged (None: the base model),
    EOS stopping off."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outputs = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        with torch.no_grad():
            mask = torch.ones(1, len(prompt), dtype=torch.long)
            out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=mask, max_new_tokens=n,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs
