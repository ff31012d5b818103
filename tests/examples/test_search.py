"""The search example (examples/search): answer normalisation and exact match, the reply parser,
the generated data, BM25 retrieval and its once-only index, the QA converters; and (slow) two
training steps of the real harness with the tiny model."""

from __future__ import annotations

import asyncio
import fcntl
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from examples.search import make_data, qa_data, retrieval
from examples.search.agent import exact_match, normalize, parse
from tests.examples.support import recorded
from tests.required import module

EXAMPLE = Path(make_data.__file__).parent
ROOT = EXAMPLE.parent.parent


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "search-cache"
    monkeypatch.setenv("REINS_SEARCH_CACHE", str(folder))
    return folder


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("answer", "golden", "expected"),
    [
        ("Maren Ostby", ["Maren Ostby"], 1.0),
        ("  maren   OSTBY. ", ["Maren Ostby"], 1.0),
        ("The Ulm", ["Ulm", "Ulm river"], 1.0),
        ("an Ulm river", ["Ulm river"], 1.0),
        ("1887", ["1887"], 1.0),
        ("Maren Ostby founded it.", ["Maren Ostby"], 0.0),
        ("Maren", ["Maren Ostby"], 0.0),
        ("", ["Maren Ostby"], 0.0),
        ("Theodor", ["odor"], 0.0),  # articles go only as whole words
    ],
)
def test_exact_match_after_search_r1_normalisation(
    answer: str, golden: list[str], expected: float
) -> None:
    assert exact_match(answer, golden) == expected


def test_normalisation_drops_case_punctuation_articles_and_extra_spaces() -> None:
    assert normalize("The  Quick, brown fox -- an  A!") == "quick brown fox"


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("<search> Orlin Vale founder </search>", ("search", "Orlin Vale founder")),
        ("<answer>Maren Ostby</answer>", ("answer", "Maren Ostby")),
        ("I will look.\n<search>who\nfounded it</search> then", ("search", "who\nfounded it")),
        ("<search>a</search><information>x</information><answer>b</answer>", ("search", "a")),
        ("<answer>b</answer> <search>a</search>", ("answer", "b")),
        ("<answer>Maren Ostby", None),  # cut off before the closing tag
        ("<search>a</answer>", None),
        ("Maren Ostby founded it.", None),
        ("", None),
    ],
)
def test_parse_takes_the_first_complete_tag(reply: str, expected: tuple[str, str] | None) -> None:
    assert parse(reply) == expected


