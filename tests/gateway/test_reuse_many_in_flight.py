"""Token reuse's calls in flight at the proxy (`reins.gateway.reuse.TokenReuse`): kept until their
records come or the call ends, however many there are."""

from __future__ import annotations

from reins.gateway.reuse import PREFIX_FIELD, ReuseMemory, TokenReuse
from tests.gateway.test_reuse import _ids, assistant, chat, record, user

ENGINE = "http://engine/v1"


def test_the_oldest_of_many_calls_in_flight_keeps_its_reuse() -> None:
    """2,000 rollouts' second calls in flight at once: the first one's record still says it was
    reused, and its rollout's third call extends it (past 1,024 in flight, both were lost)."""
    reuse = TokenReuse()
    seconds = []
    for rollout in range(2000):
        key = (f"r-{rollout}", 1)
        first = chat(user("Hi"))
        reuse.prepare(key, first, dict(first), ENGINE)
        reuse.recorded([record(first, [1, 2], [3])])
        second = chat(user("Hi"), assistant("x"), user("y"))
        sent = dict(second)
        reuse.prepare(key, second, sent, ENGINE)
        assert _ids(sent[PREFIX_FIELD]) == [1, 2, 3]
        seconds.append(second)
    oldest = seconds[0]
    reuse.answered(oldest, ENGINE, "reused")
    records = [record(oldest, [1, 2, 3, 4], [5])]
    reuse.recorded(records)
    assert records[0].model_dump()["token_reuse"] == "reused"

    third = chat(user("Hi"), assistant("x"), user("y"), assistant("z"), user("w"))
    sent = dict(third)
    reuse.prepare(("r-0", 1), third, sent, ENGINE)
    assert _ids(sent[PREFIX_FIELD]) == [1, 2, 3, 4, 5]


def test_a_call_that_ends_unrecorded_is_forgotten() -> None:
    reuse = TokenReuse()
    call = chat(user("Hi"))
    reuse.prepare(("r", 1), call, dict(call), ENGINE)
    reuse.ended(call)
    records = [record(call, [1, 2], [3])]
    reuse.recorded(records)  # too late: nothing is left of the call
    assert records[0].model_dump().get("token_reuse") is None


def test_two_thousand_rollouts_taking_turns_each_extend_their_last_call() -> None:
    """Each rollout's first call, then each one's second (a batch of rollouts at one step): with
    1,024 attempts remembered, the first 976 rollouts' calls were forgotten before their next."""
    memory = ReuseMemory()
    for rollout in range(2000):
        _, ticket = memory.prefix_for((f"r-{rollout}", 1), chat(user("Hi")))
        assert ticket is not None
        memory.remember(ticket, [1, 2], [3])
    missed = [
        rollout
        for rollout in range(2000)
        if memory.prefix_for((f"r-{rollout}", 1), chat(user("Hi"), assistant("x"), user("y")))[0]
        is None
    ]
    assert missed == []
