"""Tiny randomly initialised transformers models and the comparison rule of the integration
tests: a result computed in float32 is close to the float64 truth when it is as close as a plain
float32 computation (``tests/tolerance.py``)."""

from __future__ import annotations

import copy

import torch

from tests.tolerance import assert_close_to_reference

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


# What a kind needs beyond TINY: a head dim; a window that the sliding layers (every other
# layer) apply within the tests' short sequences; gpt-oss's experts; Gemma 2's logit cap, low
# enough to change the scores.
KIND_DEFAULTS = {
    "gpt_oss": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 6, "experts_implementation": "eager"},
    "gemma2": {"head_dim": 16, "sliding_window": 6, "attn_logit_softcapping": 2.0},
    "qwen3": {"head_dim": 16},
    "phi3": {"pad_token_id": 0},
    "gemma3": {"head_dim": 16, "sliding_window": 6},
    # Multi-head latent attention: q/k head dim 8 + 16 = 24, v head dim 16 (D != Dv).
    "deepseek_v3": {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                    "topk_group": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 32,
                    "n_shared_experts": 1, "experts_implementation": "eager"},
}  # fmt: skip
# The kinds of the model matrix (tests/integrations/test_models.py).
KINDS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt_oss",
         "deepseek_v3")  # fmt: skip


def tiny_model(kind: str = "llama", *, seed: int = 0, task: str = "causal_lm", **overrides):
    """A float64 tiny model (``kind``: one of :data:`KINDS`) with eager
    attention; the "flashmask" backend is registered."""
    import transformers

    import flashmask.integrations.transformers  # noqa: F401  (registers "flashmask")

    config_class = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "gpt_oss": transformers.GptOssConfig,
        "gemma2": transformers.Gemma2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma3": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
        "deepseek_v3": transformers.DeepseekV3Config,
    }[kind]
    config = config_class(**{**TINY, **KIND_DEFAULTS.get(kind, {}), **overrides})
    model_class = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "score": transformers.AutoModelForSequenceClassification,
    }[task]
    torch.manual_seed(seed)
    model = model_class.from_config(config, attn_implementation="eager")
    return model.to(torch.float64).eval()


def variant(model, attn: str, dtype: torch.dtype = torch.float64):
    """A copy of ``model`` with another attention implementation and dtype."""
    other = copy.deepcopy(model).to(dtype)
    other.set_attn_implementation(attn)
    return other


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss terms (labels shifted inside, -100 dropped), in row-major
    order and in the logits' dtype: transformers itself upcasts to float32, which would cap
    float64 runs at float32."""
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="none"
    )
    return losses[labels[:, 1:].flatten() != -100]


def run(model, inputs: dict, *, extra_loss=None) -> dict[str, torch.Tensor]:
    """Forward + backward of the mean token loss (plus ``extra_loss(logits)``); returns the
    ``token_losses``, the ``logits`` and ``grad:<name>`` of every parameter with a gradient.
    ``labels`` default to ``input_ids``."""
    inputs = dict(inputs)
    labels = inputs.pop("labels", inputs["input_ids"])
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits
    losses = token_losses(logits, labels)
    loss = losses.mean() if extra_loss is None else losses.mean() + extra_loss(logits)
    loss.backward()
    result = {"token_losses": losses.detach(), "logits": logits.detach()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            result[f"grad:{name}"] = p.grad.detach().clone()
    return result


def assert_results_close(actual: dict, ref_hi: dict, ref_lo: dict, context: str = "") -> None:
    """Every entry of ``ref_hi`` is matched by ``actual`` under the tolerance rule.

    Entries of fewer than 100 values (losses, per-response log-probabilities) get the rule's
    max clause only: its mean clause (within 1.1x the yardstick's mean error) is a statistic
    that needs many elements. The logits those values come from get the full rule.
    """
    assert actual.keys() == ref_hi.keys() == ref_lo.keys(), (
        sorted(actual.keys() ^ ref_hi.keys()),
        sorted(ref_hi.keys() ^ ref_lo.keys()),
    )
    for key in ref_hi:
        if ref_hi[key].numel() < 100:
            hi = ref_hi[key].double()
            err = (actual[key].double() - hi).abs().max().item()
            ref_err = (ref_lo[key].double() - hi).abs().max().item()
            noise = hi.abs().max().item() * torch.finfo(actual[key].dtype).eps
            assert err <= 2 * ref_err + 2 * noise, (
                f"{key} {context}: max error {err:.3e} > 2 x {ref_err:.3e} + 2 x {noise:.3e}"
            )
        else:
            assert_close_to_reference(actual[key], ref_hi[key], ref_lo[key], key, context=context)


def compare(
    model, inputs_fm: dict, ref_attn: str, inputs_ref: dict, *, real=None, ctx: str = ""
) -> None:
    """flashmask float32 vs ``ref_attn`` float64 (truth) and float32 (yardstick); ``real``
    ``[B, S]`` bool selects the logits compared (padded rows differ by design)."""
    results = [
        run(variant(model, attn, dtype), inputs)
        for attn, dtype, inputs in (
            ("flashmask", torch.float32, inputs_fm),
            (ref_attn, torch.float64, inputs_ref),
            (ref_attn, torch.float32, inputs_ref),
        )
    ]
    if real is not None:
        for result in results:
            result["logits"] = result["logits"][real]
    assert_results_close(*results, context=ctx)


def additive(dense: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool 4-D mask (True = attend) as eager attention's additive float mask."""
    zero = torch.zeros((), dtype=dtype)
    return torch.where(dense, zero, torch.finfo(dtype).min)
