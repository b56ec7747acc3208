"""Packed SFT: best-fit-decreasing packing, one causal document per sample, flashmask attention.

    python examples/sft_packed.py                     # tiny model on CPU, seconds
    python examples/sft_packed.py --config 1b         # ~1B Llama-style model on a GPU

Every step packs ``--samples-per-step`` prompt/completion samples into rows of at most
``--max-tokens`` tokens (:func:`flashmask.integrations.data.pack_sft`); the loss covers the
completions only (prompt labels are -100) and no token attends to, or is predicted from, another
sample. ``--attn sdpa`` runs the same mask as a dense 4-D tensor for comparison.
"""

from __future__ import annotations

import sys

import common


def tokenize(record: dict) -> dict[str, list[int]]:
    prompt, completion = common.encode(record["prompt"]), common.encode(record["completion"])
    return {"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion}


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = common.parser(__doc__.splitlines()[0], max_tokens=128, samples=16).parse_args(argv)
    args = common.finish_args(args)
    samples = [tokenize(r) for r in common.load_jsonl("sft.jsonl")]
    model = common.build_model(args)
    model.train()
    return common.train_packed_sft(model, model.parameters(), samples, args, "sft_packed")


if __name__ == "__main__":
    main(sys.argv[1:])
