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
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


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
    question = _question(record)
    answers = _answers(record)
    if not question or not answers:
        raise FormatError(
            f"record {number} has no question or no answers (keys: {sorted(record)}); expected "
            "question + golden_answers / answer / answers"
        )
    identity = record.get("id", record.get("_id", record.get("qid", number)))
    task: dict[str, Any] = {"question": question.strip(), "golden_answers": answers}
    if record.get("hops") in (1, 2, 3, 4):
        task["hops"] = record["hops"]
    if corpus is not None:
        task["corpus"] = str(corpus.resolve())
    return {"id": str(identity), "input": task}


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """JSONL records; a JSON array file (HotpotQA's own distribution) works too."""
    with path.open() as f:
        first = f.read(1)
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
    for number, record in enumerate(records):
        if limit is not None and number >= limit:
            break
        tasks.append(to_task(record, number, corpus))
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
        from examples.search.retrieval import ensure_index

        started = time.perf_counter()
        folder, built = ensure_index(args.corpus)
        said = "built" if built else "already built"
        print(f"{folder}: {said} ({time.perf_counter() - started:.1f} s)")
        return 0
    if args.corpus is not None and not args.corpus.is_file():
        print(f"--corpus {args.corpus} is not a file", file=sys.stderr)
        return 2
    try:
        tasks = convert(read_records(args.input), args.corpus, args.limit)
    except (FormatError, ValueError) as error:
        print(f"{args.input}: {error}", file=sys.stderr)
        return 1
    args.output.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    print(f"{args.output}: {len(tasks)} tasks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
