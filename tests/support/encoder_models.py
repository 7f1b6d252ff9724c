"""Tiny random BERT and XLM-RoBERTa checkpoints, saved as sentence-transformers folders.

The weights are random but the folders are real: transformers' own model classes write the weights with
`save_pretrained`, the tokenizers are real ones trained (deterministically) on the demo corpus (a WordPiece
vocabulary with [CLS] ... [SEP] for BERT, a Unigram one with <s> ... </s> for XLM-R), and
sentence-transformers writes its modules (Transformer, Pooling, optionally Normalize) itself.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

import torch

from conveyor.engine.demo import CORPUS

EncoderArch = Literal["bert", "xlm-roberta"]
TOKENIZER_VOCAB = 300  # a few hundred pieces: enough for the demo corpus to split into words and pieces
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4, as in BERT's vocabularies
XLMR_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # ids 0..4, as in XLM-R's: pad_token_id 1
TINY_SIZES: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64)


def build_encoder_st_folder(path: Path, *, arch: EncoderArch = "bert", pooling: str = "mean",
                            normalize: bool = True, max_seq_length: int = 128) -> Path:
    """A sentence-transformers folder at `path`: the HF model and tokenizer at its root, then Pooling
    (`pooling`: "mean", "cls", "max", "lasttoken") and, when `normalize`, a Normalize module."""
    from sentence_transformers import SentenceTransformer, models

    with tempfile.TemporaryDirectory() as hf_dir:
        save_encoder_checkpoint(Path(hf_dir), arch=arch)
        transformer = models.Transformer(hf_dir, max_seq_length=max_seq_length)
        modules: list[torch.nn.Module] = [
            transformer, models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
        if normalize:
            modules.append(models.Normalize())
        SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


def save_encoder_checkpoint(
    path: Path, *, arch: EncoderArch = "bert", seed: int = 0, **overrides: Any
) -> Path:
    """A plain HF folder (config.json, model.safetensors, tokenizer) of a tiny random encoder; `overrides`
    go to the transformers config (e.g. hidden_act, layer_norm_eps)."""
    tokenizer = train_tokenizer(arch)
    model = random_encoder(arch, len(tokenizer), seed=seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def random_encoder(arch: EncoderArch, vocab_size: int, *, seed: int = 0, **overrides: Any) -> Any:
    """transformers' BertModel / XLMRobertaModel, tiny, random, fp32, eval mode (no dropout)."""
    import transformers

    kwargs: dict[str, Any] = dict(TINY_SIZES, vocab_size=vocab_size, initializer_range=0.2)
    if arch == "bert":
        config: Any = transformers.BertConfig(**{**kwargs, "max_position_embeddings": 512, **overrides})
        model_class: Any = transformers.BertModel
    else:
        xlmr = dict(max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                    eos_token_id=2)
        config = transformers.XLMRobertaConfig(**{**kwargs, **xlmr, **overrides})
        model_class = transformers.XLMRobertaModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        _jitter_vectors(model)
    return model.to(torch.float32).eval()


@torch.no_grad()
def _jitter_vectors(model: torch.nn.Module) -> None:
    """Biases start at 0 and LayerNorm weights at 1; jitter them so that a wrong or missing mapping shows."""
    for param in model.parameters():
        if param.dim() == 1:
            param.add_(torch.randn_like(param) * 0.1)


def train_tokenizer(arch: EncoderArch) -> Any:
    """A transformers fast tokenizer: WordPiece for BERT, Unigram for XLM-R, trained on the demo corpus."""
    return _wordpiece_tokenizer() if arch == "bert" else _unigram_tokenizer()


def _wordpiece_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    pad, unk, cls, sep, mask = BERT_SPECIALS
    tok = Tokenizer(models.WordPiece(unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(BERT_SPECIALS),
                                        show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B {sep}",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, unk_token=unk, cls_token=cls,
                                   sep_token=sep, mask_token=mask)


def _unigram_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, pad, eos, unk, mask = XLMR_SPECIALS
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(XLMR_SPECIALS),
                                      unk_token=unk, show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   unk_token=unk, cls_token=bos, sep_token=eos, mask_token=mask)
