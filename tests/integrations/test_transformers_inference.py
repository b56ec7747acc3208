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
from tests.tolerance import assert_close_to_reference  # noqa: E402

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


# ---------------------------------------------------------------------- static caches, generate
def _left_padded(lengths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths, left-padded with token 0: ``(input_ids, attention_mask)``."""
    prompts = _prompts(lengths, seed)
    width = max(lengths)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize(("kind", "extra"), [("llama", {}), ("mistral", {"sliding_window": 4})])
def test_batched_generate_with_left_padding_gives_the_tokens_of_eager_attention(cache, kind, extra):
    """Greedy ``generate`` over left-padded prompts of different lengths. A static cache keeps a
    padding mask shorter than its slots (transformers' flash-style backends) and puts the
    queries after the tokens cached so far, not at the end of its keys; a sliding-window model
    gets transformers' sliding static layers (a rolling window of keys)."""
    model = tiny_model(kind, **extra)
    input_ids, attention_mask = _left_padded((9, 4, 6), seed=21)
    tokens = []
    for attn in ("eager", "flashmask"):
        m = variant(model, attn, F32)
        m.generation_config.pad_token_id = 0
        tokens.append(
            m.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=8,
                do_sample=False,
                cache_implementation=cache,
            )
        )
    assert torch.equal(tokens[1], tokens[0])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_chunked_prefill_over_a_left_padded_cache_matches_eager(cache):
    """A left-padded batch prefilled in two chunks through ``model(...)``: the second chunk's
    3 queries stand after 6 cached keys, some of them padding (a 2-D mask over all 9)."""
    model = tiny_model("llama")
    input_ids, attention_mask = _left_padded((9, 5, 7), seed=24)
    logits = {}
    # transformers' float64 eager attention turns a padding mask into NaN: SDPA is the truth.
    for attn, dtype in (("flashmask", F32), ("sdpa", torch.float64), ("eager", F32)):
        m = variant(model, attn, dtype)
        if cache == "static":
            kv = transformers.StaticCache(config=m.config, max_cache_len=16)
        else:
            kv = transformers.DynamicCache(config=m.config)
        with torch.no_grad():
            m(input_ids[:, :6], attention_mask=attention_mask[:, :6], cache=kv, use_cache=True)
            out = m(input_ids[:, 6:], attention_mask=attention_mask, cache=kv, use_cache=True)
        logits[attn] = out.logits
    assert_close_to_reference(
        logits["flashmask"], logits["sdpa"], logits["eager"], "logits", context=cache
    )


def test_static_cache_forward_without_a_mask_matches_eager():
    """A prefill then two decode steps straight through ``model(...)`` with a ``StaticCache`` and
    no attention mask: the cache's empty slots stay hidden (the queries stand after the cached
    tokens, not at the end of the 24 slots)."""
    model = tiny_model("llama")
    input_ids = torch.randint(1, 256, (2, 11), generator=torch.Generator().manual_seed(22))
    steps = (slice(0, 9), slice(9, 10), slice(10, 11))
    logits = {}
    for attn, dtype in (("flashmask", F32), ("eager", torch.float64), ("eager", F32)):
        m = variant(model, attn, dtype)
        cache = transformers.StaticCache(config=m.config, max_cache_len=24)
        with torch.no_grad():
            outs = [m(input_ids[:, step], cache=cache, use_cache=True).logits for step in steps]
        logits[attn, dtype] = torch.cat(outs, dim=1)
    assert_close_to_reference(
        logits["flashmask", F32],
        logits["eager", torch.float64],
        logits["eager", F32],
        "logits",
        context="static cache",
    )


def test_mask_hook_gives_key_rows_for_a_static_cache():
    """Queries at positions 5..7 over a static cache of 10 slots, with a padded first token."""
    hook = fm_transformers.flashmask_mask_interface
    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    for offset in (5, torch.tensor(5)):
        rows = hook(1, 3, 10, offset, 0, attention_mask=padding, device=CPU)
        hidden = fm_transformers.KEY_ROW_HIDDEN
        assert rows.dtype == torch.int32 and rows.shape == (1, 1, 1, 10)
        # Key j stands at query row j - 5; the padded key and the unwritten slots 8, 9 are hidden.
        assert rows.flatten().tolist() == [hidden, -4, -3, -2, -1, 0, 1, 2, hidden, hidden]
    # Older transformers pass the queries' positions instead of q_length and q_offset.
    by_position = hook(1, kv_length=10, attention_mask=padding, cache_position=torch.arange(5, 8))
    assert torch.equal(by_position, rows)
    # Queries at the end of the keys (no cache, a dynamic cache): the padding mask, or nothing.
    assert torch.equal(hook(1, 3, 8, 5, 0, attention_mask=padding), padding)
    assert hook(1, 3, 8, 5, 0, attention_mask=torch.ones_like(padding)) is None
    assert hook(1, 8, 8, torch.tensor(0), 0) is None
    # Fewer keys than positions before the queries (a cache that compacts its keys): the last.
    assert hook(1, 1, 6, 40, 0) is None
    last_rows = hook(1, 1, 6, torch.tensor(40), 0)  # the same from a tensor offset: key rows
    assert last_rows.flatten().tolist() == [-5, -4, -3, -2, -1, 0]


def test_mask_hook_never_reads_a_tensor_offset_on_the_host():
    """A static cache's step passes its offset as a tensor; reading it would synchronise every
    eager decode step with the GPU. A meta tensor has no value to read: the hook still works."""
    hook = fm_transformers.flashmask_mask_interface
    meta = torch.device("meta")
    rows = hook(1, 1, 10, torch.tensor(5, device=meta), 0, device=meta)
    assert rows.device == meta and rows.shape == (1, 1, 1, 10)
    padding = torch.ones(1, 10, dtype=torch.bool, device=meta)
    assert hook(1, 1, 10, torch.tensor(5, device=meta), 0, attention_mask=padding).shape == (
        1,
        1,
        1,
        10,
    )


def test_key_rows_mask_every_kind_of_module():
    """The mask the key rows give, element by element: causal modules hide keys after each
    query's position, every module hides padded keys, windows count from the position."""
    hidden = fm_transformers.KEY_ROW_HIDDEN
    rows = torch.tensor([hidden, -4, -3, -2, -1, 0, 1, 2, 3, 4], dtype=torch.int32)
    position = torch.arange(3).view(-1, 1)  # query row i stands where rows == i
    key = rows.view(1, -1)
    real = key < hidden
    for causal, window, expected in (
        (True, None, real & (key <= position)),
        (True, 3, real & (key <= position) & (key > position - 3)),
        (False, None, real.expand(3, -1)),
        (False, 2, real & ((key - position).abs() < 2)),
    ):
        mask = fm_transformers.resolve_mask(
            1,
            3,
            10,
            device=CPU,
            causal=causal,
            attention_mask=rows.view(1, 1, 1, 10),
            sliding_window=window,
        )
        assert torch.equal(mask.to_dense()[0, 0], expected), (causal, window)
    with pytest.raises(ValueError, match="sized for another layer's keys"):
        fm_transformers.resolve_mask(1, 3, 12, device=CPU, attention_mask=rows.view(1, 1, 1, 10))


def test_layer_policies_with_a_static_cache_are_an_error():
    import flashmask

    model = variant(tiny_model("llama"), "flashmask", F32)
    flashmask.apply_flashmask(model, mask="sliding_window", window=4)
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(ValueError, match="layer mask policy"):
        model(torch.randint(1, 256, (1, 5)), cache=cache, use_cache=True)


# ---------------------------------------------------------------------- torch.compile
def _compile_recording(model) -> tuple[torch.nn.Module, list]:
    """``torch.compile(model, fullgraph=True)`` (any graph break raises) with a backend that
    records every graph it is given (one per compilation, recompilations included) and runs it
    as traced."""
    torch._dynamo.reset()
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return torch.compile(model, fullgraph=True, backend=backend), graphs


def _calls_flashmask(graphs: list) -> bool:
    """Whether the traced graphs call flashmask's attention op (the attention really was
    traced through the backend, not around it)."""
    op = torch.ops.flashmask.attention_forward.default
    return any(node.target is op for g in graphs for node in g.graph.nodes)


def _packing_inputs(source: str, doc_lens: list[int], seed: int) -> tuple[dict, dict]:
    """One packed row of documents ``doc_lens`` described by ``source``: ``(inputs for the
    flashmask model, inputs for eager attention)``. Eager attention reads packing from
    ``position_ids`` and padding from the 2-D mask; it ignores ``cu_seq_lens_*``."""
    seqlen = sum(doc_lens)
    input_ids = torch.randint(1, 256, (1, seqlen), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in doc_lens]).unsqueeze(0)
    if source == "position_ids":
        inputs = {"input_ids": input_ids, "position_ids": positions}
        return inputs, inputs
    if source == "cu_seq_lens":
        cu = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()], dtype=torch.int32)
        flat = {"input_ids": input_ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone()}
        return flat, {"input_ids": input_ids, "position_ids": positions}
    # attention_mask: the first document is left padding.
    attention_mask = (torch.arange(seqlen) >= doc_lens[0]).long().unsqueeze(0)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    return inputs, inputs


