"""Question-answering files you bring, as reins tasks for the search agent; and their corpus.

python -m examples.search.qa_data convert IN.jsonl OUT.jsonl [--corpus wiki-18.jsonl] [--limit N]
python -m examples.search.qa_data index wiki-18.jsonl

`convert` reads local JSONL in the common layouts and writes {"id", "input": {"question",
"golden_answers", "hops"?, "corpus"?}} lines:
- Search-R1's processed files: {"id", "question", "golden_answers": [...]}
  (its training rows' answers under "reward_model"."ground_truth"."target" work too)
- HotpotQA / 2WikiMultiHopQA: {"_id", "question", "answer": "..."}
- Natural Questions / TriviaQA / Bamboogle exports: {"question", "answer" | "answers": [...]},
  TriviaQA's {"answer": {"value", "aliases"}} too.
`--corpus` writes the corpus path into every task, so the agent searches it instead of the
example's own corpus (env REINS_SEARCH_CORPUS does the same for every task). `index` builds
that corpus's BM25 index into the cache once, before training, instead of in the first rollout.
Nothing is downloaded: the files are yours.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from examples.search import retrieval
from examples.search.answers import normalize

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,199}")
"""What the gateway takes as a rollout id, and `reins train` as a task id."""


class FormatError(ValueError):
    """A record whose layout is not one of the known ones; the message names the record."""


def _answers(record: dict[str, Any]) -> list[str]:
    for key in ("golden_answers", "answers", "answer", "target"):
        value = record.get(key)
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return list(value)
        if isinstance(value, dict):  # TriviaQA: {"value": ..., "aliases": [...]}
            found = [value["value"]] if isinstance(value.get("value"), str) else []
            found += [a for a in value.get("aliases", []) if isinstance(a, str)]
            if found:
                return list(dict.fromkeys(found))
    reward_model = record.get("reward_model")
    if isinstance(reward_model, dict) and isinstance(reward_model.get("ground_truth"), dict):
        return _answers(reward_model["ground_truth"])
    return []


def _question(record: dict[str, Any]) -> str | None:
    for key in ("question", "query", "problem"):
        if isinstance(record.get(key), str):
            return str(record[key])
    return None


def to_task(record: dict[str, Any], number: int, corpus: Path | None = None) -> dict[str, Any]:
    """One record as a reins task (`number` names it when the record has no id)."""
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
    identity = record.get("id", record.get("_id", record.get("qid")))
    if identity is None:
        identity = number
    task: dict[str, Any] = {"question": question, "golden_answers": answers}
    if type(record.get("hops")) is int and record["hops"] in (1, 2, 3, 4):
        task["hops"] = record["hops"]
    if corpus is not None:
        task["corpus"] = str(corpus.resolve())
    return {"id": str(identity), "input": task}


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """JSONL records; a JSON array file (HotpotQA's own distribution) works too."""
    with path.open(encoding="utf-8") as f:
        first = f.read(4096).lstrip()[:1]
        f.seek(0)
        if first == "[":
            yield from json.load(f)
            return
        for line in f:
            if line.strip():
                yield json.loads(line)


def convert(
    records: Iterable[dict[str, Any]], corpus: Path | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    tasks = []
    ids: dict[str, int] = {}
    for number, record in enumerate(records):
        if limit is not None and number >= limit:
            break
        task = to_task(record, number, corpus)
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
