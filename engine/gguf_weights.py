"""A GGUF file's weights, dequantized by transformers' GGUF loader (the gguf package's dequantize, tensor
names mapped and llama's q/k rows un-permuted as transformers does), saved as model.safetensors into the
folder checkpoints/gguf_file.py wrote its metadata to. Kept in fp32 here: the engine casts on load."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

WEIGHTS_FILE = "model.safetensors"


def gguf_weights(gguf: Path, folder: Path) -> Path:
    """`folder`/model.safetensors from `gguf`, written once, under the folder's lock, to a temporary name and
    then renamed: a process killed halfway leaves no file that looks whole."""
    from filelock import FileLock

    target = folder / WEIGHTS_FILE
    if target.is_file():
        return target
    with FileLock(f"{folder}.lock"):
        if not target.is_file():
            partial = folder / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
            save_file(_dequantized(gguf, folder), str(partial), metadata={"format": "pt"})
            partial.replace(target)
    return target


def _dequantized(gguf: Path, folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its Hugging Face name (the model class, built on the meta device, is
    what transformers maps the names with). Tied embeddings: no lm_head, as Hugging Face saves them."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    return {name: tensor.contiguous() for name, tensor in tensors.items()}
