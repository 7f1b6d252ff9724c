"""Admin schemas of LoRA adapters loaded at run time: loading one, unloading one, and the answer."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from conveyor.api.schemas.fields import STORABLE

AdapterName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"),
                        STORABLE]


class LoadLoraAdapter(BaseModel):
    """vLLM's request (`lora_name`, `lora_path`), plus the base model and the tenants that may use it."""

    model_config = ConfigDict(extra="forbid")

    lora_name: AdapterName = Field(description="the id clients send as `model`")
    lora_path: Annotated[str, Field(min_length=1, max_length=1024), STORABLE] = Field(
        description="a PEFT adapter folder the base model's workers can read, or s3://bucket/prefix/")
    model: Annotated[str, Field(min_length=1, max_length=128), STORABLE] | None = Field(
        None, description="the base model (a served model's id); unset = the default model")
    tenants: list[Annotated[str, Field(min_length=1, max_length=64), STORABLE]] | None = Field(
        None, max_length=1000, description="the tenants that may use it; unset = every tenant")


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: AdapterName


class LoraAdapterPublic(BaseModel):
    lora_name: str
    model: str = Field(description="its base model")
    lora_path: str
    tenants: list[str] | None
