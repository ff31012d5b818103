"""The sandbox example (examples/sandbox): its checkers, its task files, and its episodes run by
the real local controller through real sandboxes, hostile ones included. The model in the episode
tests is scripted (tests/examples/sandbox_scripted.py: fixed tool calls, no LLM); the slow test
trains two steps with a tiny model through the real harness."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from examples.sandbox import make_tasks
from examples.sandbox.agent import LIMITS, Episode, decode, execute, metrics
from examples.sandbox.checkers import check
from reins.agent import REWARD, TOOL
from reins.client import GatewayClient
from reins.controller import Controller, LocalReconciler
from reins.gateway import GatewaySettings
from reins.sandbox import Sandbox, sandbox_problem
from reins.schemas import RolloutSpec
from tests.conftest import ADMIN_KEY, serve
from tests.controller.conftest import ROOT, running, wait_terminal
from tests.examples.support import recorded
from tests.required import missing

EXAMPLE = ROOT / "examples" / "sandbox"
SQUARES = {
    "instruction": "What is the sum of the squares of the integers from 1 to 10?",
    "check": {"kind": "number", "value": 385, "tolerance": 0},
}

FORK_BOMB = ":(){ :|: ; };:"
"""The foreground form: the shell waits for it, so it always meets the process limit. (The
classic `:(){ :|:& };:` may exit 0 first; the sandbox then kills what it left, unreported.)"""


def needs_sandbox() -> None:
    problem = sandbox_problem()
    if problem:
        missing(problem)


# --- checkers ------------------------------------------------------------------------------------


def file_task(content: str = "b\nc") -> dict[str, Any]:
    return {
        "instruction": "...",
        "check": {"kind": "file", "path": "out/s.txt", "content": content},
    }


def test_a_file_check_passes_the_right_file_and_fails_a_wrong_or_missing_one(
    tmp_path: Path,
) -> None:
    assert check(file_task(), None, tmp_path).reward == 0.0  # missing
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "s.txt").write_text("b  \r\nc\n\n")  # line ends and trailing blanks aside
    assert check(file_task(), None, tmp_path).reward == 1.0
    (tmp_path / "out" / "s.txt").write_text("c\nb\n")
    verdict = check(file_task(), None, tmp_path)
    assert (verdict.reward, verdict.reason) == (0.0, "out/s.txt differs from the expected content")


def test_a_file_check_does_not_follow_a_link_out_of_the_folder(tmp_path: Path) -> None:
    outside = tmp_path / "host.txt"
    outside.write_text("b\nc\n")
    folder = tmp_path / "work"
    (folder / "out").mkdir(parents=True)
    (folder / "out" / "s.txt").symlink_to(outside)
    assert check(file_task(), None, folder).reward == 0.0


def test_a_number_check_reads_the_last_number_of_the_answer(tmp_path: Path) -> None:
    assert check(SQUARES, "The sum is 385.", tmp_path).reward == 1.0
    assert check(SQUARES, "1 to 10 gives 384", tmp_path).reward == 0.0
    assert check(SQUARES, "385, or so I think: 386", tmp_path).reward == 0.0
    assert check(SQUARES, "no idea", tmp_path).reward == 0.0
    assert check(SQUARES, None, tmp_path).reward == 0.0
    big = {"check": {"kind": "number", "value": 9753606941, "tolerance": 0}}
    assert check(big, "9,753,606,941", tmp_path).reward == 1.0
    assert check(big, "9753606942", tmp_path).reward == 0.0
    mean = {"check": {"kind": "number", "value": 41.27, "tolerance": 0.01}}
    assert [check(mean, a, tmp_path).reward for a in ("41.28", "41.265", "41.3")] == [1, 1, 0]
    # ".5" was read as 5, "3.3835e5" as 5, U+2212's minus not at all, a date's hyphen as one.
    five = {"check": {"kind": "number", "value": 5}}
    half = {"check": {"kind": "number", "value": 0.5}}
    assert [check(five, a, tmp_path).reward for a in (".5", "about 5", "5e0")] == [0, 1, 1]
    assert check(half, "it is .5", tmp_path).reward == 1.0
    assert check(big, "9.753606941e9", tmp_path).reward == 1.0
    minus = {"check": {"kind": "number", "value": -5}}
    assert [check(minus, a, tmp_path).reward for a in ("\u22125", "x -5", "4-5")] == [1, 1, 0]
    days = {"check": {"kind": "number", "value": 1}}
    assert check(days, "1990-01-01", tmp_path).reward == 1.0  # 01, not -1


def number_task(instruction: str, value: float) -> dict[str, Any]:
    return {"instruction": instruction, "check": {"kind": "number", "value": value}}


PRIMES = number_task("How many prime numbers are smaller than 100? Answer with the number.", 25)
DAYS = number_task("How many days are there from 2001-05-15 to 2015-06-25?", 5154)


@pytest.mark.parametrize(
    ("task", "answer", "reward"),
    [
        # The answer restating the question was read as the question's number, or a date's part.
        (PRIMES, "There are 25 primes below 100", 1.0),
        (PRIMES, "25 (counting 2 and 97, below 100)", 1.0),
        (DAYS, "There are 5154 days from 2001-05-15 to 2015-06-25.", 1.0),
        (DAYS, "5154 days from May 15, 2001 to June 25, 2015", 1.0),
        (
            number_task("Days from 2024-01-01 to 2024-03-01?", 60),
            "60 (2024-01-01 to 2024-03-01)",
            1,
        ),
        (number_task("How many primes are below 180?", 42), "42 (3 primes)", 1.0),
        # Only numbers of the question or in parentheses: the last one counts.
        (number_task("Days from 2024-01-01 to 2024-01-02?", 1), "1", 1.0),
        (number_task("Days from 2024-01-01 to 2024-01-02?", 1), "1 (2024-01-01 to 2024-01-02)", 1),
        (PRIMES, "(there are 25)", 1.0),
        # Still one number read: listing many, or the right one aside, earns nothing.
        (PRIMES, "24, 25 or 26", 0.0),
        (PRIMES, " ".join(str(n) for n in range(1, 60, 2)), 0.0),
        (PRIMES, "26 (or 25)", 0.0),
        (PRIMES, "25 below 100, or 26", 0.0),
    ],
)
def test_a_number_check_sets_aside_the_questions_numbers_dates_and_asides(
    task: dict[str, Any], answer: str, reward: float, tmp_path: Path
) -> None:
    assert check(task, answer, tmp_path).reward == reward


@pytest.mark.parametrize(
    "answer", ["1234", "1,234", "1_234", "1 234", "1\u00a0234", "1\u202f234", "about 1 234 words"]
)
def test_thousands_grouped_by_comma_underscore_or_space_read_whole(
    answer: str, tmp_path: Path
) -> None:
    """`1_234` and `42 000` were read as their last group (234, 0)."""
    assert check(number_task("Count the words.", 1234), answer, tmp_path).reward == 1.0


@pytest.mark.parametrize(
    ("answer", "value"),
    [
        ("42 000", 42000),
        ("1 234 567.5", 1234567.5),
        ("12 34", 34),
        ("1 2345", 2345),
        ("1,234 567", 567),
    ],
)
def test_a_grouping_needs_groups_of_three_and_one_separator(
    answer: str, value: float, tmp_path: Path
) -> None:
    assert check(number_task("Count.", value), answer, tmp_path).reward == 1.0


def test_a_text_check_ignores_case_and_punctuation(tmp_path: Path) -> None:
    task = {"check": {"kind": "text", "value": "north"}}
    assert check(task, "North.", tmp_path).reward == 1.0
    assert check(task, "south", tmp_path).reward == 0.0
    assert check(task, None, tmp_path).reward == 0.0
    assert check(task, "north_", tmp_path).reward == 1.0
    assert check(task, "\uff4e\uff4f\uff52\uff54\uff48", tmp_path).reward == 1.0  # full width
    # A value of nothing but punctuation was matched by an empty answer: the task is refused.
    with pytest.raises(ValueError, match="nothing but punctuation"):
        check({"check": {"kind": "text", "value": "..."}}, "", tmp_path)


# --- task files ----------------------------------------------------------------------------------


def committed(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (EXAMPLE / name).read_text().splitlines()]


def test_generation_is_deterministic_and_equals_the_committed_files() -> None:
    train, val = make_tasks.make_tasks(seed=0, per_kind=30, val_per_kind=6)
    assert make_tasks.make_tasks(seed=0, per_kind=30, val_per_kind=6) == (train, val)
    lines = "".join(json.dumps(task) + "\n" for task in train)
    assert (EXAMPLE / "train.jsonl").read_text() == lines  # byte-identical
    assert committed("val.jsonl") == val
    assert (len(train), len(val)) == (240, 60)


def test_train_and_val_are_disjoint_and_val_holds_every_kind() -> None:
    train, val = committed("train.jsonl"), committed("val.jsonl")
    assert not {t["id"] for t in train} & {t["id"] for t in val}
    inputs = {json.dumps(t["input"], sort_keys=True) for t in train}
    assert not inputs & {json.dumps(t["input"], sort_keys=True) for t in val}
    assert {t["id"].split("-")[0] for t in val} == set(make_tasks.KINDS)


def test_every_task_is_solved_by_its_reference_answer(tmp_path: Path) -> None:
    for task in committed("train.jsonl") + committed("val.jsonl"):
        spec, folder = task["input"]["check"], tmp_path / task["id"]
        answer = None
        if spec["kind"] == "file":
            (folder / spec["path"]).parent.mkdir(parents=True, exist_ok=True)
            (folder / spec["path"]).write_text(spec["content"] + "\n")
        elif spec["kind"] == "number":
            answer = f"The answer is {spec['value']}."
        else:
            answer = spec["value"]
        assert check(task["input"], answer, folder).reward == 1.0, task["id"]
        assert check(task["input"], "wrong", tmp_path / "empty").reward == 0.0, task["id"]


# --- tools in a real sandbox ---------------------------------------------------------------------


def test_the_file_tools_refuse_paths_outside_work_without_naming_the_host_folder(
    tmp_path: Path,
) -> None:
    needs_sandbox()
    with Sandbox(tmp_path / "work") as sandbox:
        for arguments in ({"path": "/etc/passwd"}, {"path": "../x"}, {"path": "/work/../../x"}):
            result = execute(sandbox, "read_file", arguments, LIMITS)
            assert not result.ok and result.output.startswith("error: ")
            assert str(tmp_path) not in result.output
        wrote = execute(sandbox, "write_file", {"path": "/work/a/b.txt", "content": "hi"}, LIMITS)
        assert wrote.ok and (tmp_path / "work" / "a" / "b.txt").read_text() == "hi"


def test_a_command_that_ran_on_after_its_child_hit_the_memory_limit_is_told_so(
    tmp_path: Path,
) -> None:
    """The model was told the sandbox killed its command, though the command ran on and
    printed `after`, with its own exit code."""
    needs_sandbox()
    with Sandbox(tmp_path / "work", LIMITS) as sandbox:
        if sandbox._cgroups is None:
            missing("no writable cgroup (v1 memory and pids, or v2): run as root on Linux")
        hog = f"python3 -c 'data = b\"x\" * ({LIMITS.memory_mb} * 2 * 1024**2)'"
        result = execute(sandbox, "run_shell", {"command": f"{hog}; echo after"}, LIMITS)
    assert not result.ok and result.limit == "memory"
    assert "after\n" in result.output
    assert result.output.endswith(
        f"[exit code 0, after the sandbox stopped part of it: it used more than "
        f"{LIMITS.memory_mb} MB of memory]"
    )


def test_malformed_tool_calls_are_answered_with_what_is_wrong(tmp_path: Path) -> None:
    """`arguments: null` ended the episode with a TypeError; `finish` without its answer was
    told there is no tool `finish`."""
    with Sandbox(tmp_path / "work") as sandbox:
        nothing = execute(sandbox, "run_shell", decode(None), LIMITS)
        assert (nothing.ok, nothing.output) == (
            False, "error: the arguments of run_shell must be a JSON object"
        )  # fmt: skip
        unfinished = execute(sandbox, "finish", decode("{}"), LIMITS)
        assert unfinished.output == "error: finish needs the argument 'answer'"


# --- episodes through the controller -------------------------------------------------------------


@pytest.fixture
def gateway_url(tmp_path: Path) -> Iterator[str]:
    database = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    with serve(GatewaySettings(database_url=database, api_key=ADMIN_KEY)) as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture
async def client(gateway_url: str) -> AsyncIterator[GatewayClient]:
    async with GatewayClient(gateway_url, ADMIN_KEY) as gateway:
        yield gateway


@pytest.fixture
def host_server() -> Iterator[tuple[int, list[str]]]:
    """A real HTTP server on the host's 127.0.0.1: (port, paths requested)."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"host secret")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    assert httpx.get(f"http://127.0.0.1:{port}/from-the-host").text == "host secret"  # it works
    yield port, hits
    server.shutdown()
    server.server_close()