def test_generated_files_are_reproduced_byte_for_byte(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(EXAMPLE / "make_data.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    for name in ("corpus.jsonl", "train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / name).read_bytes(), name


def test_splits_have_the_planned_sizes_and_hops() -> None:
    train = read_jsonl(EXAMPLE / "train.jsonl")
    val = read_jsonl(EXAMPLE / "val.jsonl")
    assert len(train) == 300 and len(val) == 64
    assert sum(t["input"]["hops"] == 2 for t in train) == 60
    assert sum(t["input"]["hops"] == 2 for t in val) == 16
    assert len({t["id"] for t in train + val}) == 364


def names(tasks: list[dict[str, Any]]) -> set[str]:
    """Capitalised words of questions and answers, less the question words and company kinds."""
    common = {"Who", "In", "Which", *make_data.COMPANY_KINDS}
    text = " ".join(
        t["input"]["question"] + " " + " ".join(t["input"]["golden_answers"]) for t in tasks
    )
    return set(re.findall(r"\b[A-Z][a-z]+\b", text)) - common


def test_validation_entities_are_disjoint_from_training_entities() -> None:
    train = names(read_jsonl(EXAMPLE / "train.jsonl"))
    val = names(read_jsonl(EXAMPLE / "val.jsonl"))
    assert len(val) > 40  # 47 names
    assert not train & val


def test_every_answer_is_in_the_corpus() -> None:
    corpus = " ".join(normalize(p["contents"]) for p in read_jsonl(EXAMPLE / "corpus.jsonl"))
    for task in read_jsonl(EXAMPLE / "train.jsonl") + read_jsonl(EXAMPLE / "val.jsonl"):
        golden = task["input"]["golden_answers"]
        assert any(normalize(g) in corpus for g in golden), task


def fact_found(question: str, golden: list[str], passages: list[str]) -> bool:
    """A passage about the question's entity (its title is in the question) states the answer."""
    for contents in passages:
        title, _, text = contents.partition("\n")
        if title.strip('"').lower() in question.lower() and any(
            normalize(g) in normalize(text) for g in golden
        ):
            return True
    return False


def test_bm25_finds_the_fact_for_single_hop_questions_in_the_top_3() -> None:
    searcher = retrieval.Retriever()
    tasks = [t["input"] for t in read_jsonl(EXAMPLE / "val.jsonl") if t["input"]["hops"] == 1]
    found = [
        fact_found(t["question"], t["golden_answers"], searcher.search(t["question"]))
        for t in tasks
    ]
    # Measured 48/48 on val (and 240/240 on train); namesakes and mentions rank below the fact.
    assert sum(found) / len(found) >= 0.95


def test_search_returns_k_passages_and_nothing_for_stopwords_or_unknown_words() -> None:
    searcher = retrieval.Retriever()
    assert len(searcher.search("founder town river", k=3)) == 3
    assert searcher.search("the of a") == []
    assert searcher.search("zzqxv") == []
    text = retrieval.format_passages(searcher.search("Who founded Leiheil Trading?", k=2))
    assert text.startswith("Doc 1(Title: Leiheil Trading) Leiheil Trading is a maker")
    assert "\nDoc 2(Title: " in text
    assert retrieval.format_passages([]) == "No results."


BUILD = """
import sys
from pathlib import Path
from examples.search import retrieval
folder, built = retrieval.ensure_index(Path(sys.argv[1]))
print(folder.name, built)
"""


def test_four_processes_building_at_once_make_one_index(tmp_path: Path, _cache: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes((EXAMPLE / "corpus.jsonl").read_bytes())
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD, str(corpus)], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120)[0].split() for p in processes]
    assert all(p.returncode == 0 for p in processes)
    assert sorted(built for _, built in outputs) == ["False", "False", "False", "True"]
    assert len({folder for folder, _ in outputs}) == 1
    assert [p.name for p in _cache.iterdir() if p.is_dir()] == [outputs[0][0]]  # no temp folder
    assert retrieval.ensure_index(corpus) == (_cache / outputs[0][0], False)


def test_an_index_folder_without_its_completion_mark_is_rebuilt(_cache: Path) -> None:
    folder, _ = retrieval.ensure_index()
    (folder / "complete.json").unlink()
    assert retrieval.ensure_index() == (folder, True)
    assert len(retrieval.Retriever().search("Leiheil Trading")) == 3


