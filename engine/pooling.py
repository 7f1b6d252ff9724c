"""Pooling: how an embedding engine turns a request's hidden states into one vector.

The settings come from the model folder when sentence-transformers saved it (`modules.json` names a
Transformer, a Pooling module and, optionally, a Normalize module; `sentence_bert_config.json` holds the
maximum length), else from defaults: an encoder pools its first token ([CLS], as BERT-style checkpoints
without a sentence-transformers config are trained to), a decoder its last token (the only one that has
seen the whole input); both normalise. EngineConfig.pooling and normalize_embeddings override them.

The ops work on a whole step at once: each chunk's rows reduced with tensor ops (`chunk_rows`), the rows
of a request's chunks combined on its sequence (`accumulate`), and the finished vectors divided, cut to
their `dimensions` and normalised together (`finish_embeddings`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from conveyor.engine.config import POOLING_METHODS, TASKS

# sentence-transformers' Pooling modes we compute, as its config names them: `pooling_mode_<name>: true` keys,
# or a newer `pooling_mode` string. Any other mode (max, weightedmean, ...) is refused by name.
ST_POOLING_MODES = {"cls_token": "cls", "cls": "cls", "mean_tokens": "mean", "mean": "mean",
                    "lasttoken": "last"}
ST_MODULES = ("Transformer", "Pooling", "Normalize")  # the module types we reproduce (by class name)
NO_LENGTH_LIMIT = 10**9  # transformers writes model_max_length ~1e30 for a tokenizer without a limit


@dataclass(frozen=True)
class PoolingConfig:
    method: str  # "cls" | "mean" | "last"
    normalize: bool  # the default of requests whose PoolingParams.normalize is None
    max_length: int | None  # sentence-transformers' max_seq_length: inputs longer are cut or refused
    lowercase: bool = False  # sentence-transformers' do_lower_case: text is lower-cased before tokenizing
    prompt: str = ""  # its default prompt, put before every text input (never before token ids)

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {POOLING_METHODS}, got {self.method!r}")

    @property
    def reads_every_token(self) -> bool:
        """Mean and CLS pooling need hidden states the prefix cache does not keep (every position, or the
        first): their requests compute their whole input. Last-token pooling may take cache hits."""
        return self.method != "last"


def has_sentence_transformers_config(model_dir: str | Path) -> bool:
    return (Path(model_dir) / "modules.json").is_file()


def resolve_task(requested: str, model_dir: str | Path, *, is_encoder: bool, has_lm_head: bool) -> str:
    """"generate" or "embed": `requested`, or for "auto" embed when the folder is a sentence-transformers
    one or the model is an encoder (core/protocol/model_task.py decides the same without torch). ValueError
    when a model that cannot generate (an encoder, a decoder saved without its LM head) is to generate."""
    if requested not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {requested!r}")
    if requested == "auto":
        return "embed" if is_encoder or has_sentence_transformers_config(model_dir) else "generate"
    if requested == "generate" and (is_encoder or not has_lm_head):
        kind = "an encoder" if is_encoder else "a decoder saved without its LM head"
        raise ValueError(f"task='generate': {model_dir} is {kind}; it serves embeddings (task='embed'), "
                         "not text")
    return requested


def pooling_config(model_dir: str | Path, *, is_encoder: bool, method: str | None = None,
                   normalize: bool | None = None) -> PoolingConfig:
    """The folder's pooling (or the defaults), with EngineConfig's `method` and `normalize` when given."""
    folder = read_sentence_transformers_config(model_dir)
    if folder is None:
        folder = PoolingConfig("cls" if is_encoder else "last", normalize=True, max_length=None)
    return replace(folder, method=method if method is not None else folder.method,
                   normalize=normalize if normalize is not None else folder.normalize)


def embedding_max_len(model_limit: int, pooling: PoolingConfig) -> int:
    """The longest input an embedding engine takes: the model's limit (EngineConfig.max_model_len when set,
    within the positions the model can use), capped at sentence-transformers' max_seq_length."""
    return min(model_limit, pooling.max_length) if pooling.max_length is not None else model_limit


def read_sentence_transformers_config(model_dir: str | Path) -> PoolingConfig | None:
    """The pooling a sentence-transformers folder describes; None when the folder is not one. ValueError
    for a pipeline the engine cannot reproduce (a Dense layer, max pooling, text rendered through a chat
    template, ...), naming what it holds."""
    path = Path(model_dir)
    if not has_sentence_transformers_config(path):
        return None
    modules = _read_json(path / "modules.json", list)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    unsupported = sorted(set(kinds) - set(ST_MODULES))
    if unsupported or "Pooling" not in kinds:
        raise ValueError(f"modules.json in {path}: the engine reproduces a Transformer, a Pooling and an "
                         f"optional Normalize module; this folder has {sorted(kinds)}")
    pooling_dir = path / str(kinds["Pooling"].get("path") or "1_Pooling")
    settings = _read_optional_json(path / "sentence_bert_config.json")
    _check_text_modality(settings, path)
    return PoolingConfig(
        method=_pooling_method(_read_json(pooling_dir / "config.json", dict), pooling_dir),
        normalize="Normalize" in kinds,
        max_length=_max_seq_length(settings, path),
        lowercase=settings.get("do_lower_case") is True,
        prompt=_default_prompt(path),
    )


