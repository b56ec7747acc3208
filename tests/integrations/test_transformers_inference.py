"""The "flashmask" backend in transformers' own inference paths, against eager attention.

Continuous batching (``model.generate_batch``, which TRL's online trainers use for generation)
hands the backend packed requests: ``cu_seq_lens_q`` over the new tokens and ``cu_seq_lens_k``
over each request's cached and new keys. Every test here runs tiny float32 models on the CPU,
where flashmask runs its exact reference, and asks for the tokens (or logits) eager attention
gives.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashmask.integrations import transformers as fm_transformers  # noqa: E402
from tests.integrations.tiny import tiny_model, variant  # noqa: E402

F32 = torch.float32
CPU = torch.device("cpu")

HYBRID_QWEN2 = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
"""A Qwen2 whose second layer slides a 4-token window: continuous batching then keeps a separate
(shorter) key segment per request for that layer."""


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in lengths]


def _dense_segments(
    cu_q: list[int], cu_k: list[int], seqlen_q: int, seqlen_k: int, window: int | None = None
) -> torch.Tensor:
    """The mask continuous batching means, element by element: query row ``i`` of segment ``r``
    (local row ``a``) sees key ``j`` of segment ``r`` (local column ``b``) when ``b`` is at or
    before the query's own position ``a + (keys_r - queries_r)``, within ``window``."""
    visible = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool)
    for r in range(len(cu_q) - 1):
        queries, keys = cu_q[r + 1] - cu_q[r], cu_k[r + 1] - cu_k[r]
        for a in range(queries):
            position = a + keys - queries
            for b in range(keys):
                if b <= position and (window is None or b > position - window):
                    visible[cu_q[r] + a, cu_k[r] + b] = True
    return visible


# ---------------------------------------------------------------------- continuous batching
@pytest.mark.parametrize(
    ("cu_q", "cu_k", "seqlen_q", "seqlen_k"),
    [
        ([0, 1, 2, 3], [0, 9, 21, 30], 3, 30),  # decode: one new token per request
        ([0, 1, 5, 6], [0, 10, 17, 23], 6, 25),  # a chunk of 4 over 3 cached keys; padded keys
        ([0, 4, 4, 7], [0, 4, 4, 7], 8, 8),  # prefill only, an empty segment, a padded query
    ],
)
@pytest.mark.parametrize("window", [None, 3])
def test_segments_see_only_their_own_keys(cu_q, cu_k, seqlen_q, seqlen_k, window):
    """Each request's queries see only its own keys, its last query at its last key."""
    mask = fm_transformers.resolve_mask(
        1,
        seqlen_q,
        seqlen_k,
        device=CPU,
        cu_seq_lens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seq_lens_k=torch.tensor(cu_k, dtype=torch.int32),
        sliding_window=window,
    )
    expected = _dense_segments(cu_q, cu_k, seqlen_q, seqlen_k, window)
    assert torch.equal(mask.to_dense()[0, 0], expected)


def test_segment_arguments_that_cannot_describe_the_keys_are_errors():
    module = torch.nn.Module()
    q, kv = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 30, 4)
    cu_q, cu_k = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 9, 21, 30])
    forward = fm_transformers.flashmask_attention_forward
    with pytest.raises(ValueError, match="pass cu_seq_lens_k too"):
        forward(module, q, kv, kv, None, cu_seq_lens_q=cu_q)
    with pytest.raises(ValueError, match="cu_seq_lens_k was passed without cu_seq_lens_q"):
        forward(module, q, kv, kv, None, cu_seq_lens_k=cu_k)
    with pytest.raises(ValueError, match="same segments"):
        forward(module, q, kv, kv, None, cu_seq_lens_q=cu_q[:3], cu_seq_lens_k=cu_k)
    with pytest.raises(ValueError, match=r"cu_seq_lens_k must rise from 0 to at most seqlen_k"):
        forward(module, q, kv, kv, None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k + 1)
    with pytest.raises(ValueError, match="needs a batch of 1"):
        two = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 30, 4)
        forward(module, two[0], two[1], two[1], None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    module.flashmask_policy = lambda layer_idx, ctx: None
    module.layer_idx = 0
    with pytest.raises(ValueError, match="layer mask policy"):
        forward(module, q, kv, kv, None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)


@pytest.mark.parametrize(("kind", "extra"), [("llama", {}), ("qwen2", HYBRID_QWEN2)])
def test_continuous_batching_generates_the_tokens_of_eager_attention(kind, extra, monkeypatch):
    """``generate_batch`` with small pages and 16-token batches: a 19-token prompt is prefilled
    in chunks, batches mix one request's prefill with the others' decoding, and decode steps pass
    a few queries over many keys. Every request gets eager attention's greedy tokens."""
    calls = []
    resolve = fm_transformers.resolve_mask

    def recording(batch, seqlen_q, seqlen_k, **kwargs):
        cu_k = kwargs.get("cu_seq_lens_k")
        calls.append((seqlen_q, seqlen_k, 0 if cu_k is None else cu_k.numel() - 1))
        return resolve(batch, seqlen_q, seqlen_k, **kwargs)

    monkeypatch.setattr(fm_transformers, "resolve_mask", recording)
    model = tiny_model(kind, **extra)
    prompts = _prompts((5, 19, 3, 11))
    config = transformers.ContinuousBatchingConfig(
        page_size=16, num_blocks=32, max_batch_tokens=16, use_cuda_graph=False
    )
    generation = transformers.GenerationConfig(
        max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    tokens = {}
    for attn in ("eager", "flashmask"):
        outputs = variant(model, attn, F32).generate_batch(
            prompts,
            generation_config=generation,
            continuous_batching_config=config,
            progress_bar=False,
        )
        tokens[attn] = {name: out.generated_tokens for name, out in outputs.items()}
    assert len(tokens["flashmask"]) == len(prompts)
    assert tokens["flashmask"] == tokens["eager"]
    # The backend really saw requests packed together, with fewer queries than keys.
    assert any(sq < sk and segments >= 3 for sq, sk, segments in calls), sorted(set(calls))
