"""Writes corpus.jsonl, train.jsonl and val.jsonl: questions about invented entities.

python examples/search/make_data.py [--seed 0]

Every name is built from syllables, so no model knows the answers: they must be searched for.
Two separate worlds (people, towns, companies, inventions) are generated, one for training and
one for validation, so validation questions are about entities training never saw; both worlds'
passages share one corpus. Near-namesakes (relatives sharing a surname, companies sharing a
stem) and passages that name an entity without the asked fact are the distractors.

The same seed writes byte-identical files (no set iteration, fixed key order).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

ONSETS = "b br d dr f g gr h k kr l m n p pr r s st t tr v w z".split()  # noqa: SIM905
VOWELS = "a e i o u ae ei ou".split()  # noqa: SIM905
CODAS = "l n r s th nd rk lm st v x".split()  # noqa: SIM905
FIRST_ENDINGS = ["a", "o", "en", "is", "ette", "ard", "in", "ia"]
TOWN_ENDINGS = ["holm", "ford", "wick", "mere", "stead", "by", "gate", "thorpe"]
COMPANY_KINDS = ["Works", "Foundry", "Press", "Mills", "Trading", "Lines", "Instruments"]
PRODUCTS = ["lamps", "clocks", "bicycles", "rope", "glassware", "maps", "pianos", "soap", "tiles"]
PROFESSIONS = ["clockmaker", "engineer", "chemist", "weaver", "surveyor", "printer", "glassblower"]
DEVICES = ["loom", "engine", "lens", "press", "valve", "lantern", "compass", "pump"]


@dataclass
class World:
    towns: list[str] = field(default_factory=list)
    rivers: dict[str, str] = field(default_factory=dict)  # town -> river
    town_founders: dict[str, str] = field(default_factory=dict)  # town -> person
    people: list[str] = field(default_factory=list)
    birthplace: dict[str, str] = field(default_factory=dict)
    profession: dict[str, str] = field(default_factory=dict)
    companies: list[str] = field(default_factory=list)
    founder: dict[str, str] = field(default_factory=dict)
    headquarters: dict[str, str] = field(default_factory=dict)
    year: dict[str, int] = field(default_factory=dict)
    product: dict[str, str] = field(default_factory=dict)
    inventions: list[str] = field(default_factory=list)
    inventor: dict[str, str] = field(default_factory=dict)
    invented_in: dict[str, int] = field(default_factory=dict)


class Names:
    """Invented words, each used once across both worlds."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def stem(self, syllables: int) -> str:
        while True:
            word = "".join(
                self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(syllables - 1)
            )
            word += self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + self.rng.choice(CODAS)
            word = word.capitalize()
            if word not in self.used and len(word) >= 4:
                self.used.add(word)
                return word

    def first(self) -> str:
        return self.stem(1) + self.rng.choice(FIRST_ENDINGS)


def build_world(names: Names, towns: int, families: int, companies: int, inventions: int) -> World:
    rng = names.rng
    world = World()
    for _ in range(towns):
        town = names.stem(1) + rng.choice(TOWN_ENDINGS)
        world.towns.append(town)
        world.rivers[town] = names.stem(2)
    # Families of two or three share a surname: namesakes a search must tell apart.
    for _ in range(families):
        surname = names.stem(2)
        for _ in range(rng.choice([2, 2, 3])):
            person = f"{names.first()} {surname}"
            world.people.append(person)
            world.birthplace[person] = rng.choice(world.towns)
            world.profession[person] = rng.choice(PROFESSIONS)
    for town in world.towns:
        world.town_founders[town] = rng.choice(world.people)
    # Companies come in pairs sharing a stem ("Brelan Works", "Brelan Press").
    while len(world.companies) < companies:
        stem = names.stem(2)
        for kind in rng.sample(COMPANY_KINDS, 2):
            company = f"{stem} {kind}"
            world.companies.append(company)
            world.founder[company] = rng.choice(world.people)
            world.headquarters[company] = rng.choice(world.towns)
            world.year[company] = rng.randrange(1820, 1960)
            world.product[company] = rng.choice(PRODUCTS)
    for _ in range(inventions):
        invention = f"{names.stem(2)} {rng.choice(DEVICES)}"
        world.inventions.append(invention)
        world.inventor[invention] = rng.choice(world.people)
        world.invented_in[invention] = rng.randrange(1780, 1950)
    return world