def test_a_build_sweeps_the_temporary_folders_of_killed_builds(
    tmp_path: Path, _cache: Path
) -> None:
    """A build killed mid-way left its `.<key>-xxxx` folder in the cache for ever."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "0", "contents": '"Zed"\nZed is a town.'}) + "\n")
    key, other, busy = retrieval.corpus_key(corpus), "a" * 32, "b" * 32
    _cache.mkdir()
    for name in (f".{key}-killed", f".{other}-killed", f".{busy}-running"):
        (_cache / name).mkdir()
        (_cache / name / "params.index.json").write_text("{}")
    (_cache / f"{other}.lock").touch()
    with (_cache / f"{busy}.lock").open("w") as running:  # another corpus's build, under way
        fcntl.flock(running, fcntl.LOCK_EX)
        _, built = retrieval.ensure_index(corpus)
    assert built and sorted(p.name for p in _cache.iterdir() if p.is_dir()) == sorted(
        [f".{busy}-running", key]
    )


def test_a_changed_corpus_gets_its_own_index(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "0", "contents": '"Zed"\nZed is a town.'}) + "\n")
    first, _ = retrieval.ensure_index(corpus)
    corpus.write_text(json.dumps({"id": "0", "contents": '"Zed"\nZed is a city.'}) + "\n")
    second, built = retrieval.ensure_index(corpus)
    assert built and first != second
    assert retrieval.Retriever(corpus).search("Zed city") == ['"Zed"\nZed is a city.']


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (  # Search-R1's processed files (FlashRAG's layout)
            {"id": "train_0", "question": "who sang x?", "golden_answers": ["Abba", "B"]},
            {
                "id": "train_0",
                "input": {"question": "who sang x?", "golden_answers": ["Abba", "B"]},
            },
        ),
        (  # HotpotQA
            {"_id": "5a8b", "question": "Which band?", "answer": "Yes", "type": "comparison"},
            {"id": "5a8b", "input": {"question": "Which band?", "golden_answers": ["Yes"]}},
        ),
        (  # NQ-open
            {"question": "when was x", "answer": ["1990", "in 1990"]},
            {"id": "7", "input": {"question": "when was x", "golden_answers": ["1990", "in 1990"]}},
        ),
        (  # TriviaQA
            {"question": "Q?", "answer": {"value": "Paris", "aliases": ["Paris", "Paree"]}},
            {"id": "7", "input": {"question": "Q?", "golden_answers": ["Paris", "Paree"]}},
        ),
        (  # Search-R1's training rows
            {"question": "Q?", "reward_model": {"ground_truth": {"target": ["x"]}}},
            {"id": "7", "input": {"question": "Q?", "golden_answers": ["x"]}},
        ),
    ],
)
def test_qa_formats_convert_to_tasks(record: dict[str, Any], expected: dict[str, Any]) -> None:
    assert qa_data.to_task(record, 7) == expected


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (  # NQ's signed 64-bit ids were refused
            {"id": -1220107454853145579, "question": "Q?", "answer": ["x"]},
            {"id": "-1220107454853145579", "input": {"question": "Q?", "golden_answers": ["x"]}},
        ),
        (  # TriviaQA on Hugging Face: its `question_id` was ignored
            {"question": "Q?", "question_id": "tc_1", "answer": {"value": "P", "aliases": ["P"]}},
            {"id": "tc_1", "input": {"question": "Q?", "golden_answers": ["P"]}},
        ),
        (  # TriviaQA's own files
            {"Question": "Q?", "QuestionId": "tc_2", "Answer": {"Value": "P", "Aliases": ["Pa"]}},
            {"id": "tc_2", "input": {"question": "Q?", "golden_answers": ["P", "Pa"]}},
        ),
        (  # Bamboogle
            {"Question": "Q?", "Answer": "Taft"},
            {"id": "7", "input": {"question": "Q?", "golden_answers": ["Taft"]}},
        ),
        (  # numbers as answers were refused
            {"question": "Q?", "answer": 1930},
            {"id": "7", "input": {"question": "Q?", "golden_answers": ["1930"]}},
        ),
        (
            {"question": "Q?", "answers": [1930, "1930", 2.5, 7.0]},
            {"id": "7", "input": {"question": "Q?", "golden_answers": ["1930", "2.5", "7"]}},
        ),
    ],
)
def test_more_qa_layouts_convert_to_tasks(record: dict[str, Any], expected: dict[str, Any]) -> None:
    assert qa_data.to_task(record, 7) == expected


def test_natural_questions_negative_ids_are_task_ids() -> None:
    """NQ's ids are signed 64-bit numbers: a negative one was refused as no task id."""
    records = [{"id": -1220107454853145579, "question": "Q?", "answer": ["x"]}]
    assert [task["id"] for task in qa_data.convert(records)] == ["-1220107454853145579"]


def test_records_without_an_id_never_take_another_records_id() -> None:
    """Numbered by position, the second record was `1`, which the third one's id is."""
    records = [
        {"id": "x", "question": "Q1?", "answer": "a1"},
        {"question": "Q2?", "answer": "a2"},
        {"id": "1", "question": "Q3?", "answer": "a3"},
        {"id": 1.1, "question": "Q4?", "answer": "a4"},
        {"question": "Q5?", "answer": "a5"},
    ]
    assert [task["id"] for task in qa_data.convert(records)] == ["x", "1.2", "1", "1.1", "4"]


