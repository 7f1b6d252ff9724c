"""vLLM's server routes: /health answers whether a worker could take work now, /version the package's
version, /tokenize and /detokenize in vLLM's shapes with the served model's tokenizer and chat template."""

from __future__ import annotations

import importlib.metadata
from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.clock import utcnow
from conveyor.core.store import workers
from tests.support.service import Service

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def test_health_is_503_until_a_worker_beats_then_200(service: Service, session: Session) -> None:
    response = service.http.get("/health")  # no key needed, like /healthz
    assert response.status_code == 503 and "no live worker" in response.json()["detail"]
    workers.register(session, "w1", hostname="h", pid=1, queues=["interactive"], now=utcnow())
    assert service.http.get("/health").status_code == 200
    stale = utcnow() - timedelta(seconds=service.settings.worker_dead_after_s + 1)
    workers.register(session, "w1", hostname="h", pid=1, queues=["interactive"], now=stale)
    assert service.http.get("/health").status_code == 503, "a silent worker cannot take work"


def test_version_is_the_package_version(service: Service) -> None:
    assert service.http.get("/version").json() == {"version": importlib.metadata.version("conveyor")}


def test_tokenize_a_prompt_as_the_tokenizer_does(alice: TestClient, prompt_tokenizer: PromptTokenizer,
                                                  ) -> None:
    expected = prompt_tokenizer.encode_prompt("The river is calm")
    body = alice.post("/tokenize", json={"prompt": "The river is calm", "return_token_strs": True}).json()
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["token_strs"] == prompt_tokenizer.token_strings(expected)
    assert isinstance(body["max_model_len"], int)
    bare = alice.post("/tokenize", json={"prompt": "The river is calm", "add_special_tokens": False}).json()
    assert bare["tokens"] == prompt_tokenizer.encode_prompt("The river is calm", add_special_tokens=False)
    assert bare["token_strs"] is None


def test_tokenize_messages_with_the_chat_template(alice: TestClient, prompt_tokenizer: PromptTokenizer,
                                                   ) -> None:
    body = alice.post("/tokenize", json={"messages": MESSAGES}).json()
    assert body["tokens"] == prompt_tokenizer.encode_messages(MESSAGES)
    assert body["count"] == prompt_tokenizer.count_messages(MESSAGES)  # what a chat job is charged
    plain = alice.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert plain["tokens"] == prompt_tokenizer.encode_messages(MESSAGES, add_generation_prompt=False)
    assert plain["tokens"] != body["tokens"]


def test_detokenize_inverts_tokenize(alice: TestClient, prompt_tokenizer: PromptTokenizer) -> None:
    ids = prompt_tokenizer.encode_prompt("The river is calm", add_special_tokens=False)
    body = alice.post("/detokenize", json={"tokens": ids}).json()
    assert body == {"prompt": prompt_tokenizer.decode(ids)}


def test_bad_requests_are_400s_naming_the_field(alice: TestClient, prompt_tokenizer: PromptTokenizer) -> None:
    vocab = prompt_tokenizer.vocab_size
    cases = [
        ("/detokenize", {"tokens": [1, vocab]}, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message"),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
         "tools[1].function.name"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs"),
        ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, None),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, None),
    ]
    for path, body, param in cases:
        response = alice.post(path, json=body)
        assert response.status_code == 400, (path, body, response.text)
        error = response.json()["error"]
        assert error["message"], (path, body)
        if param is not None:
            assert error["param"] == param, (path, body, error)


def test_another_model_is_404_and_a_key_is_required(service: Service, alice: TestClient) -> None:
    response = alice.post("/tokenize", json={"prompt": "hi", "model": "someone-else"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    served = service.settings.served_model_id()
    assert alice.post("/tokenize", json={"prompt": "hi", "model": served}).status_code == 200
    assert service.http.post("/tokenize", json={"prompt": "hi"}).status_code == 401
    assert service.http.post("/detokenize", json={"tokens": [1]}).status_code == 401
