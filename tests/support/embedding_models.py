"""Tiny random decoders (Qwen2, Llama) saved as sentence-transformers folders, for the embedding tests.

The model is the demo builder's (engine/demo.py: transformers writes the checkpoint, the tokenizer is a real
byte-level BPE that adds <s>); sentence-transformers then saves it with a Pooling module and, optionally, a
Normalize one, as it saves real embedding models: the decoder without its LM head (`Qwen2Model`, tensor
names without `model.`), the pooling in `1_Pooling/config.json`, the maximum length with the tokenizer.

The chat template is left out: sentence-transformers 6 renders text through a tokenizer's chat template
when it has one (its "message" modality), which the engine does not reproduce (engine/pooling.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from conveyor.engine.demo import build_tiny_model

DecoderArch = Literal["qwen2", "llama"]
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def build_decoder_st_folder(path: Path, *, arch: DecoderArch = "qwen2", pooling: str = "lasttoken",
                            normalize: bool = True, max_seq_length: int = 128) -> Path:
    """A sentence-transformers folder at `path` around a tiny random decoder (hidden 64, 2 layers, vocab
    512); `pooling`: sentence-transformers' mode ("lasttoken", "mean", "cls")."""
    from sentence_transformers import SentenceTransformer, models

    with tempfile.TemporaryDirectory() as hf_dir:
        build_tiny_model(Path(hf_dir), ARCHITECTURES[arch], max_position_embeddings=256)
        _drop_chat_template(Path(hf_dir))
        transformer = models.Transformer(hf_dir, max_seq_length=max_seq_length)
        modules = [transformer, models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
        if normalize:
            modules.append(models.Normalize())
        SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


def _drop_chat_template(hf_dir: Path) -> None:
    """Re-saves the folder's tokenizer without its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    tokenizer.chat_template = None
    (hf_dir / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(str(hf_dir))
