"""The model matrix: every tiny model of ``tiny.KINDS`` (Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2 with its logit cap, Gemma 3, gpt-oss with its sinks, DeepSeek-V3 with multi-head latent
attention, whose value head dim differs from the query's) trains with
``attn_implementation="flashmask"`` as with eager attention (float32 against the float64 truth,
within a plain float32 run's error) on a plain batch, and gives each row of a padded batch and
each document of a packed row the logits it has alone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.integrations.tiny import (
    KINDS,
    assert_results_close,
    compare,
    tiny_model,
    variant,
)

F32, F64 = torch.float32, torch.float64


def model_of(kind: str):
    """The tiny model of ``kind`` with query and key projections scaled up, so that scores are a
    few units (at init they are near 0, where masks, caps and sinks barely matter)."""
    model = tiny_model(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ("q_proj", "k_proj", "q_b_proj", "kv_b_proj")):
                p.mul_(8.0)
            if name.endswith("sinks"):
                p.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(1))
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_a_plain_batch_trains_as_with_eager_attention(kind):
    g = torch.Generator().manual_seed(2)
    inputs = {"input_ids": torch.randint(1, 256, (2, 16), generator=g)}
    compare(model_of(kind), inputs, "eager", inputs, ctx=kind)


@pytest.mark.parametrize("kind", KINDS)
def test_a_padded_batch_gives_each_row_its_own_logits(kind):
    """A left-padded and a right-padded row against each row's real tokens alone (eager
    attention's own padded run is no reference: in this transformers version its fully masked
    padding rows turn to NaN and leak into the real ones through zero weights)."""
    model = model_of(kind)
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, 256, (2, 14), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0
    attention_mask[1, 10:] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    real = attention_mask.bool()
    with torch.no_grad():
        m = variant(model, "flashmask", F32)
        padded = m(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=False,
        ).logits[real]  # fmt: skip

        def alone(dtype):
            m = variant(model, "eager", dtype)
            rows = [input_ids[r][real[r]][None] for r in range(2)]
            return torch.cat([m(input_ids=row, use_cache=False).logits[0] for row in rows])

        assert_results_close(
            {"logits": padded}, {"logits": alone(F64)}, {"logits": alone(F32)}, context=kind
        )


@pytest.mark.parametrize("kind", KINDS)
def test_a_packed_row_gives_each_document_its_own_logits(kind):
    """Two documents packed in one row (position ids restart) against each document alone: the
    logits of both, float32 flashmask packed against eager float64 and float32 one by one."""
    model = model_of(kind)
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(1, 256, (n,), generator=g) for n in (9, 7)]
    packed = {
        "input_ids": torch.cat(docs)[None],
        "position_ids": torch.cat([torch.arange(len(d)) for d in docs])[None],
    }
    with torch.no_grad():
        actual = variant(model, "flashmask", F32)(**packed, use_cache=False).logits[0]

        def alone(dtype):
            m = variant(model, "eager", dtype)
            return torch.cat([m(input_ids=d[None], use_cache=False).logits[0] for d in docs])

        assert_results_close(
            {"logits": actual}, {"logits": alone(F64)}, {"logits": alone(F32)}, context=kind
        )
