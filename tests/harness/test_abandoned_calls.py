"""Abandoned calls with the real stack (issue #13, 3): the `openai` SDK gives up on a long
generation (a timeout of a few seconds, or a stream it closes), then retries. The engine's
sequence is cancelled when the harness leaves (it ends as `abort`, long before `max_tokens`;
observed with a spy on the scheduler's `submit`), the call is recorded as `abandoned` rather
than as a 200 with an answer nobody received, and the training samples built from the rollout
keep the retry, not the abandoned call.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from reins.engine.scheduler import Sequence
from reins.samples import build_batch, rollout_from_events
from reins.schemas import Event
from tests.conftest import ADMIN_KEY
from tests.harness.conftest import Rollout

pytestmark = pytest.mark.slow

COUNTING = [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]
"""Greedy decoding counts on and on: a generation far longer than the client waits."""
LONG = 1500
"""`max_tokens` of the call the harness gives up on."""
TIMEOUT_S = 6.0
"""The impatient client's timeout: long enough for the engine to start decoding on a loaded
2-core machine, far shorter than the generation."""
CANCEL_DEADLINE_S = 60.0
"""How long the engine may take to drop the sequence after the harness left (one decode step of
a loaded 2-core machine is about a second)."""


@pytest.fixture
def sequences(val_rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> list[Sequence]:
    """The sequences submitted to the engine from now on (a spy: they run as usual)."""
    scheduler = val_rollout.engine.engine.scheduler
    submitted: list[Sequence] = []
    submit = scheduler.submit

    def spy(sequence: Sequence) -> None:
        submitted.append(sequence)
        submit(sequence)

    monkeypatch.setattr(scheduler, "submit", spy)
    return submitted


def wait_cancelled(sequences: list[Sequence]) -> tuple[float, float]:
    """Seconds until the one sequence submitted so far was cancelled (the engine told its
    client left), and until it left the batch; it must end as `abort`, long before
    `max_tokens`."""
    started = time.monotonic()
    (sequence,) = sequences
    told = None
    while sequence.finish_reason is None:
        if told is None and sequence.cancelled:
            told = time.monotonic() - started
        assert time.monotonic() - started < CANCEL_DEADLINE_S, (
            f"the engine still generates {CANCEL_DEADLINE_S:.0f} s after the client left "
            f"({len(sequence.output_ids)} tokens)"
        )
        time.sleep(0.01)
    assert sequence.finish_reason == "abort", sequence.finish_reason
    assert len(sequence.output_ids) < LONG // 2
    ended = time.monotonic() - started
    return (ended if told is None else told), ended


def calls_once(rollout: Rollout, count: int) -> list[dict[str, Any]]:
    """The rollout's recorded calls once there are `count` (polled: an abandoned call is
    recorded when the gateway sees the client leave)."""
    deadline = time.monotonic() + 30
    while len(calls := rollout.calls()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return calls


def training_record(rollout: Rollout) -> Any:
    response = httpx.get(
        f"{rollout.gateway_url}/api/rollouts/{rollout.rollout_id}/events",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    response.raise_for_status()
    events = [Event.model_validate(event) for event in response.json()]
    seqs = [e.seq for e in events if e.type == "model_request"]
    return rollout_from_events(events, missing_reward=1.0), seqs


def assert_retry_trained_not_abandoned(rollout: Rollout, retry_response: list[int]) -> None:
    record, seqs = training_record(rollout)
    abandoned_seq, retry_seq = seqs
    assert [c.seq for c in record.calls] == [retry_seq] != [abandoned_seq]
    assert record.abandoned_calls == 1
    (sequence,) = build_batch([record]).sequences
    assert sequence.call_seqs == (retry_seq,)
    assert sequence.token_ids[sequence.loss_mask].tolist() == retry_response


def test_a_non_streamed_call_that_timed_out_is_cancelled_and_not_trained(
    val_rollout: Rollout, sequences: list[Sequence]
) -> None:
    rollout = val_rollout
    impatient = openai.OpenAI(
        base_url=rollout.base_url, api_key=rollout.token, timeout=TIMEOUT_S, max_retries=0
    )
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(
            model=rollout.model, messages=COUNTING, max_tokens=LONG, temperature=0
        )
    told, ended = wait_cancelled(sequences)
    tokens = len(sequences[0].output_ids)
    print(f"\nnon-streamed: cancel {told:.2f} s, out of the batch {ended:.2f} s after the timeout")
    print(f"at {tokens} tokens")

    retry = openai.OpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=300)
    answer = retry.chat.completions.create(
        model=rollout.model, messages=COUNTING, max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.content

    abandoned, kept = calls_once(rollout, 2)
    assert (abandoned["status"], abandoned["abandoned"]) == (499, True), abandoned
    assert abandoned["response_token_ids"] == [] and "hung up" in abandoned["error"]
    assert TIMEOUT_S - 0.5 < abandoned["latency_s"] < TIMEOUT_S + 5
    assert (kept["status"], kept["abandoned"]) == (200, False)
    assert rollout.engine.engine.decode(kept["response_token_ids"]) == (
        answer.choices[0].message.content
    )
    assert_retry_trained_not_abandoned(rollout, kept["response_token_ids"])


def test_a_stream_the_harness_closed_is_cancelled_and_not_trained(
    val_rollout: Rollout, sequences: list[Sequence]
) -> None:
    rollout = val_rollout
    sdk = openai.OpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=300)
    stream = sdk.chat.completions.create(
        model=rollout.model, messages=COUNTING, max_tokens=LONG, temperature=0, stream=True
    )
    received = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += chunk.choices[0].delta.content
            if len(received) >= 4:
                break
    stream.close()  # the harness hangs up mid-answer
    told, ended = wait_cancelled(sequences)
    tokens = len(sequences[0].output_ids)
    print(f"\nstreamed: cancel {told:.2f} s, out of the batch {ended:.2f} s after the close")
    print(f"at {tokens} tokens")

    pieces = []
    for chunk in sdk.chat.completions.create(
        model=rollout.model, messages=COUNTING, max_tokens=8, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)

    abandoned, kept = calls_once(rollout, 2)
    assert (abandoned["status"], abandoned["abandoned"], abandoned["stream"]) == (499, True, True)
    partial = rollout.engine.engine.decode(abandoned["response_token_ids"])
    assert partial.startswith(received), (partial, received)  # what the harness was sent, at least
    assert len(abandoned["response_token_ids"]) < LONG // 2
    assert (kept["status"], kept["abandoned"]) == (200, False)
    assert rollout.engine.engine.decode(kept["response_token_ids"]) == "".join(pieces)
    assert_retry_trained_not_abandoned(rollout, kept["response_token_ids"])