def _check_text_modality(settings: dict[str, Any], path: Path) -> None:
    """sentence-transformers 6 sends text through the tokenizer's chat template when its modality_config
    has a "message" entry; the engine tokenizes text as it is."""
    modalities = settings.get("modality_config")
    if isinstance(modalities, dict) and "message" in modalities:
        raise ValueError(f"{path}/sentence_bert_config.json: modality_config 'message' (text rendered "
                         "through the chat template) is not supported; without that entry text is tokenized "
                         "as is")


def _max_seq_length(settings: dict[str, Any], path: Path) -> int | None:
    """sentence_bert_config.json's max_seq_length, or where sentence-transformers 6 keeps it: the tokenizer's
    model_max_length (ignored when it is the huge "no limit" value transformers writes)."""
    length = settings.get("max_seq_length")
    if length is None:
        length = _read_optional_json(path / "tokenizer_config.json").get("model_max_length")
    if isinstance(length, int) and not isinstance(length, bool) and 0 < length < NO_LENGTH_LIMIT:
        return length
    return None


def _default_prompt(path: Path) -> str:
    """The prompt sentence-transformers puts before every text by default (config's default_prompt_name)."""
    config = _read_optional_json(path / "config_sentence_transformers.json")
    name = config.get("default_prompt_name")
    prompts = config.get("prompts") or {}
    if name is None:
        return ""
    if not isinstance(prompts, dict) or not isinstance(prompts.get(name), str):
        raise ValueError(f"{path}/config_sentence_transformers.json: default_prompt_name {name!r} names no "
                         "prompt")
    return prompts[name]


def _pooling_method(config: dict[str, Any], pooling_dir: Path) -> str:
    """The one pooling mode a Pooling module's config.json enables (either form of the config)."""
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:
        modes = [key.removeprefix("pooling_mode_") for key, on in config.items()
                 if key.startswith("pooling_mode_") and on is True]
    if len(modes) != 1 or modes[0] not in ST_POOLING_MODES:
        raise ValueError(f"{pooling_dir}/config.json: pooling modes {sorted(modes)}; the engine supports "
                         "exactly one of cls, mean and lasttoken")
    if config.get("include_prompt", True) is not True:
        raise ValueError(f"{pooling_dir}/config.json: include_prompt false is not supported")
    return ST_POOLING_MODES[modes[0]]


def _read_optional_json(path: Path) -> dict[str, Any]:
    return _read_json(path, dict) if path.is_file() else {}


def _read_json(path: Path, kind: type) -> Any:
    if not path.is_file():
        raise ValueError(f"sentence-transformers folder: {path} is missing")
    data = json.loads(path.read_text())
    if not isinstance(data, kind):
        raise ValueError(f"sentence-transformers folder: {path} must hold a JSON {kind.__name__}")
    return data


# --- the ops -----------------------------------------------------------------------------------------


def chunk_rows(hidden: torch.Tensor, query_start_loc: torch.Tensor, seq_of_token: torch.Tensor, method: str
               ) -> torch.Tensor:
    """One fp32 row [S, H] per chunk of a step, from its hidden states hidden [T, H] (query_start_loc
    [S + 1] and seq_of_token [T] locate the chunks): mean: the sum of the chunk's rows (divided once the
    request is complete); cls: its first row; last: its last row."""
    if method == "mean":
        sums = torch.zeros(query_start_loc.shape[0] - 1, hidden.shape[1], device=hidden.device)  # [S, H]
        return sums.index_add_(0, seq_of_token, hidden.float())
    rows = query_start_loc[:-1] if method == "cls" else query_start_loc[1:] - 1  # [S]
    return hidden[rows.long()].float()  # [S, H]


def accumulate(pooled: torch.Tensor | None, row: torch.Tensor, start_pos: int, method: str
               ) -> torch.Tensor | None:
    """A request's pooled row [H] after one more chunk (starting at start_pos) gave `row` [H]; chunks come
    in order, and a preempted request starts again from None."""
    if method == "mean":
        return row if pooled is None else pooled + row
    if method == "cls":
        return row if start_pos == 0 else pooled
    return row  # last: the latest chunk's last row, the request's final one once its input is complete


def finish_embeddings(pooled: torch.Tensor, num_tokens: list[int], method: str, dimensions: list[int],
                      normalize: list[bool]) -> list[list[float]]:
    """The finished requests' vectors: pooled [F, H] (their accumulated rows over num_tokens tokens each),
    averaged for mean pooling, cut to each request's dimensions, L2-normalised where asked."""
    vectors = pooled.float()  # [F, H]
    if method == "mean":
        vectors = vectors / torch.tensor(num_tokens, dtype=torch.float32, device=vectors.device)[:, None]
    dims = torch.tensor(dimensions, device=vectors.device)  # [F]
    kept = torch.arange(vectors.shape[1], device=vectors.device)[None, :] < dims[:, None]  # [F, H]
    vectors = vectors * kept  # the cut components count for nothing in the norm
    norms = vectors.norm(dim=1, keepdim=True).clamp_min(1e-12)  # [F, 1]
    wanted = torch.tensor(normalize, dtype=torch.bool, device=vectors.device)[:, None]  # [F, 1]
    vectors = torch.where(wanted, vectors / norms, vectors)
    return [row[:d] for row, d in zip(vectors.cpu().tolist(), dimensions, strict=True)]
