"""Shared-prompt DPO and reward-model batches against separate prompt+response forward passes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from flashmask.integrations import data
from tests.integrations.tiny import assert_results_close, tiny_model, variant

F32, F64 = torch.float32, torch.float64


def _pairs(seed: int):
    g = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(1, 256, (n,), generator=g).tolist()

    lengths = [(6, 4, 5), (3, 7, 2), (9, 3, 3), (2, 5, 6), (4, 1, 8)]
    return [
        {"prompt": tokens(p), "chosen": tokens(c), "rejected": tokens(r)} for p, c, r in lengths
    ]


def _grads(model) -> dict[str, torch.Tensor]:
    return {f"grad:{n}": p.grad.detach().clone() for n, p in model.named_parameters()}


def test_shared_prompt_dpo_equals_separate_sequences():
    pairs = _pairs(0)
    batch = data.pack_preference(pairs, max_tokens=40)
    assert batch["input_ids"].shape[0] < len(pairs)  # several pairs share a row
    model = tiny_model("llama")
    reference = tiny_model("llama", seed=1)
    beta = 0.5

    def packed(dtype):
        policy, ref = variant(model, "flashmask", dtype), variant(reference, "flashmask", dtype)
        inputs = data.model_inputs(batch)
        with torch.no_grad():
            ref_c, ref_r = data.response_logps(ref(**inputs, use_cache=False).logits, batch)
        pol_c, pol_r = data.response_logps(policy(**inputs, use_cache=False).logits, batch)
        loss = data.dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=beta)
        loss.backward()
        return {"logps": torch.cat([pol_c, pol_r]).detach(), "loss": loss.detach()} | (
            _grads(policy)
        )

    def separate(dtype):
        policy, ref = variant(model, "eager", dtype), variant(reference, "eager", dtype)
        logps = {}
        for name, m in (("policy", policy), ("ref", ref)):
            for response in ("chosen", "rejected"):
                values = []
                for pair in pairs:
                    ids = torch.tensor([pair["prompt"] + pair[response]])
                    logp = m(ids, use_cache=False).logits.log_softmax(-1)
                    p = len(pair["prompt"])
                    values.append(logp[0, p - 1 : -1].gather(-1, ids[0, p:, None]).sum())
                logps[name, response] = torch.stack(values)
        loss = data.dpo_loss(
            logps["policy", "chosen"],
            logps["policy", "rejected"],
            logps["ref", "chosen"].detach(),
            logps["ref", "rejected"].detach(),
            beta=beta,
        )
        loss.backward()
        policy_logps = torch.cat([logps["policy", "chosen"], logps["policy", "rejected"]])
        return {"logps": policy_logps.detach(), "loss": loss.detach()} | _grads(policy)

    hi, lo = separate(F64), separate(F32)
    for dtype in (F64, F32):
        assert_results_close(packed(dtype), hi, lo, context=str(dtype))


def test_shared_prompt_reward_model_equals_separate_sequences():
    pairs = _pairs(1)
    batch = data.pack_preference(pairs, max_tokens=48)
    model = tiny_model("llama", task="score", num_labels=1, pad_token_id=0)

    def packed(dtype):
        m = variant(model, "flashmask", dtype)
        hidden = m.model(**data.model_inputs(batch), use_cache=False).last_hidden_state
        chosen, rejected = data.response_scores(m.score(hidden), batch)
        loss = data.bradley_terry_loss(chosen, rejected)
        loss.backward()
        return {"scores": torch.cat([chosen, rejected]).detach()} | _grads(m)

    def separate(dtype):
        m = variant(model, "eager", dtype)
        scores = {}
        for response in ("chosen", "rejected"):
            # Batch of one: the sequence-classification head pools the last token.
            scores[response] = torch.cat(
                [
                    m(torch.tensor([p["prompt"] + p[response]]), use_cache=False).logits[:, 0]
                    for p in pairs
                ]
            )
        loss = data.bradley_terry_loss(scores["chosen"], scores["rejected"])
        loss.backward()
        return {"scores": torch.cat([scores["chosen"], scores["rejected"]]).detach()} | _grads(m)

    hi, lo = separate(F64), separate(F32)
    for dtype in (F64, F32):
        assert_results_close(packed(dtype), hi, lo, context=str(dtype))
