"""TRL's SFTTrainer with packing (best-fit decreasing, padding-free batches) on the flashmask
backend trains exactly like SDPA. Skipped where TRL is not installed (it is not a test extra:
it pulls in datasets and pyarrow); verified with trl 1.16.0."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="TRL is not installed")
datasets = pytest.importorskip("datasets")

from tests.integrations.tiny import tiny_model  # noqa: E402


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(256)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="0", eos_token="1")


def test_sft_trainer_packing_matches_sdpa(tmp_path):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 40, (24,), generator=g).tolist()
    rows = [{"input_ids": torch.randint(2, 256, (n,), generator=g).tolist()} for n in lengths]
    dataset = datasets.Dataset.from_list(rows)
    base = tiny_model("llama").float()
    seen, losses = {}, {}
    for attn in ("flashmask", "sdpa"):
        model = copy.deepcopy(base)
        model.set_attn_implementation(attn)
        config = trl.SFTConfig(
            output_dir=str(tmp_path / attn),
            packing=True,
            max_length=96,
            per_device_train_batch_size=4,
            max_steps=3,
            logging_steps=1,
            learning_rate=1e-3,
            bf16=False,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            seed=0,
        )

        class Trainer(trl.SFTTrainer):
            def compute_loss(self, model, inputs, *args, _attn=attn, **kwargs):
                seen.setdefault(_attn, sorted(inputs))
                return super().compute_loss(model, inputs, *args, **kwargs)

        trainer = Trainer(
            model=model, args=config, train_dataset=dataset, processing_class=_tokenizer()
        )
        trainer.train()
        losses[attn] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # Padding-free packed batches: one flattened row, documents marked by position_ids and
    # cu_seq_lens, no attention_mask.
    assert "position_ids" in seen["flashmask"] and "attention_mask" not in seen["flashmask"]
    assert len(losses["flashmask"]) == 3
    assert losses["flashmask"] == pytest.approx(losses["sdpa"], rel=1e-5)
