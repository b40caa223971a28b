"""Write the search-r1 example's corpus and QA data (deterministic from --seed).

An invented world: countries, each with a capital, a main export, a river, a national animal, a founding
year and a neighbour. Every fact is one short passage; every question is answered by exactly one passage,
so retrieval decides whether a question is answerable (the names are made up, a model cannot know them).

    python examples/search-r1/make_data.py --out-dir examples/search-r1/data --seed 0

writes corpus.jsonl ({"id", "title", "text"}), qa_train.jsonl and qa_test.jsonl
({"question", "answer", "prompt"}: the prompt is the Search-R1 instruction followed by the question).
"""

from __future__ import annotations

import argparse
import json
import os
import random

ONSETS = ["b", "d", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr", "gl"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
CODAS = ["", "n", "r", "l", "s", "th", "nd", "x"]
EXPORTS = ["copper", "salt", "timber", "wool", "tin", "silk", "amber", "coffee", "rice", "marble", "glass", "iron"]
ANIMALS = ["heron", "lynx", "otter", "falcon", "ibex", "badger", "crane", "wolf", "stag", "owl", "seal", "hare"]

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as you want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: "
)

# (title format, passage format, question format, answer field)
FACTS = [
    ("capital", "The capital of {country} is {capital}.", "What is the capital of {country}?", "capital"),
    ("export", "The main export of {country} is {export}.", "What is the main export of {country}?", "export"),
    ("river", "The {river} river flows through {capital}, the capital of {country}.",
     "Which river flows through {capital}?", "river"),
    ("animal", "The national animal of {country} is the {animal}.", "What is the national animal of {country}?",
     "animal"),
    ("founded", "{country} was founded in the year {year}.", "In which year was {country} founded?", "year"),
    ("neighbour", "{country} shares its eastern border with {neighbour}.",
     "Which country borders {country} to the east?", "neighbour"),
]


def _name(rng: random.Random, used: set[str], syllables: int) -> str:
    while True:
        name = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))
        name = name.capitalize()
        if name not in used and 4 <= len(name) <= 12:
            used.add(name)
            return name


def make_world(num_countries: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    used: set[str] = set()
    countries = [
        {
            "country": _name(rng, used, 2) + rng.choice(["ia", "a", "land", "or"]),
            "capital": _name(rng, used, 2),
            "river": _name(rng, used, 2),
            "export": rng.choice(EXPORTS),
            "animal": rng.choice(ANIMALS),
            "year": str(rng.randrange(900, 1900)),
        }
        for _ in range(num_countries)
    ]
    for i, c in enumerate(countries):
        c["neighbour"] = countries[(i + 1) % num_countries]["country"]
    return countries


def make_data(num_countries: int, seed: int) -> tuple[list[dict], list[dict]]:
    corpus, qa = [], []
    for c in make_world(num_countries, seed):
        for kind, passage, question, answer in FACTS:
            corpus.append({"id": str(len(corpus)), "title": f"{c['country']} ({kind})", "text": passage.format(**c)})
            q = question.format(**c)
            qa.append({"question": q, "answer": c[answer], "prompt": INSTRUCTION + q})
    random.Random(seed + 1).shuffle(qa)
    return corpus, qa


def _write(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    parser.add_argument("--num-countries", type=int, default=40, help="6 passages and 6 questions per country")
    parser.add_argument("--num-test", type=int, default=40, help="questions held out in qa_test.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    corpus, qa = make_data(args.num_countries, args.seed)
    os.makedirs(args.out_dir, exist_ok=True)
    _write(os.path.join(args.out_dir, "corpus.jsonl"), corpus)
    _write(os.path.join(args.out_dir, "qa_train.jsonl"), qa[args.num_test :])
    _write(os.path.join(args.out_dir, "qa_test.jsonl"), qa[: args.num_test])
    print(f"wrote {len(corpus)} passages, {len(qa) - args.num_test} train and {args.num_test} test questions "
          f"to {args.out_dir}")


if __name__ == "__main__":
    main()
