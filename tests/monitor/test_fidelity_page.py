"""`/ui/runs/{name}/fidelity`: `reins doctor`'s report of a run's recorded rollouts, on a real
gateway over loopback (no tokenizer: token IDs and token-only split reasons)."""

from __future__ import annotations

import html
from typing import Any

import pytest

from reins.monitor import fidelity
from tests.conftest import Gateway
from tests.monitor.factory import agent_log, chat_call, declare, finish, many_rollouts, post
from tests.stub_engine import encode

QUESTION = [{"role": "user", "content": "Say hello."}]


def rollout(gateway: Gateway, rollout_id: str, events: list[dict[str, Any]], run: str) -> None:
    declare(gateway, [{"rollout_id": rollout_id, "metadata": {"run": run}}])
    assert gateway.http.post(f"/api/rollouts/{rollout_id}/attempts").status_code == 200
    post(gateway, rollout_id, events)
    finish(gateway, rollout_id)


def edited_history(gateway: Gateway, rollout_id: str, run: str = "demo") -> None:
    """Two calls; the harness sent the first answer back upper-cased: a split at its first
    letter (`hello` sampled, `HELLO` sent back)."""
    second = [
        *QUESTION,
        {"role": "assistant", "content": "HELLO there"},
        {"role": "user", "content": "Again."},
    ]
    rollout(
        gateway, rollout_id, [chat_call(QUESTION, "hello there"), chat_call(second, "Hi.")], run
    )


def ids(text: str) -> str:
    return "|".join(str(i) for i in encode(text))


def test_a_run_with_an_edited_history_shows_the_split_its_reason_and_example(
    gateway: Gateway,
) -> None:
    edited_history(gateway, "edit-1")
    rollout(gateway, "other-run-1", [chat_call(QUESTION, "hello")], run="other")
    page = gateway.http.get("/ui/runs/demo/fidelity")
    assert page.status_code == 200
    text = html.unescape(page.text)
    assert "Read 1 of 1 finished rollout" in text
    assert "split reasons</th><td>unknown 1" in text
    # The last shared tokens (the end of `<|assistant|>`), then what was sampled / sent back.
    assert f"'…{ids('tant|>')} ‖ {ids('hello ')}…'" in text
    assert f"'…{ids('tant|>')} ‖ {ids('HELLO ')}…'" in text
    assert "edit-1</a> call 2" in text
    assert "split:unknown" in text and "--tokenizer" in text  # the finding and its fix
    assert "one-sequence rollouts</th><td>0/1 (0.00)" in text
    assert "other-run-1" not in text


def test_a_run_whose_rollouts_merge_has_no_split_and_no_finding(gateway: Gateway) -> None:
    second = [
        *QUESTION,
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "!"},
    ]
    rollout(gateway, "good-1", [chat_call(QUESTION, "hello"), chat_call(second, "Hi.")], "good")
    text = html.unescape(gateway.http.get("/ui/runs/good/fidelity").text)
    assert "one-sequence rollouts</th><td>1/1 (1.00)" in text
    assert "split reasons</th><td>none" in text
    assert "Split examples" not in text
    # Token-only without a tokenizer: that is the one finding.
    assert text.count("fix:") == 1 and "no_tokenizer" in text


def test_harness_text_is_escaped(gateway: Gateway) -> None:
    attack = "<script>alert('x')</script>"
    events = [
        chat_call(QUESTION, "", status=400, error=f"bad request {attack}"),
        agent_log("failed", f"Traceback ...\n{attack}\n"),
    ]
    declare(gateway, [{"rollout_id": "evil-1", "metadata": {"run": "evil"}}])
    gateway.http.post("/api/rollouts/evil-1/attempts")
    post(gateway, "evil-1", events)
    finish(gateway, "evil-1", "failed", "agent crashed")
    page = gateway.http.get("/ui/runs/evil/fidelity")
    assert page.status_code == 200
    assert "<script>alert" not in page.text
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page.text
    text = html.unescape(page.text)
    assert f"status 400: bad request {attack}" in text  # the failed call, every call: an error
    assert "not trainable as recorded (failed, harness_exit)" in text  # its one run exited 1
    assert "exit 1; it said:" in text  # the agent log's exit code and tail


def test_the_page_needs_the_admin_key(gateway: Gateway) -> None:
    edited_history(gateway, "edit-2")
    anonymous = gateway.client().get("/ui/runs/demo/fidelity", follow_redirects=False)
    assert anonymous.status_code == 303
    assert anonymous.headers["location"] == "/ui/login?next=/ui/runs/demo/fidelity"
    wrong = gateway.client("wrong").get("/ui/runs/demo/fidelity")
    assert wrong.status_code == 401
    assert "edit-2" not in wrong.text


def test_a_large_run_is_read_up_to_the_bound_and_the_page_says_so(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fidelity, "MAX_ROLLOUTS", 4)
    ids_ = many_rollouts(gateway, 10, run="big")
    text = html.unescape(gateway.http.get("/ui/runs/big/fidelity").text)
    assert "Read 4 of 10 finished rollouts" in text
    assert "(the latest 4 only, to keep this page fast)" in text
    shown = [rid for rid in ids_ if f"{rid}</a>" in text]
    assert len(shown) == 4


def test_the_run_page_links_to_it(gateway: Gateway, runs_dir: Any) -> None:
    from tests.monitor.factory import write_run

    write_run(runs_dir, "demo", steps=3)
    page = gateway.http.get("/ui/runs/demo")
    assert 'href="/ui/runs/demo/fidelity"' in page.text


def test_the_call_bound_counts_calls_not_the_agent_logs_read_with_them(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bound of 2 calls: a rollout of 2 calls and 2 agent logs was called cut (its events
    counted against the bound) and its second call was left unread; one of 3 calls is cut."""
    monkeypatch.setattr(fidelity, "MAX_CALLS", 2)
    second = [
        *QUESTION,
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "!"},
    ]
    calls = [chat_call(QUESTION, "hello"), chat_call(second, "Hi.")]
    logs = [agent_log(), {**agent_log(), "idempotency_key": "log-2"}]
    rollout(gateway, "two-calls", [*logs, *calls], run="bound")
    text = html.unescape(gateway.http.get("/ui/runs/bound/fidelity").text)
    assert "had more than" not in text
    assert "calls</th><td>2 (2 trainable" in text
    third = [*second, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "?"}]
    rollout(gateway, "three-calls", [*calls, chat_call(third, "Yes.")], run="bound")
    text = html.unescape(gateway.http.get("/ui/runs/bound/fidelity").text)
    assert "1 rollout had more than 2 calls: only the first 2 were read (three-calls)" in text