TRIVIA = {"Question": "Q?", "QuestionId": "tc_1", "Answer": {"Value": "Lewis", "Aliases": []}}


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        (json.dumps({"Data": [TRIVIA], "Domain": "Web", "Version": 1.0}), ["tc_1"]),
        (json.dumps({"Data": [TRIVIA], "Domain": "Web"}, indent=2), ["tc_1"]),
        ("\ufeff" + json.dumps({"id": "a", "question": "Q?", "answer": "x"}) + "\n", ["a"]),
        ("\ufeff" + json.dumps([{"id": "a", "question": "Q?", "answer": "x"}], indent=1), ["a"]),
        (
            '{"id": "a", "question": "Q?", "answer": "x"}\n\n{"question": "Q?", "answer": "y"}\n',
            ["a", "1"],
        ),
    ],
)
def test_triviaqa_files_bom_files_and_jsonl_are_read(
    text: str, ids: list[str], tmp_path: Path
) -> None:
    """TriviaQA's `{"Data": [...]}` and a file starting with a UTF-8 BOM were refused."""
    source = tmp_path / "qa.json"
    source.write_text(text, encoding="utf-8")
    out = tmp_path / "tasks.jsonl"
    assert qa_data.main(["convert", str(source), str(out)]) == 0
    assert [task["id"] for task in read_jsonl(out)] == ids


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            '{\n  "Data": [\n    {"Question": "Q?",}\n  ]\n}\n',
            "not JSON: Expecting property name enclosed in double quotes: line 3 column 23",
        ),
        ('{"question": "Q?", "answer": "x"}\n{"question": oops}\n', "line 2 is not JSON"),
    ],
)
def test_a_broken_file_is_named_where_it_breaks(
    text: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pretty-printed file was read as JSONL: 'Expecting property name... line 1 column 2'."""
    source = tmp_path / "qa.json"
    source.write_text(text)
    assert qa_data.main(["convert", str(source), str(tmp_path / "tasks.jsonl")]) == 1
    assert says in capsys.readouterr().err


def test_a_record_without_answers_is_refused_with_its_number() -> None:
    with pytest.raises(qa_data.FormatError, match="record 3 has no question or no answers"):
        qa_data.to_task({"question": "Q?"}, 3)


@pytest.mark.parametrize(
    ("records", "says"),
    [
        ([{"question": "Q?", "answer": ["...", "The The"]}], "no answer is left after exact"),
        ([{"question": "   ", "answer": "x"}], "record 0 has no question"),
        ([3], "record 0 is int, not a JSON object"),
        ([{"id": "a", "question": "Q?", "answer": "x"}] * 2, "records 0 and 1 have one id: a"),
        ([{"id": "a b", "question": "Q?", "answer": "x"}], "id 'a b' is not a task id"),
        ([], "no record to convert"),
    ],
)
def test_records_no_training_could_use_are_refused(records: list[Any], says: str) -> None:
    """Each was written (or a traceback): an answer that normalises to nothing was matched by an
    empty answer; duplicate and malformed ids were refused later by `reins train`."""
    with pytest.raises(qa_data.FormatError, match=says):
        qa_data.convert(records)


@pytest.mark.parametrize(
    ("answer", "golden"), [("", [""]), ("the", ["A"]), ("", ["..."]), ("x", ["X."])]
)
def test_an_answer_that_normalises_to_nothing_never_matches(answer: str, golden: list[str]) -> None:
    assert exact_match(answer, golden) == (1.0 if answer == "x" else 0.0)


def test_the_converter_cli_writes_the_corpus_into_tasks(tmp_path: Path) -> None:
    source = tmp_path / "hotpot.json"
    records = [{"_id": name, "question": "Q?", "answer": "x"} for name in ("a", "b", "c")]
    source.write_text(" \n" + json.dumps(records))  # a JSON array, after a blank line
    corpus = tmp_path / "wiki.jsonl"
    corpus.write_text(json.dumps({"id": "0", "contents": '"X"\nX.'}) + "\n")
    out = tmp_path / "tasks.jsonl"
    assert (
        qa_data.main(["convert", str(source), str(out), "--corpus", str(corpus), "--limit", "2"])
        == 0
    )
    tasks = read_jsonl(out)
    assert len(tasks) == 2
    assert tasks[0]["input"]["corpus"] == str(corpus.resolve())


# --- two training steps through the real harness ----------------------------------------------


def searching_agent(task: dict[str, Any]) -> None:
    """The real agent, except that an untagged reply counts as a search for the question and
    then as the answer: a random tiny model never writes the tags, and this way its rollouts
    still search, read passages and answer, with every assistant message sent back unchanged."""
    from examples.search import agent

    real = agent.parse
    seen = {"untagged": 0}

    def lenient(reply: str) -> tuple[str, str] | None:
        action = real(reply)
        if action is None:
            seen["untagged"] += 1
            action = ("search", task["question"]) if seen["untagged"] == 1 else ("answer", reply)
        return action

    agent.parse = lenient
    agent.run(task)


@pytest.mark.slow
def test_two_training_steps_record_rewards_searches_and_one_sequence_per_rollout(
    tmp_path: Path, tiny_model_dir: Path, _cache: Path
) -> None:
    module("torch", "pip install -e '.[train]'")
    from reins.trainer.config import TrainConfig
    from reins.trainer.runtime import train

    tasks = tmp_path / "train.jsonl"
    tasks.write_text(
        "".join(line + "\n" for line in (EXAMPLE / "train.jsonl").read_text().splitlines()[:4])
    )
    val = tmp_path / "val.jsonl"
    val.write_text(
        "".join(line + "\n" for line in (EXAMPLE / "val.jsonl").read_text().splitlines()[:2])
    )
    run = TrainConfig.model_validate(
        {
            "run_name": "search",
            "runs_dir": tmp_path / "runs",
            "tasks": tasks,
            "val_tasks": val,
            "agent": "tests.examples.test_search:searching_agent",
            "model": tiny_model_dir,
            "steps": 2,
            "tasks_per_step": 2,
            "group_size": 2,
            "val_every": 2,
            "lr": 1e-3,
            "max_model_len": 1536,
            "rollout_timeout_s": 300,
            "tensorboard": False,
        }
    )
    records = asyncio.run(train(run))
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        assert record["rollouts/trained"] == 4
        assert record["samples/per_rollout"] == 1.0  # append-only history: one sequence each
        assert record["agent/searches"] == 1.0
        assert record["agent/answered"] == 1.0
        assert record["agent/turns"] == 2.0
    rewards, tools = recorded(run.run_dir)
    assert len(rewards) == 12  # 8 training rollouts and 2 validations of 2
    assert {r["value"] for r in rewards} <= {0.0, 1.0}
    assert all(r["metrics"]["searches"] == 1.0 for r in rewards)
    assert len(tools) == 12
    assert all(t["name"] == "search" and t["output"].startswith("Doc 1(Title: ") for t in tools)
    assert len([p for p in _cache.iterdir() if p.is_dir()]) == 1  # built once for all agents


def test_golden_answers_that_are_no_list_of_strings_fail_the_rollout_at_once() -> None:
    """A string was read letter by letter: the answer "D" matched the golden "Dreipolm"."""
    from examples.search import agent

    for golden in ("Dreipolm", ["Dreipolm", 1902]):
        with pytest.raises(ValueError, match=r"golden_answers is .*, not a list of strings"):
            agent.run({"question": "Q?", "golden_answers": golden})


@pytest.mark.parametrize(
    ("corpus", "says"),
    [
        ("", "holds no passages"),
        ('{"title": "a", "text": "b"}\n', "a passage is an object with its text in `contents`"),
        ('{"contents": null}\n', "a passage is an object with its text in `contents`"),
        ("not json\n", ":1: not JSON in UTF-8"),
    ],
)
def test_a_corpus_of_another_layout_is_refused_by_convert_and_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], corpus: str, says: str
) -> None:
    """`convert --corpus` took it (every rollout then failed at its first search) and `index`
    was a traceback."""
    (tmp_path / "corpus.jsonl").write_text(corpus)
    (tmp_path / "q.jsonl").write_text('{"question": "Q?", "answer": "x"}\n')
    args = [str(tmp_path / "q.jsonl"), str(tmp_path / "t.jsonl")]
    assert qa_data.main(["convert", *args, "--corpus", str(tmp_path / "corpus.jsonl")]) == 2
    assert qa_data.main(["index", str(tmp_path / "corpus.jsonl")]) == 1
    said = capsys.readouterr().err
    assert said.count(says) == 2 and not (tmp_path / "t.jsonl").exists()
