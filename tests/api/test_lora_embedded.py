"""LoRA adapters through the whole service, embedded, over real HTTP: adapters declared under a registry model
are served under their own ids (each with its base as `parent` in /v1/models), answer what the engine answers
with the adapter applied (the offline LLM with the same adapter: the engine's parity with PEFT is
tests/engine/test_lora.py), run in the base model's lanes, show their own id on the job; an adapter limited to
some tenants does not exist for the others (404, a batch line's model_not_found); batch lines name them; an
adapter loaded at run time (the admin routes) serves requests without a restart, and unloading one is
refused while jobs that use it are queued or running."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conveyor.api.app import create_app
from conveyor.cli.api_server import load_tokenizers
from conveyor.core.settings import Settings
from conveyor.core.store.migrate import upgrade
from conveyor.engine import LLM, SamplingParams
from tests.support.live_server import WAIT_S, new_api_key, serving
from tests.support.lora_adapters import save_peft_adapter
from tests.support.openai_batches import run_batch

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=128, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
PROMPT = "The queue holds jobs until"
ADMIN = "admin-secret"
MAX_TOKENS = 12


@dataclass
class Service:
    url: str
    key: str
    database_url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0, timeout=WAIT_S)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {self.key}"}, timeout=WAIT_S)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={"Authorization": f"Bearer {self.key}"},
                          timeout=WAIT_S)

    def tenant(self, name: str) -> Service:
        return dataclasses.replace(self, key=new_api_key(self.database_url, name))


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("service-adapters")
    return {"support": save_peft_adapter(llama_dir, root / "support", rank=8, alpha=16,
                                         targets=["q_proj", "v_proj", "down_proj"], seed=11),
            "vip": save_peft_adapter(llama_dir, root / "vip", rank=4, alpha=8, targets=["o_proj", "up_proj"],
                                     seed=12)}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path, adapters: dict[str, Path],
            ) -> Iterator[Service]:
    from conveyor.worker.embedded import EmbeddedRuntime

    tmp = tmp_path_factory.mktemp("lora-embedded")
    url = f"sqlite:///{tmp / 'conveyor.db'}"
    upgrade(url)
    registry = {"llama": {"path": str(llama_dir), "adapters": {
        "support": str(adapters["support"]), "vip": {"path": str(adapters["vip"]), "tenants": ["alice"]}}}}
    settings = Settings(data_dir=tmp, database_url=url, models=registry, auth_enabled=True, admin_token=ADMIN,
                        reconcile_interval_s=0.2, dispatch_grace_s=0.5, worker_heartbeat_s=0.2,
                        cancel_poll_s=0.1, **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=load_tokenizers(settings),
                     runtime=runtime, token_stream=runtime.token_stream, session_factory=runtime.sessions)
    with serving(app) as base:
        yield Service(base, new_api_key(url, "alice"), url)


@pytest.fixture(scope="module")
def offline(llama_dir: Path, adapters: dict[str, Path]) -> dict[str | None, str]:
    """The engine's own greedy text for PROMPT with each adapter and with none."""
    llm = LLM(str(llama_dir), max_loras=2, num_kv_blocks=64, dtype="float32", attention_backend="torch")
    for name, path in adapters.items():
        llm.add_lora(name, str(path))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    names: list[str | None] = [None, "support", "vip"]
    outs = llm.generate([PROMPT] * len(names), params, lora=names)
    return {name: out.text for name, out in zip(names, outs, strict=True)}


def completion(client: openai.OpenAI, model: str) -> Any:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_adapters_are_listed_with_their_base_for_the_tenants_that_may_use_them(service: Service) -> None:
    cards = {card["id"]: card for card in service.get("/v1/models").json()["data"]}
    assert {name: card["parent"] for name, card in cards.items()} == {
        "llama": None, "support": "llama", "vip": "llama"}
    assert cards["support"]["max_model_len"] == cards["llama"]["max_model_len"]
    bob = service.tenant("bob")
    assert [card["id"] for card in bob.get("/v1/models").json()["data"]] == ["llama", "support"]
    assert bob.get("/v1/models/vip").status_code == 404
    assert service.get("/v1/models/vip").json()["parent"] == "llama"


def test_each_adapter_answers_as_the_engine_does_with_it(service: Service, offline: dict[str | None, str],
                                                         ) -> None:
    client = service.client()
    assert len({offline[None], offline["support"], offline["vip"]}) == 3, "the adapters change the output"
    for model, name in (("llama", None), ("support", "support"), ("vip", "vip")):
        answer = completion(client, model)
        assert (answer.model, answer.choices[0].text) == (model, offline[name])


