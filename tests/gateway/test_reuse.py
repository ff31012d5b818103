"""Token reuse at the proxy (`reins.gateway.reuse`): which earlier call of an attempt a chat call
extends, what is sent, what is remembered and for how long."""

from __future__ import annotations

from typing import Any

import numpy as np

from reins.gateway.reuse import PREFIX_FIELD, ReuseMemory, TokenReuse
from reins.schemas import ModelRequest

KEY = ("r-1", 1)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": list(messages), **fields}


def remembered(
    memory: ReuseMemory, request: dict[str, Any], prompt: list[int], response: list[int]
) -> list[int] | None:
    """What `request` is prefixed with; then remembers it as answered (prompt, response)."""
    prefix, ticket = memory.prefix_for(KEY, request)
    assert ticket is not None
    memory.remember(ticket, prompt, response)
    return _ids(prefix)


def _ids(prefix: Any) -> list[int] | None:
    """A prefix as a list; it comes as the int32 array the proxy writes into the request."""
    if prefix is None:
        return None
    assert prefix.dtype == np.int32
    ids: list[int] = prefix.tolist()
    return ids


def test_a_call_that_extends_the_last_one_gets_its_prompt_and_response() -> None:
    memory = ReuseMemory()
    assert remembered(memory, chat(user("Hi")), [1, 2], [3, 4]) is None
    follow = chat(user("Hi"), assistant("Hello"), user("Bye"))
    assert remembered(memory, follow, [1, 2, 3, 4, 5], [6]) == [1, 2, 3, 4]
    third = chat(user("Hi"), assistant("Hello"), user("Bye"), assistant("Ciao"), user("?"))
    assert _ids(memory.prefix_for(KEY, third)[0]) == [1, 2, 3, 4, 5, 6]


def test_no_reuse_without_the_answer_turn_and_a_new_message() -> None:
    memory = ReuseMemory()
    remembered(memory, chat(user("Hi")), [1], [2])
    assert memory.prefix_for(KEY, chat(user("Hi"), user("Again")))[0] is None  # answer dropped
    assert memory.prefix_for(KEY, chat(user("Hi"), assistant("Hello")))[0] is None  # nothing new
    assert memory.prefix_for(KEY, chat(user("Hi")))[0] is None  # a retry


def test_an_edited_earlier_message_or_other_tools_get_no_reuse() -> None:
    memory = ReuseMemory()
    remembered(memory, chat(user("Hi"), tools=TOOLS), [1], [2])
    assert (
        memory.prefix_for(KEY, chat(user("Hey"), assistant("x"), user("y"), tools=TOOLS))[0] is None
    )
    assert memory.prefix_for(KEY, chat(user("Hi"), assistant("x"), user("y")))[0] is None
    assert _ids(
        memory.prefix_for(KEY, chat(user("Hi"), assistant("x"), user("y"), tools=TOOLS))[0]
    ) == [
        1,
        2,
    ]


def test_another_attempt_gets_no_reuse() -> None:
    memory = ReuseMemory()
    remembered(memory, chat(user("Hi")), [1], [2])
    assert memory.prefix_for(("r-1", 2), chat(user("Hi"), assistant("x"), user("y")))[0] is None


def test_of_two_branches_the_longest_matching_history_wins() -> None:
    memory = ReuseMemory()
    remembered(memory, chat(user("Hi")), [1], [2])
    remembered(memory, chat(user("Sub-task")), [7], [8])  # a sub-agent's own conversation
    remembered(memory, chat(user("Hi"), assistant("a"), user("b")), [1, 2, 3], [4])
    request = chat(user("Hi"), assistant("a"), user("b"), assistant("c"), user("d"))
    assert _ids(memory.prefix_for(KEY, request)[0]) == [1, 2, 3, 4]
    assert _ids(memory.prefix_for(KEY, chat(user("Sub-task"), assistant("s"), user("t")))[0]) == [
        7,
        8,
    ]


def test_memory_is_bounded_by_attempts_and_tokens() -> None:
    memory = ReuseMemory(attempts=2, per_attempt=2, max_tokens=10)
    for number in range(3):
        _, ticket = memory.prefix_for((f"r-{number}", 1), chat(user("Hi")))
        assert ticket is not None
        memory.remember(ticket, [1, 2], [3])
    assert memory.prefix_for(("r-0", 1), chat(user("Hi"), assistant("x"), user("y")))[0] is None
    assert _ids(memory.prefix_for(("r-2", 1), chat(user("Hi"), assistant("x"), user("y")))[0]) == [
        1,
        2,
        3,
    ]
    assert memory.tokens == 6
    _, ticket = memory.prefix_for(("r-3", 1), chat(user("Hi")))
    assert ticket is not None
    memory.remember(ticket, list(range(9)), [9])
    assert memory.tokens == 10  # the other attempts went first


def record(request: dict[str, Any], prompt: list[int], response: list[int]) -> ModelRequest:
    return ModelRequest.model_construct(
        request=request, prompt_token_ids=prompt, response_token_ids=response, status=200
    )


