"""Question-answering files you bring, as reins tasks for the search agent; and their corpus.

python -m examples.search.qa_data convert IN.jsonl OUT.jsonl [--corpus wiki-18.jsonl] [--limit N]
python -m examples.search.qa_data index wiki-18.jsonl

`convert` reads local JSONL, a JSON array or TriviaQA's {"Data": [...]} in the common layouts
(keys in any case, a UTF-8 BOM or not) and writes {"id", "input": {"question", "golden_answers",
"hops"?, "corpus"?}} lines:
- Search-R1's processed files: {"id", "question", "golden_answers": [...]}
  (its training rows' answers under "reward_model"."ground_truth"."target" work too)
- HotpotQA / 2WikiMultiHopQA: {"_id", "question", "answer": "..."}
- Natural Questions / TriviaQA / Bamboogle exports: {"question", "answer" | "answers": [...]}
  (numbers too: "answer": 1930), TriviaQA's {"answer": {"value", "aliases"}, "question_id"}
  and its official {"Question", "Answer": {"Value", "Aliases"}, "QuestionId"}, Bamboogle's
  {"Question", "Answer"}.
A record without an id is named by its position in the file (from 0), with a suffix (`3.1`)
when another record's id is that number.
`--corpus` writes the corpus path into every task, so the agent searches it instead of the
example's own corpus (env REINS_SEARCH_CORPUS does the same for every task). `index` builds
that corpus's BM25 index into the cache once, before training, instead of in the first rollout.
Nothing is downloaded: the files are yours.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from collections.abc import Iterable, Set
from pathlib import Path
from typing import Any

from examples.search import retrieval
from examples.search.answers import normalize

_ID = re.compile(r"[A-Za-z0-9._:\-]{1,200}")
"""What `reins train` takes as a task id (it follows the run's name in rollout ids, so NQ's
negative numbers, `-1220107454853145579`, are ids too)."""
_ID_KEYS = ("id", "_id", "qid", "question_id", "questionid", "example_id")


class FormatError(ValueError):
    """A record whose layout is not one of the known ones; the message names the record."""


def _lower_keys(record: dict[str, Any]) -> dict[str, Any]:
    """Bamboogle's `Question`, TriviaQA's `Answer`: a key's case does not matter."""
    return {str(key).lower(): value for key, value in record.items()}


def _text(value: Any) -> str | None:
    """An answer as text: a string, or a number (`1930`; `1930.0` reads 1930)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _answers(record: dict[str, Any]) -> list[str]:
    record = _lower_keys(record)
    for key in ("golden_answers", "answers", "answer", "target"):
        value = record.get(key)
        if _text(value) is not None:
            return [str(_text(value))]
        texts = [_text(v) for v in value] if isinstance(value, list) else []
        if texts and all(text is not None for text in texts):
            return list(dict.fromkeys(str(text) for text in texts))
        if isinstance(value, dict):  # TriviaQA: {"value": ..., "aliases": [...]}
            value = _lower_keys(value)
            found = [_text(value.get("value"))]
            found += [_text(a) for a in value.get("aliases") or [] if _text(a) is not None]
            if found := [text for text in found if text is not None]:
                return list(dict.fromkeys(found))
    reward_model = record.get("reward_model")
    if isinstance(reward_model, dict) and isinstance(reward_model.get("ground_truth"), dict):
        return _answers(reward_model["ground_truth"])
    return []


def _question(record: dict[str, Any]) -> str | None:
    record = _lower_keys(record)
    for key in ("question", "query", "problem"):
        if isinstance(record.get(key), str):
            return str(record[key])
    return None


def given_id(record: dict[str, Any]) -> str | None:
    """The record's own id (`id`, HotpotQA's `_id`, TriviaQA's `question_id`...), as text."""
    record = _lower_keys(record)
    return next((str(record[key]) for key in _ID_KEYS if record.get(key) is not None), None)