@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens", "attention_mask"])
def test_fullgraph_compile_over_different_packings_matches_eager(source):
    """``torch.compile(fullgraph=True)`` traces every derived-mask path without a graph break
    (no value is read back to the host), a second packing of the same length reuses the graph
    (mask values are data, not guards), and the logits are eager attention's."""
    model = tiny_model("llama")
    compiled, graphs = _compile_recording(variant(model, "flashmask", F32))
    # transformers' float64 eager attention turns a padding mask into NaN (its additive mask
    # overflows); SDPA is the reference there.
    reference = "sdpa" if source == "attention_mask" else "eager"
    references = {dtype: variant(model, reference, dtype) for dtype in (torch.float64, F32)}
    for seed, doc_lens in enumerate(([5, 7, 4], [9, 2, 5])):
        inputs, eager_inputs = _packing_inputs(source, doc_lens, seed)
        with torch.no_grad():
            actual = compiled(**inputs, use_cache=False).logits
            expected = {
                dtype: ref(**eager_inputs, use_cache=False).logits
                for dtype, ref in references.items()
            }
        real = slice(doc_lens[0], None) if source == "attention_mask" else slice(None)
        assert_close_to_reference(
            actual[:, real],
            expected[torch.float64][:, real],
            expected[F32][:, real],
            "logits",
            context=f"{source} {doc_lens}",
        )
    assert len(graphs) == 1
    assert _calls_flashmask(graphs)