def passages(world: World, rng: random.Random) -> list[tuple[str, str]]:
    """(title, text) pairs: one passage of facts per entity, plus mentions without the facts."""
    out: list[tuple[str, str]] = []
    for town in world.towns:
        out.append(
            (
                town,
                f"{town} is a small town on the {world.rivers[town]} river. It was founded by "
                f"{world.town_founders[town]}.",
            )
        )
        out.append(
            (
                f"{town} Fair",
                f"The {town} Fair is held every spring. Traders from the whole "
                f"{world.rivers[town]} valley sell {rng.choice(PRODUCTS)} there.",
            )
        )
    for person in world.people:
        out.append(
            (
                person,
                f"{person} was a {world.profession[person]} born in {world.birthplace[person]}.",
            )
        )
    for company in world.companies:
        out.append(
            (
                company,
                f"{company} is a maker of {world.product[company]}, founded in "
                f"{world.year[company]} by {world.founder[company]}. Its headquarters are in "
                f"{world.headquarters[company]}.",
            )
        )
        out.append(
            (
                f"{company} Prize",
                f"The {company} Prize is awarded each year to the best apprentice "
                f"{rng.choice(PROFESSIONS)}.",
            )
        )
    for invention in world.inventions:
        out.append(
            (
                f"The {invention}",
                f"The {invention} was invented by {world.inventor[invention]} in "
                f"{world.invented_in[invention]}.",
            )
        )
    return out


def river_answers(river: str) -> list[str]:
    return [river, f"{river} river", f"river {river}"]


def questions(world: World, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(single-hop, two-hop) questions, each {"question", "golden_answers", "hops"}."""

    def q(question: str, answers: list[str], hops: int) -> dict:
        return {"question": question, "golden_answers": answers, "hops": hops}

    single: list[dict] = []
    for company in world.companies:
        single += [
            q(f"Who founded {company}?", [world.founder[company]], 1),
            q(
                f"In which town is {company} headquartered?",
                [world.headquarters[company]],
                1,
            ),
            q(f"In which year was {company} founded?", [str(world.year[company])], 1),
        ]
    for person in world.people:
        single.append(q(f"In which town was {person} born?", [world.birthplace[person]], 1))
    for invention in world.inventions:
        single.append(q(f"Who invented the {invention}?", [world.inventor[invention]], 1))
    for town in world.towns:
        single += [
            q(f"Which river flows through {town}?", river_answers(world.rivers[town]), 1),
            q(f"Who founded the town of {town}?", [world.town_founders[town]], 1),
        ]
    double: list[dict] = []
    for company in world.companies:
        double += [
            q(
                f"In which town was the founder of {company} born?",
                [world.birthplace[world.founder[company]]],
                2,
            ),
            q(
                f"Which river flows through the town where {company} is headquartered?",
                river_answers(world.rivers[world.headquarters[company]]),
                2,
            ),
        ]
    for invention in world.inventions:
        double.append(
            q(
                f"In which town was the inventor of the {invention} born?",
                [world.birthplace[world.inventor[invention]]],
                2,
            )
        )
    rng.shuffle(single)
    rng.shuffle(double)
    return single, double


def tasks(single: list[dict], double: list[dict], n_single: int, n_double: int, prefix: str):
    chosen = single[:n_single] + double[:n_double]
    if len(chosen) < n_single + n_double:
        raise ValueError(f"{prefix}: only {len(chosen)} questions for {n_single + n_double}")
    return [{"id": f"{prefix}-{i:03d}", "input": item} for i, item in enumerate(chosen)]


def generate(seed: int) -> dict[str, list[dict]]:
    """The three files' records: corpus, train and val."""
    rng = random.Random(seed)
    names = Names(rng)
    train_world = build_world(names, towns=30, families=32, companies=44, inventions=30)
    val_world = build_world(names, towns=8, families=8, companies=12, inventions=8)
    texts = passages(train_world, rng) + passages(val_world, rng)
    rng.shuffle(texts)
    # Search-R1's wiki-18 format: the quoted title on the first line of `contents`.
    corpus = [
        {"id": str(i), "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(texts)
    ]
    train = tasks(*questions(train_world, rng), n_single=240, n_double=60, prefix="train")
    val = tasks(*questions(val_world, rng), n_single=48, n_double=16, prefix="val")
    rng.shuffle(train)
    return {"corpus.jsonl": corpus, "train.jsonl": train, "val.jsonl": val}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    for name, records in generate(args.seed).items():
        path = args.out / name
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
        print(f"{path}: {len(records)} records")


if __name__ == "__main__":
    main()
