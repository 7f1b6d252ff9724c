"""Hub ids, resolved with huggingface_hub into its cache: HF_HOME, HF_HUB_OFFLINE and HF_TOKEN are read by
huggingface_hub itself, as every Hugging Face tool reads them. Only the files the engine reads are fetched."""

from __future__ import annotations

from pathlib import Path

# The files of a model folder the API reads (config, tokenizer, chat template, sentence-transformers modules).
METADATA_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]
WEIGHT_PATTERNS = ["*.safetensors"]


def hub_snapshot(repo_id: str, *, revision: str | None = None, weights: bool = True) -> Path:
    """The local folder of `repo_id` at `revision` (None: main), downloaded into the Hugging Face cache
    unless it is there already; with weights=False, the metadata alone (the API's tokenizer)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from conveyor.checkpoints.sources import ModelSourceError

    patterns = METADATA_PATTERNS + (WEIGHT_PATTERNS if weights else [])
    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise ModelSourceError(f"model {repo_id!r}: a gated repository; accept its terms on the hub and set "
                               "HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"model {repo_id!r}: no such local folder, and no such repository on the "
                               "Hugging Face hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"model {repo_id!r}: the hub has no revision {revision!r}") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise ModelSourceError(
            f"model {repo_id!r}{at}: no such local folder, not in the Hugging Face cache ({_cache()}), and "
            f"the hub {_unreachable()}. Download it where the hub is reachable (`hf download {repo_id}`) "
            "into that cache (HF_HOME), or set the model to a local folder or GGUF file") from exc


def _cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _unreachable() -> str:
    from huggingface_hub import constants

    return "is off (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "cannot be reached"
