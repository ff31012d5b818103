"""Writes train.jsonl and val.jsonl: one secret word per task, held-out words for validation.

python examples/recall/make_tasks.py [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = """
apple river stone cloud tiger pencil garden mirror candle rocket violin planet butter window
forest dragon silver basket rabbit honey marble island castle feather lemon anchor bridge copper
desert engine falcon glove harbor jacket kettle ladder meadow needle orange pepper quartz ribbon
saddle tunnel umbrella valley wagon yogurt zebra bottle canyon dolphin eagle fabric ginger hammer
iron jungle kitten lantern magnet nickel oyster parrot pillow puzzle radio salmon tomato trumpet
velvet walnut wizard beacon blanket cactus cherry cotton crystal donkey fossil galaxy goblin
guitar helmet iceberg jelly koala lobster mango monkey muffin orchid panda peanut penguin pirate
pumpkin raven robot sailor shadow spider statue sunset thunder turtle vapor walrus whistle
""".split()  # noqa: SIM905 (a word list reads best as text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val", type=int, default=32, help="held-out words")
    args = parser.parse_args()
    words = sorted(set(WORDS))
    random.Random(args.seed).shuffle(words)
    val, train = words[: args.val], words[args.val :]
    here = Path(__file__).parent
    for name, chosen in (("train.jsonl", train), ("val.jsonl", val)):
        with (here / name).open("w") as out:
            for word in chosen:
                out.write(json.dumps({"id": word, "input": {"word": word}}) + "\n")
        print(f"{here / name}: {len(chosen)} tasks")


if __name__ == "__main__":
    main()
