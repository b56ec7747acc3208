"""PEFT LoRA on the flashmask backend: adapters get the gradients eager attention gives them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="peft is not installed")

from flashmask.integrations import data  # noqa: E402
from flashmask.integrations.transformers import enable_activation_checkpointing  # noqa: E402
from tests.integrations.tiny import assert_results_close, run, tiny_model, variant  # noqa: E402

F32, F64 = torch.float32, torch.float64


def _lora(model, attn: str, dtype: torch.dtype, checkpointing: bool):
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    torch.manual_seed(0)
    lora = peft.get_peft_model(variant(model, attn, dtype), config)
    # LoRA's B starts at zero; make it nonzero so the adapters change the attention inputs.
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    if checkpointing:
        enable_activation_checkpointing(lora.get_base_model())
        lora.enable_input_require_grads()
    lora.train()
    return lora


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_match_eager_with_the_dense_mask(checkpointing):
    """Only adapters train; loss terms, real-row logits and adapter gradients match eager."""
    g = torch.Generator().manual_seed(2)
    samples = [
        {"input_ids": torch.randint(1, 256, (n,), generator=g).tolist()} for n in (9, 14, 5, 20)
    ]
    batch = data.pack_sft(samples, max_tokens=24)
    inputs = data.model_inputs(batch)
    real = batch["sample_index"] >= 0

    def eager_inputs(dtype: torch.dtype) -> dict:
        """The same batch for eager attention: the mask as an additive dense 4-D tensor."""
        dense = data.dense_attention_mask(batch["startend_row_indices"], dtype=dtype)
        return {k: v for k, v in inputs.items() if k != "startend_row_indices"} | {
            "attention_mask": dense
        }

    model = tiny_model("llama")
    results = []
    for attn, dtype, batch_inputs in (
        ("flashmask", F32, inputs),
        ("eager", F64, eager_inputs(F64)),
        ("eager", F32, eager_inputs(F32)),
    ):
        lora = _lora(model, attn, dtype, checkpointing)
        assert lora.get_base_model().config._attn_implementation == attn
        result = run(lora, batch_inputs)
        result["logits"] = result["logits"][real]
        trained = {k for k in result if k.startswith("grad:")}
        assert trained and all("lora_" in k for k in trained), sorted(trained)[:4]
        results.append(result)
    assert_results_close(*results, context=f"checkpointing={checkpointing}")
