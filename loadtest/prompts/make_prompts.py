"""Regenerate ``synthetic.jsonl``: 200 chat prompts with a realistic spread of lengths, fixed seed.

Real chat traffic has log-normal prompt and answer lengths: most requests are short, a long tail
is not. No tokenizer is involved: a "token" here is one word from a fixed vocabulary, which is how
the pod simulator counts prompt tokens too. Run ``python -m loadtest.prompts.make_prompts``; the
output is checked in so that a load test never downloads anything.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("synthetic.jsonl")
SEED = 13
COUNT = 200
VOCABULARY = (
    "sluice gate water level channel flow river lock canal weir spillway reservoir dam pressure "
    "valve turbine basin current tide mill stream bank silt flood drain pump culvert ditch "
    "explain describe compare summarise list why how when what which please briefly detail"
)


def _lognormal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(0.0, sigma) * median)))


def build(seed: int = SEED, count: int = COUNT) -> list[dict[str, object]]:
    """``count`` records: id, prompt text, its length in words, and the answer length to ask for."""
    rng = random.Random(seed)
    words_list = VOCABULARY.split()
    rows = []
    for index in range(count):
        words = _lognormal_int(rng, median=120, sigma=1.0, low=4, high=3000)
        output = _lognormal_int(rng, median=160, sigma=0.8, low=8, high=1024)
        text = " ".join(rng.choice(words_list) for _ in range(words))
        rows.append({"id": index, "prompt": text, "prompt_words": words, "max_tokens": output})
    return rows


def main() -> None:
    rows = build()
    OUT.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))
    print(f"wrote {len(rows)} prompts to {OUT}")


if __name__ == "__main__":
    main()
