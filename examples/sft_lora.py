"""Packed SFT with PEFT LoRA adapters on the flashmask backend.

    python examples/sft_lora.py                       # tiny model on CPU, seconds
    python examples/sft_lora.py --config 1b           # ~1B Llama-style model on a GPU

The same packed batches as ``sft_packed.py``; only the LoRA adapters of the attention
projections train (``get_peft_model`` keeps ``attn_implementation="flashmask"``), optionally with
gradient checkpointing (``--checkpointing``).
"""

from __future__ import annotations

import sys

import common
from sft_packed import tokenize

from flashmask.integrations.transformers import enable_activation_checkpointing


def main(argv: list[str] | None = None) -> dict[str, float]:
    import peft

    p = common.parser(__doc__.splitlines()[0], max_tokens=128, samples=16)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (8)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    args = common.finish_args(p.parse_args(argv))
    samples = [tokenize(r) for r in common.load_jsonl("sft.jsonl")]
    model = common.build_model(args)
    config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    model = peft.get_peft_model(model, config)
    if args.checkpointing:
        enable_activation_checkpointing(model.get_base_model())
        model.enable_input_require_grads()
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in model.parameters())
    print(f"trainable parameters: {sum(p.numel() for p in trainable):,} of {total:,}")
    return common.train_packed_sft(model, trainable, samples, args, "sft_lora")


if __name__ == "__main__":
    main(sys.argv[1:])