def to_task(
    record: dict[str, Any], number: int, corpus: Path | None = None, taken: Set[str] = frozenset()
) -> dict[str, Any]:
    """One record as a reins task. `number` names it when the record has no id: `7`, or `7.1`
    (`7.2`...) when `7` is in `taken` (the ids other records of the file give)."""
    if not isinstance(record, dict):
        raise FormatError(f"record {number} is {type(record).__name__}, not a JSON object")
    question = (_question(record) or "").strip()
    answers = _answers(record)
    if not question or not answers:
        raise FormatError(
            f"record {number} has no question or no answers (keys: {sorted(record)}); expected "
            "question + golden_answers / answer / answers"
        )
    # Exact match compares normalised answers: one that normalises to nothing ("", "...", "The
    # The") would be matched by an empty answer, so it is dropped, and a record left with none
    # is refused.
    answers = [answer for answer in answers if normalize(answer)]
    if not answers:
        raise FormatError(
            f"record {number}: no answer is left after exact match's normalisation (lower case, "
            "no punctuation or articles): an empty answer would match it"
        )
    identity = given_id(record)
    if identity is None:
        identity, again = str(number), 0
        while identity in taken:
            again += 1
            identity = f"{number}.{again}"
    task: dict[str, Any] = {"question": question, "golden_answers": answers}
    if type(record.get("hops")) is int and record["hops"] in (1, 2, 3, 4):
        task["hops"] = record["hops"]
    if corpus is not None:
        task["corpus"] = str(corpus.resolve())
    return {"id": str(identity), "input": task}


def read_records(path: Path) -> list[Any]:
    """The file's records: JSONL, or one JSON document: an array (HotpotQA's distribution) or
    TriviaQA's `{"Data": [...]}`, pretty-printed or not."""
    text = path.read_text(encoding="utf-8-sig")  # a BOM or not
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg != "Extra data":  # one document, broken: where, in it
            raise FormatError(f"not JSON: {error}") from error
        return _json_lines(text)  # one value, then another: JSONL
    if isinstance(document, dict):
        data = _lower_keys(document).get("data")
        if isinstance(data, list) and _question(document) is None:
            return data  # TriviaQA's file
        return [document]  # a JSONL file of one record
    return document if isinstance(document, list) else [document]


def _json_lines(text: str) -> list[Any]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise FormatError(f"line {number} is not JSON: {error}") from error
    return records


def convert(
    records: Iterable[dict[str, Any]], corpus: Path | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    chosen = list(itertools.islice(records, limit))
    taken = {i for r in chosen if isinstance(r, dict) and (i := given_id(r)) is not None}
    tasks = []
    ids: dict[str, int] = {}
    for number, record in enumerate(chosen):
        task = to_task(record, number, corpus, taken)
        if not _ID.fullmatch(task["id"]):
            raise FormatError(
                f"record {number}'s id {task['id']!r} is not a task id (letters, digits, . _ : -)"
            )
        if task["id"] in ids:
            raise FormatError(f"records {ids[task['id']]} and {number} have one id: {task['id']}")
        ids[task["id"]] = number
        tasks.append(task)
    if not tasks:
        raise FormatError("no record to convert")
    return tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.search.qa_data", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("convert", help="QA JSONL -> reins tasks")
    make.add_argument("input", type=Path)
    make.add_argument("output", type=Path)
    make.add_argument("--corpus", type=Path, help="the corpus JSONL these questions search")
    make.add_argument("--limit", type=int, help="keep the first N records")
    index = commands.add_parser("index", help="build a corpus's BM25 index into the cache now")
    index.add_argument("corpus", type=Path)
    args = parser.parse_args(argv)
    if args.command == "index":
        started = time.perf_counter()
        try:
            folder, built = retrieval.ensure_index(args.corpus)
        except (retrieval.CorpusError, OSError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        said = "built" if built else "already built"
        print(f"{folder}: {said} ({time.perf_counter() - started:.1f} s)")
        return 0
    if args.corpus is not None:
        # Its first passage read as the index will read them all: a corpus of another layout
        # failed every rollout at its first search.
        try:
            retrieval.check_corpus(args.corpus)
        except (retrieval.CorpusError, OSError) as error:
            print(f"--corpus: {error}", file=sys.stderr)
            return 2
    if args.limit is not None and args.limit < 1:
        print(f"--limit {args.limit}: keep at least 1 record", file=sys.stderr)
        return 2
    try:
        tasks = convert(read_records(args.input), args.corpus, args.limit)
        args.output.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    except (FormatError, ValueError) as error:  # JSON and UTF-8 errors are ValueErrors
        print(f"{args.input}: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # a missing file, a folder, an output folder that is not there
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.output}: {len(tasks)} tasks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