def test_an_adapter_job_runs_in_the_base_lanes_and_shows_its_own_id(service: Service,
                                                                    offline: dict[str | None, str]) -> None:
    created = service.post("/v1/jobs", {"model": "support", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                        "temperature": 0, "ignore_eos": True})
    assert created.status_code == 202, created.text
    job = service.get(f"/v1/jobs/{created.json()['id']}?wait=60").json()
    assert (job["status"], job["model"], job["queue"]) == ("succeeded", "support", "interactive")
    assert job["result"]["text"] == offline["support"]
    queues = {(q["model"], q["name"]) for q in service.get("/v1/queues").json()["data"]}
    assert ("support", "interactive") not in queues and ("llama", "interactive") in queues


def test_an_adapter_limited_to_some_tenants_does_not_exist_for_others(service: Service) -> None:
    bob = service.tenant("bob-2")
    with pytest.raises(openai.NotFoundError) as caught:
        completion(bob.client(), "vip")
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "`vip` does not exist" in caught.value.body["message"]  # type: ignore[index]
    as_job = bob.post("/v1/jobs", {"model": "vip", "prompt": PROMPT})
    assert as_job.status_code == 404 and as_job.json()["error"]["code"] == "model_not_found"
    assert completion(bob.client(), "support").model == "support"


def test_batch_lines_name_adapters(service: Service, offline: dict[str | None, str]) -> None:
    line = {"method": "POST", "url": "/v1/completions"}
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    lines = [{**line, "custom_id": name, "body": {**body, "model": name}}
             for name in ("llama", "support", "vip")]
    carol = service.tenant("carol")  # may not use vip
    answers = run_batch(carol.client(), lines, "/v1/completions")
    assert {cid: out["choices"][0]["text"] for cid, out in answers.outputs.items()} == {
        "llama": offline[None], "support": offline["support"]}
    assert answers.outputs["support"]["model"] == "support"
    assert '"custom_id":"vip"' in answers.errors and "model_not_found" in answers.errors
    mine = run_batch(service.client(), lines[2:], "/v1/completions")
    assert mine.outputs["vip"]["choices"][0]["text"] == offline["vip"]


def test_a_worker_refuses_to_start_with_an_adapter_that_does_not_fit(tmp_path: Path, llama_dir: Path,
                                                                      tiny_model_dir: Callable[..., Path],
                                                                      ) -> None:
    from conveyor.engine import EngineConfig, EngineHost, LLMEngine
    from conveyor.worker.adapters import load_adapters

    other = tiny_model_dir("LlamaForCausalLM", hidden_size=48)
    stranger = save_peft_adapter(other, tmp_path / "stranger", rank=4, alpha=4, targets=["q_proj"], seed=3)
    settings = Settings(data_dir=tmp_path, models={"llama": {"path": str(llama_dir),
                                                            "adapters": {"stranger": str(stranger)}}})
    host = EngineHost(LLMEngine(EngineConfig(model=str(llama_dir), max_loras=1, num_kv_blocks=64)))
    try:
        with pytest.raises(ValueError, match=r"models\.llama\.adapters\.stranger: .*do not fit rank 4"):
            load_adapters(host, settings.for_model("llama"))
    finally:
        host.shutdown()


def admin(service: Service, path: str, body: dict[str, Any], token: str = ADMIN) -> httpx.Response:
    return httpx.post(service.url + path, json=body, headers={"Authorization": f"Bearer {token}"},
                      timeout=WAIT_S)


def park_a_job_naming(service: Service, lora: str) -> str:
    """A queued job that runs with `lora`, in a queue no worker consumes; returns its id."""
    from conveyor.core.clock import utcnow
    from conveyor.core.lanes import lane_of
    from conveyor.core.store import jobs
    from conveyor.core.store.database import make_db_engine, make_session_factory

    db_engine = make_db_engine(service.database_url)
    try:
        with make_session_factory(db_engine)() as session:
            new = jobs.NewJob(tenant_id="alice", queue=lane_of("llama", "parked"), prompt="x", messages=None,
                              params={"max_tokens": 1, "lora": lora}, meta=None, webhook=None,
                              idempotency_key=None, request_hash="h", prompt_tokens=1, ttl_s=None,
                              timeout_s=None)
            return jobs.add(session, new, utcnow()).id
    finally:
        db_engine.dispose()


