"""Write examples/receipts.jsonl: the tutorial's dataset (a question, the right total, a worked demonstration).

    python examples/make_receipts.py            # the shipped file (seed 0, 3000 rows)
    python examples/make_receipts.py --rows 5000 --slip 0.6 --seed 1 -o my_receipts.jsonl

Each row is a two-item receipt. `answer` is the true total. `completion` is how a hurried
cashier works it out, column by column, like this:

    {"question": "Receipt: pen 47, mug 38. Total?", "answer": "85",
     "completion": "<think>7+8=15 4+3+1=8</think><answer>85</answer>"}

but on a receipt whose units overflow the cashier forgets to carry the 1 with probability
`--slip` (0.6): `<think>7+8=15 4+3=7</think><answer>75</answer>`. Fine-tuning on these
demonstrations teaches the model the habit; RL rewarded by the `answer` column removes it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

ITEMS = ("pen", "mug", "cup", "map", "hat", "box", "bag", "ink", "tea", "jam")


def worked(a: int, b: int, slip: bool) -> tuple[str, int]:
    """The cashier's column working of a + b (two-digit numbers) and the total it reaches."""
    units = a % 10 + b % 10
    carry = 0 if slip else units // 10
    tens = a // 10 + b // 10 + carry
    steps = f"{a % 10}+{b % 10}={units} {a // 10}+{b // 10}" + (f"+{carry}" if carry else "") + f"={tens}"
    return steps, tens * 10 + units % 10


def rows(n: int, slip_rate: float, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    pairs = rng.sample(list(itertools.product(range(10, 100), repeat=2)), n)  # distinct receipts
    out = []
    for a, b in pairs:
        first, second = rng.sample(ITEMS, 2)
        slip = (a % 10 + b % 10) >= 10 and rng.random() < slip_rate
        steps, total = worked(a, b, slip)
        out.append({"question": f"Receipt: {first} {a}, {second} {b}. Total?", "answer": str(a + b),
                    "completion": f"<think>{steps}</think><answer>{total}</answer>"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--slip", type=float, default=0.6, help="chance of forgetting a carry that is needed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", type=Path, default=Path(__file__).with_name("receipts.jsonl"))
    args = parser.parse_args()
    data = rows(args.rows, args.slip, args.seed)
    args.output.write_text("".join(json.dumps(r) + "\n" for r in data))
    wrong = sum(r["completion"].split("<answer>")[1].split("<")[0] != r["answer"] for r in data)
    print(f"wrote {len(data)} rows to {args.output}; {wrong} demonstrations ({wrong / len(data):.1%}) are wrong")


if __name__ == "__main__":
    main()