def tool_events(events: list[Any]) -> list[dict[str, Any]]:
    return [e.data for e in events if e.type == TOOL]


def reward_of(events: list[Any]) -> dict[str, Any]:
    (reward,) = [e.data for e in events if e.type == REWARD]
    return reward


async def test_hostile_commands_fail_clearly_score_zero_and_the_run_goes_on(
    client: GatewayClient,
    gateway_url: str,
    host_server: tuple[int, list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    needs_sandbox()
    port, hits = host_server
    other = Sandbox(tmp_path / "other-rollout" / "work")  # another rollout's folder, still there
    other.write_file("secret.txt", "the other rollout's secret")
    secret = other.path / "secret.txt"
    roots = tmp_path / "roots"  # the agents' temporary roots (their sandboxes' parents)
    roots.mkdir()
    monkeypatch.setenv("TMPDIR", str(roots))
    fetch = f"python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/').read())\""
    hostile = {
        "r-net": [[["run_shell", {"command": fetch}]], [["finish", {"answer": "385"}]]],
        "r-peek": [
            [["run_shell", {"command": f"cat {secret}"}], ["read_file", {"path": str(secret)}]],
            [["write_file", {"path": "../../escaped.txt", "content": "x"}]],
            [["finish", {"answer": "I could not read it."}]],
        ],
        "r-fork": [[["run_shell", {"command": FORK_BOMB}]], "I give up."],
    }
    tasks = {
        "r-net": {**SQUARES, "check": {"kind": "text", "value": "host secret"}},
        "r-peek": {**SQUARES, "check": {"kind": "text", "value": "the other rollout's secret"}},
        "r-fork": SQUARES,
    }
    reconciler = LocalReconciler(
        "tests.examples.sandbox_scripted:run", 4, tmp_path / "logs", workdir=ROOT
    )
    controller = Controller(
        client, reconciler, gateway_url=gateway_url, default_timeout_s=120, poll_interval_s=0.1
    )
    async with running(controller):
        specs = [
            RolloutSpec(rollout_id=rid, input={**tasks[rid], "script": script}, mode="val")
            for rid, script in hostile.items()
        ]
        await client.create_rollouts(specs)
        done = await wait_terminal(client, hostile, timeout_s=120)
        # After them, on the same controller: an honest episode.
        honest = [
            [["run_shell", {"command": "python3 -c 'print(sum(i * i for i in range(1, 11)))'"}]],
            [["finish", {"answer": "385"}]],
        ]
        sort = {
            "instruction": "Sort words.txt into sorted.txt.",
            "files": {"words.txt": "pear\napple\nfig\n"},
            "check": {"kind": "file", "path": "sorted.txt", "content": "apple\nfig\npear"},
        }
        honest_sort = [[["run_shell", {"command": "sort words.txt > sorted.txt"}]], "Done."]
        await client.create_rollouts(
            [
                RolloutSpec(rollout_id="r-honest", input={**SQUARES, "script": honest}, mode="val"),
                RolloutSpec(rollout_id="r-sort", input={**sort, "script": honest_sort}, mode="val"),
            ]
        )
        done |= await wait_terminal(client, ["r-honest", "r-sort"], timeout_s=120)

    assert {rid: r.status.state for rid, r in done.items()} == dict.fromkeys(done, "succeeded")
    events = {rid: await client.get_events(rid) for rid in done}

    net, finished = tool_events(events["r-net"])
    assert "Connection refused" in net["output"] and not net["ok"]
    assert hits == ["/from-the-host"]  # nothing from the sandbox reached the host's server
    assert finished == {
        "name": "finish",
        "input": {"answer": "385"},
        "output": "the episode ends",
        "ok": True,
        "seconds": 0.0,
    }
    assert reward_of(events["r-net"])["value"] == 0.0  # a task not solved (text: "host secret")

    cat, read, escape, finish = tool_events(events["r-peek"])
    assert "No such file or directory" in cat["output"] and not cat["ok"]
    assert read["output"].startswith("error: ") and "outside /work" in read["output"]
    assert escape["output"].startswith("error: ") and "outside the sandbox" in escape["output"]
    assert "rollout's secret" not in cat["output"] + read["output"] + escape["output"]
    assert finish["name"] == "finish"
    assert reward_of(events["r-peek"])["value"] == 0.0

    (fork,) = tool_events(events["r-fork"])
    assert "fork bomb" in fork["output"] and "[killed: processes limit" in fork["output"]
    fork_reward = reward_of(events["r-fork"])
    assert fork_reward["value"] == 0.0
    assert fork_reward["metrics"] == {"tool_calls": 1.0, "finished": 0.0, "limit_hits": 1.0}
    assert "replied without a tool call" in fork_reward["reason"]

    shell, _ = tool_events(events["r-honest"])
    assert shell["output"] == "385\n[exit code 0]" and shell["ok"]
    honest_reward = reward_of(events["r-honest"])
    assert honest_reward["value"] == 1.0
    assert honest_reward["metrics"] == {"tool_calls": 2.0, "finished": 1.0, "limit_hits": 0.0}
    assert reward_of(events["r-sort"])["value"] == 1.0  # the task's file was there, and checked

    assert secret.read_text() == "the other rollout's secret"
    assert list(roots.iterdir()) == []  # every sandbox root was removed, and nothing escaped
    other.close()


# --- training ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_training_steps_on_the_example(tmp_path: Path, tiny_model_dir: Path) -> None:
    from reins.trainer.config import TrainConfig
    from reins.trainer.runtime import train

    needs_sandbox()
    picked = committed("train.jsonl")[:2]
    tasks = tmp_path / "train.jsonl"
    tasks.write_text("".join(json.dumps(task) + "\n" for task in picked))
    run = TrainConfig.model_validate(
        {
            "run_name": "sandbox",
            "runs_dir": tmp_path / "runs",
            "tasks": tasks,
            "agent": "examples.sandbox.agent:run",
            "model": tiny_model_dir,
            "estimator": "rloo",
            "steps": 2,
            "tasks_per_step": 2,
            "group_size": 2,
            "val_every": 0,
            "lr": 1e-5,
            "max_model_len": 2048,
            "rollout_timeout_s": 300,
            "tensorboard": False,
        }
    )
    records = asyncio.run(train(run))
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        assert record["rollouts/trained"] == 4
        assert record["samples/per_rollout"] >= 1
        assert "reward/mean" in record
        assert {"agent/tool_calls", "agent/finished", "agent/limit_hits"} <= set(record)
    rewards, tools = recorded(run.run_dir)
    assert len(rewards) == 8 and all(set(r["metrics"]) == set(metrics(Episode())) for r in rewards)
    # A random model rarely writes a tool call (the scripted test above covers the tool events'
    # content); whatever it did, every counted call has its `tool` event.
    assert len(tools) == sum(r["metrics"]["tool_calls"] for r in rewards)