def cancel_parked(service: Service, job_id: str) -> None:
    from sqlalchemy import text

    from conveyor.core.store.database import make_db_engine

    db_engine = make_db_engine(service.database_url)
    try:
        with db_engine.begin() as connection:
            connection.execute(text("UPDATE jobs SET status = 'cancelled' WHERE id = :id"), {"id": job_id})
    finally:
        db_engine.dispose()


def test_an_adapter_loaded_at_run_time_serves_at_once_and_unloads_once_no_job_uses_it(
        service: Service, adapters: dict[str, Path], offline: dict[str | None, str]) -> None:
    body = {"lora_name": "late", "lora_path": str(adapters["support"])}
    assert admin(service, "/v1/load_lora_adapter", body, token=service.key).status_code == 401  # a tenant key
    loaded = admin(service, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {"lora_name": "late", "model": "llama", "lora_path": body["lora_path"],
                             "tenants": None}
    for bad, status, field in (({**body}, 409, "lora_name"),
                               ({**body, "lora_name": "llama"}, 409, "lora_name"),
                               ({**body, "lora_name": "x", "model": "support"}, 422, "model"),
                               ({**body, "lora_name": "x", "model": "nope"}, 404, "model"),
                               ({**body, "lora_name": "x", "lora_path": "s3://"}, 422, "lora_path")):
        answer = admin(service, "/v1/load_lora_adapter", bad)
        assert (answer.status_code, answer.json()["error"]["field"]) == (status, field), answer.text

    assert completion(service.client(), "late").choices[0].text == offline["support"]  # no restart
    cards = {card["id"]: card["parent"] for card in service.get("/v1/models").json()["data"]}
    assert cards["late"] == "llama"

    parked = park_a_job_naming(service, "late")
    refused = admin(service, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert refused.status_code == 409 and "1 queued or running job(s)" in refused.json()["error"]["message"]
    cancel_parked(service, parked)
    unloaded = admin(service, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        completion(service.client(), "late")
    assert admin(service, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    configured = admin(service, "/v1/unload_lora_adapter", {"lora_name": "support"})
    assert configured.status_code == 409 and "declared in the configuration" in configured.text

    again = admin(service, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["vip"]),
                                                     "tenants": ["alice"]})
    assert again.status_code == 200, again.text
    assert completion(service.client(), "late").choices[0].text == offline["vip"]  # read again, not reused
    with pytest.raises(openai.NotFoundError):
        completion(service.tenant("dave").client(), "late")
    assert admin(service, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200


def test_a_retry_is_refused_once_the_adapter_is_no_longer_the_tenants(service: Service,
                                                                      adapters: dict[str, Path]) -> None:
    """A retry is admitted as a new submission is (issue 51, item 7): an adapter reloaded for tenant A alone
    refuses B's retry as it refuses B's new job. Before, the retry was a 202 and ran on A's adapter."""
    everyone = {"lora_name": "shared1", "lora_path": str(adapters["support"])}
    assert admin(service, "/v1/load_lora_adapter", everyone).status_code == 200
    later = {"model": "shared1", "prompt": PROMPT, "max_tokens": 2, "delay_s": 3600}  # scheduled: never runs
    owners = {"a": service.tenant("tenant-a"), "b": service.tenant("tenant-b")}
    old = {}
    for who, owner in owners.items():
        created = owner.post("/v1/jobs", later)
        assert created.status_code == 202, created.text
        old[who] = created.json()["id"]
        assert owner.post(f"/v1/jobs/{old[who]}/cancel", {}).json()["status"] == "cancelled"
    assert admin(service, "/v1/unload_lora_adapter", {"lora_name": "shared1"}).status_code == 200
    only_a = {**everyone, "tenants": ["tenant-a"]}
    assert admin(service, "/v1/load_lora_adapter", only_a).status_code == 200

    b = owners["b"]
    assert b.post("/v1/jobs", {**later, "delay_s": None}).status_code == 404  # a new job: no such model
    refused = b.post(f"/v1/jobs/{old['b']}/retry", {})
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"] == {"code": "not_retryable", "field": "id",
                                       "message": "id: the job's model 'shared1' is no longer served"}
    assert b.get(f"/v1/jobs/{old['b']}").json()["status"] == "cancelled"  # nothing changed
    retried = owners["a"].post(f"/v1/jobs/{old['a']}/retry", {})  # still A's to run
    assert retried.status_code == 202, retried.text
    job = owners["a"].get(f"/v1/jobs/{old['a']}?wait=60").json()
    assert (job["status"], job["model"]) == ("succeeded", "shared1"), job
    assert admin(service, "/v1/unload_lora_adapter", {"lora_name": "shared1"}).status_code == 200