def test_the_proxy_side_sends_the_prefix_and_records_the_engines_word() -> None:
    reuse = TokenReuse()
    first = chat(user("Hi"))
    sent = dict(first)
    reuse.prepare(KEY, first, sent, "http://engine/v1")
    assert PREFIX_FIELD not in sent
    reuse.answered(first, "http://engine/v1", None)
    records = [record(first, [1, 2], [3])]
    reuse.recorded(records)
    assert records[0].model_dump()["token_reuse"] == "none"

    second = chat(user("Hi"), assistant("x"), user("y"))
    sent = dict(second)
    reuse.prepare(KEY, second, sent, "http://engine/v1")
    assert _ids(sent[PREFIX_FIELD]) == [1, 2, 3]
    reuse.answered(second, "http://engine/v1", "reused")
    records = [record(second, [1, 2, 3, 4], [5])]
    reuse.recorded(records)
    assert records[0].model_dump()["token_reuse"] == "reused"


def test_a_null_n_is_one_choice_and_reused_several_are_not() -> None:
    """The openai SDK sends `n=None` as null: one choice, as absent, so the call is reused;
    a call for several choices is not."""
    for n, reused in [(None, True), (1, True), (2, False)]:
        reuse = TokenReuse()
        first = chat(user("Hi"))
        reuse.prepare(KEY, first, dict(first), "http://engine/v1")
        reuse.recorded([record(first, [1], [2])])
        second = chat(user("Hi"), assistant("x"), user("y"), n=n)
        sent = dict(second)
        reuse.prepare(KEY, second, sent, "http://engine/v1")
        assert (_ids(sent.get(PREFIX_FIELD)) == [1, 2]) is reused, n


def test_an_engine_that_ignores_the_field_is_not_sent_it_again() -> None:
    reuse = TokenReuse()
    first = chat(user("Hi"))
    reuse.prepare(KEY, first, dict(first), "http://vllm/v1")
    reuse.recorded([record(first, [1], [2])])
    second = chat(user("Hi"), assistant("x"), user("y"))
    sent = dict(second)
    reuse.prepare(KEY, second, sent, "http://vllm/v1")
    assert _ids(sent[PREFIX_FIELD]) == [1, 2]
    reuse.answered(second, "http://vllm/v1", None)  # no header: it does not know the field
    records = [record(second, [1, 2, 3], [4])]
    reuse.recorded(records)
    assert records[0].model_dump()["token_reuse"] == "none"
    third = chat(user("Hi"), assistant("x"), user("y"), assistant("z"), user("w"))
    sent = dict(third)
    reuse.prepare(KEY, third, sent, "http://vllm/v1")
    assert PREFIX_FIELD not in sent


def test_a_retried_call_gets_the_same_prefix_again() -> None:
    memory = ReuseMemory()
    remembered(memory, chat(user("Hi")), [1], [2])
    follow = chat(user("Hi"), assistant("x"), user("y"))
    assert remembered(memory, follow, [1, 2, 3], [4]) == [1, 2]
    assert remembered(memory, follow, [1, 2, 3], [5]) == [1, 2]  # the harness retried it
    after = chat(user("Hi"), assistant("x"), user("y"), assistant("z"), user("w"))
    assert _ids(memory.prefix_for(KEY, after)[0]) == [
        1,
        2,
        3,
        5,
    ]  # the retry replaced the first try
    assert memory.tokens == 2 + 4


def test_a_call_to_another_model_gets_no_reuse() -> None:
    """A judge or summarizer model in the same attempt was sent the first model's token IDs
    (its engine refused them: a 400 naming a field the harness never sent)."""
    memory = ReuseMemory()
    remembered(memory, chat(user("Hi"), model="policy"), [1], [2])
    follow = [user("Hi"), assistant("x"), user("Summarize")]
    assert memory.prefix_for(KEY, chat(*follow, model="judge"))[0] is None
    assert _ids(memory.prefix_for(KEY, chat(*follow, model="policy"))[0]) == [1, 2]


def test_two_threads_asking_the_same_each_extend_their_own_answer() -> None:
    """The second answer replaced the first as "an earlier try": the first thread's next call
    was sent the other thread's tokens (the engine fell back; no reuse for that thread)."""
    memory = ReuseMemory()
    for response, answer in (([2], "Apple"), ([3], "Pear")):
        prefix, ticket = memory.prefix_for(KEY, chat(user("Name a fruit")))
        assert prefix is None and ticket is not None
        memory.remember(ticket, [1], response, answer)
    for answer, tokens in (("Apple", [1, 2]), ("Pear", [1, 3]), ("Plum", [1, 3])):
        follow = chat(user("Name a fruit"), assistant(answer), user("Another"))
        assert _ids(memory.prefix_for(KEY, follow)[0]) == tokens  # unknown: the latest used
    # A retry whose answer is not known replaces the try before it, as before.
    _, ticket = memory.prefix_for(KEY, chat(user("Name a fruit")))
    assert ticket is not None
    memory.remember(ticket, [1], [4])
    follow = chat(user("Name a fruit"), assistant("Apple"), user("Another"))
    assert _ids(memory.prefix_for(KEY, follow)[0]) == [1, 4]
