"""A random-weight BERT saved as a sentence-transformers folder: the embedding engine's tiny presets.

Its WordPiece vocabulary is whole words `w0`, `w1`, ..., so a text of N words is N tokens (the embed bench
builds its corpus from them); mean pooling, then Normalize, as `SentenceTransformer.save` lays it out.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def build_bert_st_folder(path: Path, *, vocab_size: int, seed: int = 0, **shape: int) -> Path:
    """A random BERT with a WordPiece vocabulary of whole words `w0`, `w1`, ..., saved as a
    sentence-transformers folder (mean pooling, then Normalize), as `SentenceTransformer.save` lays it out."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words])}
    core = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    BertTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                      sep_token="[SEP]", mask_token="[MASK]").save_pretrained(path)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=vocab_size, **shape)).save_pretrained(path)
    _write_st_files(path, hidden_size=shape["hidden_size"], max_seq_length=shape["max_position_embeddings"])
    return path


def _write_st_files(path: Path, *, hidden_size: int, max_seq_length: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}))
    (path / "2_Normalize").mkdir(exist_ok=True)