def test_fullgraph_compile_of_static_cache_decoding_matches_eager():
    """The decode steps of CUDA-graph generation: a static cache, compiled with
    ``fullgraph=True`` after an eager prefill. The cache's offset tensor changes every step;
    the graph is traced once and every step's logits are eager attention's."""
    model = tiny_model("llama")
    input_ids = torch.randint(1, 256, (2, 11), generator=torch.Generator().manual_seed(23))
    flashmask_model = variant(model, "flashmask", F32)
    compiled, graphs = _compile_recording(flashmask_model)
    logits = {}
    for attn, dtype in (("flashmask", F32), ("eager", torch.float64), ("eager", F32)):
        m = flashmask_model if attn == "flashmask" else variant(model, attn, dtype)
        decode = compiled if attn == "flashmask" else m
        cache = transformers.StaticCache(config=m.config, max_cache_len=16)
        with torch.no_grad():
            steps = [m(input_ids[:, :8], cache=cache, use_cache=True).logits]
            for i in range(8, 11):
                steps.append(decode(input_ids[:, i : i + 1], cache=cache, use_cache=True).logits)
        logits[attn, dtype] = torch.cat(steps, dim=1)
    assert len(graphs) == 1
    assert _calls_flashmask(graphs)
    assert_close_to_reference(
        logits["flashmask", F32],
        logits["eager", torch.float64],
        logits["eager", F32],
        "logits",
        context="compiled static-cache decoding",
    )
