"""The LLM proxy against the stub engine (tests/stub_engine.py: the model is stubbed, the wire
format is vLLM's): exact token capture, streaming, routing, engine errors, auth."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pydantic
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from reins.gateway.store import tables
from tests.conftest import Gateway
from tests.stub_engine import DEFAULT_REPLY, StubEngine, decode, encode, render_chat


@pytest.fixture
def token(gateway: Gateway, stub: StubEngine) -> str:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}, {"rollout_id": "other"}])
    gateway.http.post("/api/rollouts/other/attempts")
    return str(gateway.http.post("/api/rollouts/r/attempts").json()["token"])


def proxy(gateway: Gateway, rollout: str = "r", attempt: int = 1, mode: str = "train") -> str:
    return f"{gateway.url}/proxy/rollout/{rollout}/attempt/{attempt}/mode/{mode}/openai/v1"


def calls(gateway: Gateway, rollout: str = "r") -> list[dict[str, Any]]:
    events = gateway.http.get(f"/api/rollouts/{rollout}/events").json()
    return [e["data"] for e in events if e["type"] == "model_request"]


MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_call_records_the_engines_token_ids_and_logprobs(
    gateway: Gateway, stub: StubEngine, token: str
) -> None:
    response = httpx.post(
        f"{proxy(gateway)}/chat/completions",
        json={"model": "anything", "messages": MESSAGES},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200
    (call,) = calls(gateway)
    assert call["prompt_token_ids"] == encode(render_chat(MESSAGES))
    assert call["response_token_ids"] == encode(DEFAULT_REPLY)
    assert len(call["response_logprobs"]) == len(call["response_token_ids"])
    assert call["response_logprobs"][0] == pytest.approx(-0.25)
    assert decode(call["response_token_ids"]) == response.json()["choices"][0]["message"]["content"]
    assert call["status"] == 200
    assert call["finish_reason"] == "stop"
    assert call["model"] == "policy"
    assert call["endpoint"] == stub.base_url
    assert call["request"] == {"model": "anything", "messages": MESSAGES}
    assert call["latency_s"] > 0


def test_recorded_calls_are_keyed_apart_in_few_characters(gateway: Gateway, token: str) -> None:
    """A call's idempotency key is stored in its row and again in the key index, beside the
    rollout's id: a uuid's 37 characters cost ~0.02x of the final sequence's bytes
    (`benchmarks/records.py`); 12 random characters (72 bits) keep an attempt's calls apart."""
    for _ in range(3):
        answer = httpx.post(
            f"{proxy(gateway)}/chat/completions",
            json={"model": "anything", "messages": MESSAGES},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert answer.status_code == 200
    events = gateway.http.get("/api/rollouts/r/events").json()
    keys = [e["idempotency_key"] for e in events if e["type"] == "model_request"]
    assert len(set(keys)) == 3 and [len(key) for key in keys] == [12, 12, 12], keys


def test_harness_sees_only_what_it_asked_for(gateway: Gateway, token: str) -> None:
    body = httpx.post(
        f"{proxy(gateway)}/chat/completions",
        json={"messages": MESSAGES},
        headers={"Authorization": f"Bearer {token}"},
    ).json()
    assert "prompt_token_ids" not in body
    assert "token_ids" not in body["choices"][0]
    assert body["choices"][0]["logprobs"] is None
    (call,) = calls(gateway)
    assert call["response"] == body


def test_harness_that_asks_for_logprobs_gets_them(gateway: Gateway, token: str) -> None:
    body = httpx.post(
        f"{proxy(gateway)}/chat/completions",
        json={"messages": MESSAGES, "logprobs": True},
        headers={"Authorization": f"Bearer {token}"},
    ).json()
    assert len(body["choices"][0]["logprobs"]["content"]) == len(encode(DEFAULT_REPLY))


def test_train_mode_applies_its_sampling_and_asks_for_token_ids(
    gateway: Gateway, stub: StubEngine, token: str
) -> None:
    httpx.post(
        f"{proxy(gateway)}/chat/completions",
        json={"model": "x", "messages": MESSAGES, "temperature": 0.2, "max_tokens": 7},
        headers={"Authorization": f"Bearer {token}"},
    )
    sent = stub.requests[-1]
    # Registered as "policy", asked for as "x": sent under the name the engine lists.
    assert sent["model"] == "stub"
    assert sent["temperature"] == 1.0
    assert sent["top_p"] == 1.0
    assert sent["max_tokens"] == 7
    assert sent["return_token_ids"] is True
    assert sent["logprobs"] is True


DISTRIBUTION_CHANGING = {
    "top_k": 5,
    "min_p": 0.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.2,
    "logit_bias": {"42": -100},
    "bad_words": ["no"],
    "allowed_token_ids": [1, 2, 3],
    "min_tokens": 4,
    "logits_processors": ["my.Processor"],
}


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_train_mode_drops_the_fields_that_change_the_distribution_and_notes_them(
    gateway: Gateway, stub: StubEngine, token: str, api: str
) -> None:
    """The tokens trained on are drawn from the probabilities trained with: a harness's field
    that truncates, reweights or masks the distribution never reaches the engine in train mode
    (val keeps them)."""
    base = proxy(gateway).removesuffix("/openai/v1")
    headers = {"Authorization": f"Bearer {token}"}
    if api == "chat":
        sampling = {**DISTRIBUTION_CHANGING, "top_p": 0.5}
        url, request = f"{base}/openai/v1/chat/completions", {"messages": MESSAGES, **sampling}
    else:
        url, request = f"{base}/anthropic/v1/messages", {"max_tokens": 8, "messages": MESSAGES}
        request["top_k"] = 5
    assert httpx.post(url, json={"model": "x", **request}, headers=headers).status_code == 200
    sent = stub.requests[-1]
    assert not set(DISTRIBUTION_CHANGING) & set(sent) and sent["top_p"] == 1.0
    notes = calls(gateway)[0]["notes"]
    dropped = list(DISTRIBUTION_CHANGING) if api == "chat" else ["top_k"]
    assert [note.split()[0] for note in notes if "own distribution" in note] == dropped
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "v", "mode": "val"}])
    val = proxy(gateway, "v", mode="val").removesuffix("/openai/v1") + url.removeprefix(base)
    admin = {"Authorization": f"Bearer {gateway.api_key}"}
    assert httpx.post(val, json={"model": "x", **request}, headers=admin).status_code == 200
    kept = {name: stub.requests[-1].get(name) for name in DISTRIBUTION_CHANGING}
    assert kept == (DISTRIBUTION_CHANGING if api == "chat" else {**dict.fromkeys(kept), "top_k": 5})


