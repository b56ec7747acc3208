"""A Bradley-Terry reward model trained on shared-prompt packed pairs.

    python examples/reward_model.py                   # tiny model on CPU, seconds
    python examples/reward_model.py --config 1b       # ~1B Llama-style model on a GPU

Pairs are packed as in ``dpo_shared_prompt.py``; a one-label ``LlamaForSequenceClassification``
scores every token and each response's reward is read at its last token
(:func:`flashmask.integrations.data.response_scores`), which equals the score of the separate
``prompt ‖ response`` sequence.
"""

from __future__ import annotations

import sys

import common
import torch
from dpo_shared_prompt import tokenize

from flashmask.integrations import data


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = common.parser(__doc__.splitlines()[0], max_tokens=128, samples=16)
    args = common.finish_args(p.parse_args(argv))
    pairs = [tokenize(r) for r in common.load_jsonl("preference.jsonl")]
    model = common.build_model(args, task="score", num_labels=1)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    meter = common.Meter(args.device)
    steps = common.batches(pairs, args.samples_per_step, args.steps, args.seed)
    for step_pairs in common.progress(steps, args.steps, "reward"):
        batch = data.pack_preference(step_pairs, args.max_tokens, pad_token_id=common.PAD_ID)
        inputs = common.model_inputs(batch, args)
        # The classification head pools one token per row; packed rows need every token's score.
        hidden = model.model(**inputs).last_hidden_state
        index = {k: v.to(args.device) for k, v in batch.items()}
        chosen, rejected = data.response_scores(model.score(hidden), index)
        loss = data.bradley_terry_loss(chosen.float(), rejected.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        accuracy = (chosen > rejected).float().mean().item()
        tokens = int((inputs["input_ids"] != common.PAD_ID).sum())
        meter.step(tokens, loss=loss.item(), acc=accuracy)
    return meter.summary(f"reward_model [{args.config}, {args.attn}, {args.device}]")


if __name__ == "__main__":
    main(sys.argv[1:])
