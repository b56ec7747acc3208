"""DPO with shared-prompt packing: each pair is one document ``prompt ‖ chosen ‖ rejected``.

    python examples/dpo_shared_prompt.py              # tiny model on CPU, seconds
    python examples/dpo_shared_prompt.py --config 1b  # ~1B Llama-style model on a GPU

The prompt is computed once per pair instead of twice; the share-question mask keeps the
rejected response from seeing the chosen one and its positions restart at ``len(prompt)``, so
the log-probabilities equal those of separate ``prompt ‖ response`` sequences
(:func:`flashmask.integrations.data.pack_preference`). The reference model is a frozen copy of
the initial policy.
"""

from __future__ import annotations

import copy
import sys

import common
import torch

from flashmask.integrations import data


def tokenize(record: dict) -> dict[str, list[int]]:
    return {key: common.encode(record[key]) for key in ("prompt", "chosen", "rejected")}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = common.parser(__doc__.splitlines()[0], max_tokens=128, samples=16)
    p.add_argument("--beta", type=float, default=0.1, help="DPO beta (0.1)")
    args = common.finish_args(p.parse_args(argv))
    pairs = [tokenize(r) for r in common.load_jsonl("preference.jsonl")]
    policy = common.build_model(args)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    meter = common.Meter(args.device)
    steps = common.batches(pairs, args.samples_per_step, args.steps, args.seed)
    for step_pairs in common.progress(steps, args.steps, "dpo"):
        batch = data.pack_preference(step_pairs, args.max_tokens, pad_token_id=common.PAD_ID)
        inputs = common.model_inputs(batch, args)
        index = {k: v.to(args.device) for k, v in batch.items()}
        with torch.no_grad():
            ref_chosen, ref_rejected = data.response_logps(reference(**inputs).logits, index)
        chosen, rejected = data.response_logps(policy(**inputs).logits, index)
        loss = data.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=args.beta)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        margin = (chosen - ref_chosen) - (rejected - ref_rejected)
        accuracy = (margin > 0).float().mean().item()
        tokens = int((inputs["input_ids"] != common.PAD_ID).sum())
        meter.step(tokens, loss=loss.item(), acc=accuracy)
    return meter.summary(f"dpo_shared_prompt [{args.config}, {args.attn}, {args.device}]")


if __name__ == "__main__":
    main(sys.argv[1:])
