"""Regenerate the example datasets: ``python examples/data/make_data.py``.

Small, deterministic, byte-level: arithmetic and string questions with short answers.
``sft.jsonl`` holds ``{"prompt", "completion"}`` records; ``preference.jsonl`` holds
``{"prompt", "chosen", "rejected"}`` records whose chosen answer is right and rejected one wrong.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [
    "cat", "flash", "mask", "tensor", "kernel", "python", "packing", "prompt",
    "reward", "window", "causal", "token", "matrix", "vector", "layer", "query",
]  # fmt: skip


def _question(rng: random.Random) -> tuple[str, str, str]:
    """(question, right answer, wrong answer)."""
    kind = rng.choice(["add", "sub", "mul", "reverse", "upper", "length"])
    if kind in ("add", "sub", "mul"):
        a, b = rng.randint(2, 40), rng.randint(2, 20)
        symbol, value = {"add": ("+", a + b), "sub": ("-", a - b), "mul": ("*", a * b)}[kind]
        return f"What is {a} {symbol} {b}?", str(value), str(value + rng.choice([-2, -1, 1, 3]))
    word = rng.choice(WORDS)
    if kind == "reverse":
        return f"Spell '{word}' backwards.", word[::-1], word[::-1][1:] + word[-1]
    if kind == "upper":
        return f"Write '{word}' in capitals.", word.upper(), word.capitalize()
    return f"How many letters are in '{word}'?", str(len(word)), str(len(word) + 1)


def main() -> None:
    rng = random.Random(0)
    here = Path(__file__).parent
    with open(here / "sft.jsonl", "w") as f:
        for _ in range(48):
            question, right, _ = _question(rng)
            record = {"prompt": f"Q: {question}\nA: ", "completion": f"{right}\n"}
            f.write(json.dumps(record) + "\n")
    with open(here / "preference.jsonl", "w") as f:
        for _ in range(48):
            question, right, wrong = _question(rng)
            record = {
                "prompt": f"Q: {question}\nA: ",
                "chosen": f"{right}\n",
                "rejected": f"{wrong}\n",
            }
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
