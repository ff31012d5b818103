"""Writes train.jsonl and val.jsonl: non-coding tasks that need the computer, with a checker spec.

python examples/sandbox/make_tasks.py [--seed 0] [--per-kind 30] [--val-per-kind 6]

Every task is `{"id", "input": {"instruction", "files"?, "check"}}`: `files` are placed in the
sandbox's /work before the agent starts; `check` is what `checkers.check` grades:

- `{"kind": "file", "path", "content"}`: the file the agent wrote equals `content` (line ends and
  trailing blanks aside);
- `{"kind": "number", "value", "tolerance"}`: the final answer's number is `value`
  (`checkers.answer_number`: the last, the question's numbers and dates set aside);
- `{"kind": "text", "value"}`: the final answer is `value` (case and punctuation aside).

The split is per kind (the same share of every kind in val), so the output is byte-identical for a
seed and val holds no task of train.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORDS = """
apple river stone cloud tiger pencil garden mirror candle rocket violin planet butter window
forest dragon silver basket rabbit honey marble island castle feather lemon anchor bridge copper
desert engine falcon glove harbor jacket kettle ladder meadow needle orange pepper quartz ribbon
saddle tunnel umbrella valley wagon yogurt zebra bottle canyon dolphin eagle fabric ginger hammer
""".split()  # noqa: SIM905 (a word list reads best as text)
ADJECTIVES = "quiet bright small old green heavy quick warm tall narrow".split()  # noqa: SIM905
VERBS = ["rests near", "waits by", "rolls past", "sits under", "shines over", "leans on"]
NAMES = "Ada Ben Chloe Dmitri Elena Farid Grace Hugo Ines Jonas Kira Luis Mona Nils".split()  # noqa: SIM905
CITIES = "Lisbon Oslo Lima Cairo Quito Hanoi Accra Perth Riga Dakar".split()  # noqa: SIM905
REGIONS = "north south east west central".split()  # noqa: SIM905

Task = dict[str, Any]


def sentence(rng: random.Random) -> str:
    a, b = rng.sample(WORDS, 2)
    return f"The {rng.choice(ADJECTIVES)} {a} {rng.choice(VERBS)} the {b}."


def create_file(rng: random.Random) -> Task:
    name = rng.choice(["note.txt", "hello.txt", "memo.txt", "out/line.txt", "docs/readme.txt"])
    line = sentence(rng)
    return {
        "instruction": f"Create a file named {name} that contains exactly this line:\n{line}",
        "check": {"kind": "file", "path": name, "content": line},
    }


def sort_lines(rng: random.Random) -> Task:
    words = rng.sample(WORDS, rng.randint(6, 12))
    reverse = rng.random() < 0.3
    order = "reverse alphabetical order" if reverse else "alphabetical order"
    return {
        "instruction": f"The file words.txt has one word per line. Write the same words in {order}"
        ", one per line, to sorted.txt.",
        "files": {"words.txt": "\n".join(words) + "\n"},
        "check": {
            "kind": "file",
            "path": "sorted.txt",
            "content": "\n".join(sorted(words, reverse=reverse)),
        },
    }


def uppercase(rng: random.Random) -> Task:
    text = "\n".join(sentence(rng) for _ in range(rng.randint(2, 4)))
    return {
        "instruction": "Write the text of note.txt in upper case to upper.txt (same lines).",
        "files": {"note.txt": text + "\n"},
        "check": {"kind": "file", "path": "upper.txt", "content": text.upper()},
    }


def filter_csv(rng: random.Random) -> Task:
    rows = [
        f"{name},{rng.choice(CITIES)},{rng.randint(18, 80)}"
        for name in rng.sample(NAMES, rng.randint(8, 14))
    ]
    limit = rng.choice([30, 40, 50, 60])
    kept = [row for row in rows if int(row.rsplit(",", 1)[1]) > limit]
    return {
        "instruction": f"people.csv has the columns name,city,age. Write to older.csv its header "
        f"line followed by the rows whose age is greater than {limit}, in their original order.",
        "files": {"people.csv": "\n".join(["name,city,age", *rows]) + "\n"},
        "check": {
            "kind": "file",
            "path": "older.csv",
            "content": "\n".join(["name,city,age", *kept]),
        },
    }


def count_words(rng: random.Random) -> Task:
    text = " ".join(sentence(rng) for _ in range(rng.randint(3, 9)))
    return {
        "instruction": "Count the words (separated by whitespace) in text.txt and write just the "
        "number to count.txt.",
        "files": {"text.txt": text + "\n"},
        "check": {"kind": "file", "path": "count.txt", "content": str(len(text.split()))},
    }


def sum_of_squares(rng: random.Random) -> Task:
    n = rng.randint(20, 5000)
    return {
        "instruction": f"What is the sum of the squares of the integers from 1 to {n}? "
        "Answer with the number.",
        "check": {"kind": "number", "value": sum(i * i for i in range(1, n + 1)), "tolerance": 0},
    }


def count_primes(rng: random.Random) -> Task:
    n = rng.randint(100, 30000)
    sieve = bytearray([1]) * n
    sieve[:2] = b"\0\0"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))
    return {
        "instruction": f"How many prime numbers are smaller than {n}? Answer with the number.",
        "check": {"kind": "number", "value": sum(sieve), "tolerance": 0},
    }


def date_difference(rng: random.Random) -> Task:
    start = datetime.date(1990, 1, 1) + datetime.timedelta(days=rng.randint(0, 12000))
    end = start + datetime.timedelta(days=rng.randint(30, 9000))
    return {
        "instruction": f"How many days are there from {start.isoformat()} to {end.isoformat()}? "
        "Answer with the number of days.",
        "check": {"kind": "number", "value": (end - start).days, "tolerance": 0},
    }


def sales_file(rng: random.Random) -> tuple[list[tuple[str, int, float]], str]:
    rows = [
        (rng.choice(REGIONS), rng.randint(1, 400), round(rng.uniform(1, 90), 2))
        for _ in range(rng.randint(10, 20))
    ]
    lines = ["region,units,price", *(f"{r},{u},{p:.2f}" for r, u, p in rows)]
    return rows, "\n".join(lines) + "\n"


def csv_figure(rng: random.Random) -> Task:
    rows, text = sales_file(rng)
    column = rng.choice(["units", "price"])
    values = [u if column == "units" else p for _, u, p in rows]
    what = rng.choice(["mean", "max", "min", "sum"])
    figure = {
        "mean": sum(values) / len(values),
        "max": max(values),
        "min": min(values),
        "sum": sum(values),
    }[what]
    return {
        "instruction": f"sales.csv has the columns region,units,price. What is the {what} of the "
        f"{column} column? Answer with the number, rounded to 2 decimal places.",
        "files": {"sales.csv": text},
        "check": {"kind": "number", "value": round(figure, 2), "tolerance": 0.01},
    }


def top_region(rng: random.Random) -> Task:
    while True:
        rows, text = sales_file(rng)
        totals: dict[str, int] = {}
        for region, units, _ in rows:
            totals[region] = totals.get(region, 0) + units
        best = sorted(totals.values())
        if len(best) == 1 or best[-1] != best[-2]:  # one right answer only
            break
    return {
        "instruction": "sales.csv has the columns region,units,price. Which region has the largest "
        "total of units? Answer with the region's name only.",
        "files": {"sales.csv": text},
        "check": {"kind": "text", "value": max(totals, key=lambda r: totals[r])},
    }


KINDS: dict[str, Callable[[random.Random], Task]] = {
    "create": create_file,
    "sort": sort_lines,
    "upper": uppercase,
    "filter": filter_csv,
    "count": count_words,
    "squares": sum_of_squares,
    "primes": count_primes,
    "days": date_difference,
    "figure": csv_figure,
    "region": top_region,
}


def make_tasks(seed: int, per_kind: int, val_per_kind: int) -> tuple[list[Task], list[Task]]:
    """(train, val) task lines: `per_kind` distinct tasks of every kind, `val_per_kind` of them
    held out."""
    rng = random.Random(seed)
    train: list[Task] = []
    val: list[Task] = []
    for kind, make in KINDS.items():
        seen: set[str] = set()
        made: list[Task] = []
        while len(made) < per_kind:
            task = make(rng)
            key = json.dumps(task, sort_keys=True)
            if key not in seen:  # no task twice, so none is in both train and val
                seen.add(key)
                made.append({"id": f"{kind}-{len(made):03d}", "input": task})
        val += made[:val_per_kind]
        train += made[val_per_kind:]
    rng.shuffle(train)
    rng.shuffle(val)
    return train, val


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-kind", type=int, default=30)
    parser.add_argument("--val-per-kind", type=int, default=6)
    args = parser.parse_args()
    train, val = make_tasks(args.seed, args.per_kind, args.val_per_kind)
    here = Path(__file__).parent
    for name, tasks in (("train.jsonl", train), ("val.jsonl", val)):
        (here / name).write_text("".join(json.dumps(task) + "\n" for task in tasks))
        print(f"{here / name}: {len(tasks)} tasks")


if __name__ == "__main__":
    main()