def test_val_mode_keeps_the_harness_sampling(gateway: Gateway, stub: StubEngine) -> None:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "v", "mode": "val"}])
    httpx.post(
        f"{proxy(gateway, 'v', mode='val')}/chat/completions",
        json={"messages": MESSAGES, "temperature": 0.2},
        headers={"Authorization": f"Bearer {gateway.api_key}"},
    )
    assert stub.requests[-1]["temperature"] == 0.2
    assert calls(gateway, "v")[0]["mode"] == "val"


def test_streamed_chat_passes_chunks_and_records_the_whole_call(
    gateway: Gateway, token: str
) -> None:
    texts, saw_done = [], False
    with httpx.stream(
        "POST",
        f"{proxy(gateway)}/chat/completions",
        json={"messages": MESSAGES, "stream": True},
        headers={"Authorization": f"Bearer {token}"},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line == "data: [DONE]":
                saw_done = True
                # The call is recorded before the stream ends.
                assert len(calls(gateway)) == 1
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "prompt_token_ids" not in chunk
                assert "token_ids" not in chunk["choices"][0]
                texts.append(chunk["choices"][0]["delta"].get("content") or "")
    assert saw_done
    (call,) = calls(gateway)
    assert "".join(texts) == DEFAULT_REPLY
    assert decode(call["response_token_ids"]) == DEFAULT_REPLY
    assert call["prompt_token_ids"] == encode(render_chat(MESSAGES))
    assert len(call["response_logprobs"]) == len(call["response_token_ids"])
    assert call["stream"] is True
    assert call["response"]["choices"][0]["message"]["content"] == DEFAULT_REPLY


def test_completions_with_a_token_id_prompt(gateway: Gateway, token: str) -> None:
    prompt = [10, 20, 30]
    body = httpx.post(
        f"{proxy(gateway)}/completions",
        json={"prompt": prompt, "max_tokens": 5},
        headers={"Authorization": f"Bearer {token}"},
    ).json()
    assert body["choices"][0]["text"] == DEFAULT_REPLY
    assert body["choices"][0]["logprobs"] is None
    (call,) = calls(gateway)
    assert call["prompt_token_ids"] == prompt
    assert call["response_token_ids"] == encode(DEFAULT_REPLY)
    assert len(call["response_logprobs"]) == len(encode(DEFAULT_REPLY))


def test_each_choice_is_recorded(gateway: Gateway, token: str) -> None:
    httpx.post(
        f"{proxy(gateway)}/chat/completions",
        json={"messages": MESSAGES, "n": 2},
        headers={"Authorization": f"Bearer {token}"},
    )
    recorded = calls(gateway)
    assert [c["choice_index"] for c in recorded] == [0, 1]
    assert decode(recorded[1]["response_token_ids"]) == f"{DEFAULT_REPLY} #1"


def test_models_lists_the_registered_models(gateway: Gateway, token: str) -> None:
    body = httpx.get(f"{proxy(gateway)}/models", headers={"Authorization": f"Bearer {token}"})
    assert [m["id"] for m in body.json()["data"]] == ["policy"]


def test_engine_error_reaches_the_harness_unchanged_and_is_recorded(
    gateway: Gateway, token: str
) -> None:
    response = httpx.post(
        f"{proxy(gateway)}/chat/completions",
        json={"messages": MESSAGES, "stub_status": 400},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 400
    assert response.json()["message"] == "stub failure"
    (call,) = calls(gateway)
    assert call["status"] == 400
    assert "stub failure" in call["error"]
    assert call["response_token_ids"] == []


def test_a_call_naming_a_registered_model_goes_there(gateway: Gateway, token: str) -> None:
    with StubEngine() as second:
        gateway.http.post("/api/models", json={"model": "judge", "endpoint": second.base_url})
        httpx.post(
            f"{proxy(gateway)}/chat/completions",
            json={"model": "judge", "messages": MESSAGES},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert len(second.requests) == 1
    assert calls(gateway)[0]["model"] == "judge"


def test_a_rollout_sticks_to_one_endpoint(gateway: Gateway, stub: StubEngine) -> None:
    with StubEngine() as second:
        gateway.http.post("/api/models", json={"model": "policy", "endpoint": second.base_url})
        gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
        ids = [f"s{i}" for i in range(12)]
        gateway.http.post("/api/rollouts", json=[{"rollout_id": rid} for rid in ids])
        admin = {"Authorization": f"Bearer {gateway.api_key}"}
        for rid in ids:
            for _ in range(3):
                httpx.post(
                    f"{proxy(gateway, rid)}/chat/completions",
                    json={"messages": MESSAGES},
                    headers=admin,
                )
        for rid in ids:
            assert len({c["endpoint"] for c in calls(gateway, rid)}) == 1
        used = {calls(gateway, rid)[0]["endpoint"] for rid in ids}
        assert used == {stub.base_url, second.base_url}


def test_an_unreachable_endpoint_is_retried_on_the_next(gateway: Gateway, stub: StubEngine) -> None:
    dead = "http://127.0.0.1:9/v1"
    gateway.http.post(
        "/api/models",
        json=[
            {"model": "policy", "endpoint": dead},
            {"model": "policy", "endpoint": stub.base_url},
        ],
    )
    gateway.http.post("/api/rollouts", json=[{"rollout_id": f"d{i}"} for i in range(6)])
    for i in range(6):
        response = httpx.post(
            f"{proxy(gateway, f'd{i}')}/chat/completions",
            json={"messages": MESSAGES},
            headers={"Authorization": f"Bearer {gateway.api_key}"},
        )
        assert response.status_code == 200
        assert calls(gateway, f"d{i}")[0]["endpoint"] == stub.base_url


def test_an_engine_that_stays_down_is_a_502_and_is_recorded(gateway: Gateway) -> None:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": "http://127.0.0.1:9/v1"})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    response = httpx.post(
        f"{proxy(gateway)}/chat/completions",
        json={"messages": MESSAGES},
        headers={"Authorization": f"Bearer {gateway.api_key}"},
        timeout=30,
    )
    assert response.status_code == 502
    assert "could not be reached" in response.json()["error"]["message"]
    assert calls(gateway)[0]["status"] == 502


def register_unchecked(gateway: Gateway, model: str, endpoints: list[str]) -> None:
    """Endpoints stored as a gateway stored them before `POST /api/models` checked them."""

    async def insert() -> None:
        engine = create_async_engine(gateway.settings.database_url)
        now = time.time()
        rows = [
            {"model": model, "endpoint": endpoint, "engine": "openai", "weight_version": 0,
             "created_at": now, "updated_at": now}
            for endpoint in endpoints
        ]  # fmt: skip
        try:
            async with engine.begin() as conn:
                await conn.execute(sa.insert(tables.models), rows)
        finally:
            await engine.dispose()

    asyncio.run(insert())


@pytest.mark.parametrize("bad", ["http://127.0.0.1:99999/v1", "http://[::1/v1"])
def test_an_endpoint_that_is_no_url_is_a_recorded_502_in_each_api(
    gateway: Gateway, bad: str
) -> None:
    """The registry took any `http://...` text (it refuses these now; a database registered
    before still holds them): one no request can go to was a bare 500 (an uncaught
    `InvalidURL`), and the call was not recorded."""
    register_unchecked(gateway, "policy", [bad])
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    admin = {"Authorization": f"Bearer {gateway.api_key}"}
    chat = httpx.post(
        f"{proxy(gateway)}/chat/completions", json={"messages": MESSAGES}, headers=admin
    )
    assert chat.status_code == 502
    assert f"endpoint {bad} is not a URL" in chat.json()["error"]["message"]
    message = httpx.post(
        f"{proxy(gateway).removesuffix('/openai/v1')}/anthropic/v1/messages",
        json={"model": "policy", "max_tokens": 5, "messages": MESSAGES},
        headers=admin,
    )
    assert message.status_code == 502
    assert message.json()["error"]["type"] == "api_error"
    recorded = calls(gateway)
    assert [(c["kind"], c["status"], c["endpoint"]) for c in recorded] == [
        ("chat", 502, bad),
        ("messages", 502, bad),
    ]


def test_an_endpoint_that_is_no_url_gives_way_to_the_models_next(
    gateway: Gateway, stub: StubEngine
) -> None:
    from reins.gateway.proxy import sticky_index

    bad = "http://127.0.0.1:99999/v1"
    register_unchecked(gateway, "policy", [bad, stub.base_url])
    endpoints = gateway.http.get("/api/models").json()[0]["endpoints"]
    # A rollout whose calls go to the bad endpoint first.
    rollout = next(f"b{i}" for i in range(100) if endpoints[sticky_index(f"b{i}", 2)] == bad)
    gateway.http.post("/api/rollouts", json=[{"rollout_id": rollout}])
    response = httpx.post(
        f"{proxy(gateway, rollout)}/chat/completions",
        json={"messages": MESSAGES},
        headers={"Authorization": f"Bearer {gateway.api_key}"},
    )
    assert response.status_code == 200
    assert [c["endpoint"] for c in calls(gateway, rollout)] == [stub.base_url]


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
@pytest.mark.parametrize("stream", ["false", "true", 1])
def test_a_stream_flag_that_is_no_boolean_is_refused_as_openai_refuses_it(
    gateway: Gateway, stub: StubEngine, token: str, path: str, stream: object
) -> None:
    """The engine reads `"false"` as false and answered whole, while the proxy, taking the
    string for a stream, relayed nothing and answered 502 blaming the engine (which the SDKs
    retried, generating again)."""
    body = {"messages": MESSAGES} if path == "chat/completions" else {"prompt": "Hi"}
    response = httpx.post(
        f"{proxy(gateway)}/{path}",
        json={**body, "stream": stream},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("stream: must be true or false")
    assert stub.requests == []


def test_no_registered_model_is_a_clear_404(gateway: Gateway) -> None:
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    response = httpx.post(
        f"{proxy(gateway)}/chat/completions",
        json={"messages": MESSAGES},
        headers={"Authorization": f"Bearer {gateway.api_key}"},
    )
    assert response.status_code == 404
    assert "POST /api/models" in response.json()["error"]["message"]


def test_a_token_cannot_call_for_another_attempt(gateway: Gateway, token: str) -> None:
    for path in (proxy(gateway, "other"), proxy(gateway, "r", attempt=2)):
        response = httpx.post(
            f"{path}/chat/completions",
            json={"messages": MESSAGES},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert response.status_code == 403
    assert calls(gateway, "other") == []


def test_the_admin_key_opens_a_missing_attempt(gateway: Gateway, stub: StubEngine) -> None:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "byhand"}])
    response = httpx.post(
        f"{proxy(gateway, 'byhand')}/chat/completions",
        json={"messages": MESSAGES},
        headers={"Authorization": f"Bearer {gateway.api_key}"},
    )
    assert response.status_code == 200
    detail = gateway.http.get("/api/rollouts/byhand").json()
    assert detail["rollout"]["status"]["state"] == "running"
    assert [a["attempt_id"] for a in detail["attempts"]] == [1]
    assert len(calls(gateway, "byhand")) == 1


def test_malformed_json_is_an_openai_style_400(gateway: Gateway, token: str) -> None:
    response = httpx.post(
        f"{proxy(gateway)}/chat/completions",
        content=b"{nope",
        headers={"Authorization": f"Bearer {token}", "content-type": "application/json"},
    )
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_the_weight_version_the_engine_reports_is_recorded(gateway: Gateway) -> None:
    with StubEngine(weight_version=7) as engine:
        gateway.http.post("/api/models", json={"model": "policy", "endpoint": engine.base_url})
        gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
        httpx.post(
            f"{proxy(gateway)}/chat/completions",
            json={"messages": MESSAGES},
            headers={"Authorization": f"Bearer {gateway.api_key}"},
        )
    assert calls(gateway)[0]["model_version"] == 7


def test_a_harness_that_hangs_up_mid_stream_frees_its_slot(gateway: Gateway, token: str) -> None:
    with httpx.stream(
        "POST",
        f"{proxy(gateway)}/chat/completions",
        json={"messages": MESSAGES, "stream": True, "stub_chunk_delay_s": 0.2},
        headers={"Authorization": f"Bearer {token}"},
    ) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 10
    while gateway.http.get("/api/admission").json()["in_flight"] != 0:
        assert time.monotonic() < deadline, "a dropped stream kept its admission slot"
        time.sleep(0.05)


def test_an_engine_answer_that_is_not_json_is_a_502(gateway: Gateway, token: str) -> None:
    response = httpx.post(
        f"{proxy(gateway)}/chat/completions",
        json={"messages": MESSAGES, "stub_raw": "<html>gateway timeout</html>"},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 502
    assert "not JSON" in response.json()["error"]["message"]
    assert calls(gateway)[0]["status"] == 502


def test_a_responses_request_refused_names_its_param(gateway: Gateway, token: str) -> None:
    response = httpx.post(
        f"{proxy(gateway)}/responses",
        json={"model": "x", "input": "hi", "max_output_tokens": 0},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_output_tokens"


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_usage_is_the_same_streamed_or_not_and_counted_when_the_engine_sends_none(
    gateway: Gateway, stub: StubEngine, token: str, api: str
) -> None:
    """The stub streams no usage; answered whole, it does unless told not to."""
    base = proxy(gateway).removesuffix("/openai/v1")
    headers = {"Authorization": f"Bearer {token}"}
    if api == "responses":
        url, request = f"{base}/openai/v1/responses", {"model": "x", "input": "hi"}
    else:
        url = f"{base}/anthropic/v1/messages"
        request = {"model": "x", "max_tokens": 64, "messages": MESSAGES}

    def usage(stream: bool) -> tuple[int, int]:
        response = httpx.post(url, json={**request, "stream": stream}, headers=headers)
        assert response.status_code == 200, response.text
        answer = calls(gateway)[-1]["response"]
        return (answer["usage"]["input_tokens"], answer["usage"]["output_tokens"])

    engines = usage(stream=False)
    assert engines[0] > 0 and engines[1] == len(encode(DEFAULT_REPLY))
    stub.app.state.usage = False
    assert usage(stream=False) == engines
    assert usage(stream=True) == engines


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_text_format_reaches_the_engine_as_its_response_format(
    gateway: Gateway, stub: StubEngine, token: str, stream: bool
) -> None:
    """A JSON schema in a Responses call's `text.format` reaches the engine as the chat
    `response_format` that the openai SDK's chat `.parse` sends, so the engine constrains the
    answer as it would for chat (the stub model does not: its requests are compared)."""

    class Colour(pydantic.BaseModel):
        colour: str

    client = openai.OpenAI(base_url=proxy(gateway), api_key=token, max_retries=0)
    chat = client.chat.completions.parse(
        model="x",
        messages=MESSAGES,
        response_format=Colour,
        extra_body={"stub_reply": '{"colour": "red"}'},
    )
    assert chat.choices[0].message.parsed == Colour(colour="red")
    asked = stub.requests[-1]["response_format"]
    assert asked["type"] == "json_schema" and asked["json_schema"]["name"] == "Colour"
    form = {"type": "json_schema", **asked["json_schema"]}
    if stream:
        events = client.responses.create(
            model="x", input="A colour?", text={"format": form}, stream=True
        )
        assert [event.type for event in events][-1] == "response.completed"
    else:
        client.responses.create(model="x", input="A colour?", text={"format": form})
    assert stub.requests[-1]["response_format"] == asked
    recorded = calls(gateway)[-1]
    assert recorded["kind"] == "responses" and recorded["request"]["text"]["format"] == form
    assert not recorded.get("notes")


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_streamed_call_is_recorded_with_the_logprobs_the_harness_asked_for(
    gateway: Gateway, token: str, kind: str
) -> None:
    """The recorded `response` is the answer as the harness received it: a stream whose harness
    asked for logprobs is assembled with them, as the same call answered whole is."""
    client = openai.OpenAI(base_url=proxy(gateway), api_key=token, max_retries=0)
    if kind == "chat":
        whole = client.chat.completions.create(model="x", messages=MESSAGES, logprobs=True)
        pieces = client.chat.completions.create(
            model="x", messages=MESSAGES, logprobs=True, stream=True
        )
        entries = [
            entry.model_dump()
            for chunk in pieces
            for choice in chunk.choices
            if choice.logprobs is not None
            for entry in choice.logprobs.content or ()
        ]
        assert len(entries) == len(encode(DEFAULT_REPLY))
        streamed: Any = {"content": entries}
        assert whole.choices[0].logprobs is not None
        answered: Any = whole.choices[0].logprobs.model_dump(exclude_none=True)
    else:
        answered = client.completions.create(model="x", prompt="hi", logprobs=0).choices[0]
        answered = answered.model_dump()["logprobs"]
        (chunk,) = client.completions.create(model="x", prompt="hi", logprobs=0, stream=True)
        streamed = chunk.choices[0].model_dump()["logprobs"]
    plain, stream = calls(gateway)
    assert plain["response"]["choices"][0]["logprobs"] == answered
    assert stream["response"]["choices"][0]["logprobs"] == streamed == answered
    # Not asked for: not shown, and not in the record (as a whole answer's `null`).
    list(client.chat.completions.create(model="x", messages=MESSAGES, stream=True))  # read whole
    assert "logprobs" not in calls(gateway)[-1]["response"]["choices"][0]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_no_registered_model_is_openais_model_not_found_code(gateway: Gateway, api: str) -> None:
    """OpenAI's API says it with `code: model_not_found`; a harness that checks `error.code`
    reads it so (not the status in `code` and the code in `type`)."""
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    client = openai.OpenAI(base_url=proxy(gateway), api_key=gateway.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        if api == "chat":
            client.chat.completions.create(model="x", messages=MESSAGES)  # type: ignore[arg-type]
        else:
            client.responses.create(model="x", input="hi", store=False)
    assert raised.value.code == "model_not_found"
    assert raised.value.type in ("invalid_request_error", "not_found_error")
    assert "no model is registered" in raised.value.message


def test_sticky_routing_spreads_a_groups_rollouts_over_the_engines() -> None:
    """`crc32(id) % n` is linear in the id's bits: the rollouts of a group (`...r1.0` to
    `...r1.3`) all went to one engine of two, and a step's to two engines of four."""
    from reins.gateway.proxy import sticky_index

    group = [f"run.t0.ant.r1.{k}" for k in range(4)]
    assert {sticky_index(rollout, 2) for rollout in group} == {0, 1}
    step = [
        f"run.t{p}.{w}.r1.{k}" for p, w in enumerate(["ant", "bee", "cat", "dog"]) for k in range(4)
    ]
    counts = [sum(sticky_index(rollout, 4) == engine for rollout in step) for engine in range(4)]
    assert min(counts) >= 2, counts
    assert sticky_index("run.t0.ant.r1.0", 3) == sticky_index("run.t0.ant.r1.0", 3)
