"""Model-level mask policies: ``apply_flashmask`` and schedules (streaming generation:
``test_streaming.py``).

Each policy is checked against the dense definition: the mask every layer applies (recorded from
the backend) equals the policy's dense mask AND the batch's document mask, and a uniform policy
gives the same logits as eager attention with that dense mask. In a left-padded batch every
row gets the policy in its own positions: its masks are the per-row definition, its logits and
greedy tokens those of its prompt alone.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from flashmask import masks
from flashmask.integrations import transformers as backend
from flashmask.integrations.policy import (
    MaskContext,
    MaskSchedule,
    MaskSpec,
    apply_flashmask,
    layer_mask,
    padded_layer_mask,
    remove_flashmask,
)
from tests.integrations.tiny import additive, tiny_model
from tests.tolerance import assert_close_to_reference


def dense_policy(kind: str, sq: int, sk: int, **params) -> torch.Tensor:
    """The policy's visibility ``[Sq, Sk]`` from its definition (queries at the last Sq keys)."""
    out = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        p = i + sk - sq
        for j in range(sk):
            if kind == "causal":
                out[i, j] = j <= p
            elif kind == "full":
                out[i, j] = True
            elif kind == "sliding_window":
                out[i, j] = j <= p and (
                    j >= p - params["window"] or j < params.get("sink_tokens", 0)
                )
            elif kind == "prefix_lm":
                out[i, j] = j < params["prefix_len"] or j <= p
    return out


def dense_documents(lengths: list[int]) -> torch.Tensor:
    """Bidirectional visibility inside each document ``[S, S]``."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:, None] == ids[None, :]


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("causal", {}),
        ("full", {}),
        ("sliding_window", {"window": 3}),
        ("sliding_window", {"window": 2, "sink_tokens": 2}),
        ("prefix_lm", {"prefix_len": 4}),
    ],
    ids=["causal", "full", "window", "window+sinks", "prefix_lm"],
)
@pytest.mark.parametrize(("sq", "sk"), [(9, 9), (3, 9), (1, 9)], ids=["train", "prefill", "decode"])
def test_layer_mask_matches_its_definition(kind, params, sq, sk):
    mask = layer_mask(MaskSpec(kind, **params), sq, sk)
    assert mask.seqlen_q == sq  # built for this call's query length, and says so
    assert torch.equal(mask.to_dense(sq)[0, 0], dense_policy(kind, sq, sk, **params))


def test_policy_mask_built_for_another_query_length_is_an_error():
    """A callable policy that ignores ``ctx.seqlen_q`` (here: a training-length mask during a
    3-query prefill over 9 keys) gets a clear error instead of a silently different mask."""
    module = torch.nn.Module()
    module.layer_idx, module.is_causal = 0, True
    module.flashmask_policy = lambda layer_idx, ctx: masks.causal(ctx.seqlen_k)
    q, kv = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 9, 4)
    with pytest.raises(ValueError, match="built for seqlen_q=9 queries but is used with"):
        backend.flashmask_attention_forward(module, q, kv, kv, None)
    module.flashmask_policy = lambda layer_idx, ctx: masks.causal(ctx.seqlen_k, seqlen_q=3)
    out, _ = backend.flashmask_attention_forward(module, q, kv, kv, None)
    assert out.shape == (1, 3, 2, 4)


@pytest.fixture
def recorded_masks(monkeypatch):
    """(layer_idx, dense mask [B, Hm, Sq, Sk]) of every attention call through the backend."""
    calls = []
    original = backend.flashmask_attention

    def spy(q, k, v, mask=None, **kwargs):
        calls.append(mask.to_dense(q.shape[1]) if mask is not None else None)
        return original(q, k, v, mask, **kwargs)

    monkeypatch.setattr(backend, "flashmask_attention", spy)
    return calls


def test_per_layer_windows_cycle_and_respect_packed_documents(recorded_masks):
    """windows [2, 4, 6] cycle over 3 layers; every layer stays inside its document."""
    model = tiny_model(num_hidden_layers=3)
    apply_flashmask(model, mask="sliding_window", window=[2, 4, 6])
    lengths = [5, 7]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, position_ids=position_ids)
    docs = dense_documents(lengths)
    assert len(recorded_masks) == 3
    for layer, window in enumerate([2, 4, 6]):
        expected = dense_policy("sliding_window", 12, 12, window=window) & docs
        assert torch.equal(recorded_masks[layer][0, 0], expected), layer


def test_first_layers_windowed_rest_causal(recorded_masks):
    model = tiny_model(num_hidden_layers=3)
    apply_flashmask(model, mask="sliding_window", window=1, layers=[0])
    model(input_ids=torch.arange(8).view(1, -1))
    assert torch.equal(recorded_masks[0][0, 0], dense_policy("sliding_window", 8, 8, window=1))
    for layer in (1, 2):
        assert torch.equal(recorded_masks[layer][0, 0], dense_policy("causal", 8, 8))


def test_callable_policy_gets_the_call_context(recorded_masks):
    seen: list[MaskContext] = []

    def policy(layer_idx, ctx):
        seen.append(ctx)
        return layer_mask(
            MaskSpec("prefix_lm", prefix_len=layer_idx + 2), ctx.seqlen_q, ctx.seqlen_k
        )

    model = tiny_model()
    apply_flashmask(model, mask=policy)
    model(input_ids=torch.arange(6).view(2, 3))
    assert [(c.layer_idx, c.batch_size, c.seqlen_q, c.seqlen_k) for c in seen] == [
        (0, 2, 3, 3),
        (1, 2, 3, 3),
    ]
    assert torch.equal(recorded_masks[1][0, 0], dense_policy("prefix_lm", 3, 3, prefix_len=3))


def test_uniform_policy_equals_eager_attention_with_the_dense_mask():
    model = tiny_model()
    reference = tiny_model()
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    dense = dense_policy("sliding_window", 10, 10, window=3, sink_tokens=1)
    expected = reference(input_ids=ids, attention_mask=additive(dense, torch.float64)[None, None])
    apply_flashmask(model, mask="sliding_window", window=3, sink_tokens=1)
    got = model(input_ids=ids)
    # transformers' eager attention runs its softmax in float32, hence the float32-level tolerance.
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-6)


def test_remove_flashmask_restores_the_original_outputs():
    model = tiny_model()
    ids = torch.arange(12).view(2, 6)
    before = model(input_ids=ids).logits
    apply_flashmask(model, mask="sliding_window", window=1)
    changed = model(input_ids=ids).logits
    remove_flashmask(model)
    after = model(input_ids=ids).logits
    assert not torch.allclose(before, changed)
    assert torch.equal(before, after)
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="not changed by apply_flashmask"):
        remove_flashmask(model)


def test_schedule_switches_exactly_at_milestones(recorded_masks):
    schedule = MaskSchedule(
        [
            (0, {"mask": "sliding_window", "window": 1}),
            (1000, {"mask": "sliding_window", "window": 3}),
            (5000, "causal"),
        ]
    )
    model = tiny_model(num_hidden_layers=1)
    apply_flashmask(model, mask=schedule)
    expected = {
        0: dense_policy("sliding_window", 6, 6, window=1),
        999: dense_policy("sliding_window", 6, 6, window=1),
        1000: dense_policy("sliding_window", 6, 6, window=3),
        4999: dense_policy("sliding_window", 6, 6, window=3),
        5000: dense_policy("causal", 6, 6),
        10**6: dense_policy("causal", 6, 6),
    }
    for step, dense in expected.items():
        schedule.set_step(step)
        model(input_ids=torch.arange(6).view(1, -1))
        assert torch.equal(recorded_masks[-1][0, 0], dense), step


def test_schedule_callback_follows_the_trainer_step():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    schedule = MaskSchedule([(0, "causal"), (3, "full")])
    callback = schedule.callback()
    state = TrainerState()
    for step, index in ((0, 0), (2, 0), (3, 1), (7, 1)):
        state.global_step = step
        callback.on_step_begin(TrainingArguments(output_dir="unused"), state, TrainerControl())
        assert schedule.current_index() == index


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"mask": "nope"}, ValueError, "mask must be one of"),
        ({"mask": "sliding_window"}, ValueError, "window"),
        ({"mask": "causal", "window": 3}, ValueError, "window only applies"),
        ({"mask": "prefix_lm", "prefix_len": -1}, ValueError, "prefix_len"),
        ({"mask": "sliding_window", "window": [1, 2], "sink_tokens": [0]}, ValueError, "length"),
        ({"mask": 3}, TypeError, "mask spec"),
    ],
    ids=["kind", "missing-window", "stray-window", "prefix", "list-lengths", "type"],
)
def test_invalid_policies_name_the_argument(arguments, error, match):
    with pytest.raises(error, match=match):
        apply_flashmask(tiny_model(), **arguments)


def test_schedule_rejects_bad_milestones():
    with pytest.raises(ValueError, match="start at 0"):
        MaskSchedule([(5, "causal")])
    with pytest.raises(ValueError, match="increase"):
        MaskSchedule([(0, "causal"), (0, "full")])


# ---------------------------------------------------------------------- left-padded batches
# A left-padded row is the same sequence as its prompt alone: a layer policy counts its sink
# tokens, window and prefix from the row's first real token (its positions, as generate's
# position ids count them), not from the first column, and no query sees padding.
PADDED_POLICY = [
    MaskSpec("sliding_window", window=2, sink_tokens=2),
    MaskSpec("prefix_lm", prefix_len=3),
]
PADDED_LENGTHS = (9, 4)  # the short row has 5 padding columns: more than the sinks or the prefix


def left_padded(
    lengths: tuple[int, ...] = PADDED_LENGTHS, seed: int = 0
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """``(prompts, input_ids, attention_mask)``: prompts of ``lengths`` padded on the left."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, 256, (n,), generator=g).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return rows, ids, mask


def dense_in_positions(spec: MaskSpec, attention_mask: torch.Tensor, seqlen_q: int) -> torch.Tensor:
    """``[B, Sq, Sk]`` visibility of ``spec`` for the last ``Sq`` of the ``Sk`` columns of a
    padded batch, from the definition in per-row positions (a real token's position is the
    number of real tokens before it); padding keys and padding queries see nothing."""
    real = attention_mask.bool()
    positions = real.long().cumsum(-1) - 1
    p = positions[:, -seqlen_q:, None]  # query positions
    a = positions[:, None, :]  # key positions
    if spec.kind == "causal":
        visible = a <= p
    elif spec.kind == "full":
        visible = torch.ones_like(a <= p)
    elif spec.kind == "sliding_window":
        visible = (a <= p) & ((a >= p - spec.window) | (a < spec.sink_tokens))
    else:
        visible = (a <= p) | (a < spec.prefix_len)
    return visible & real[:, None, :] & real[:, -seqlen_q:, None]


KINDS = [
    ("causal", {}),
    ("full", {}),
    ("sliding_window", {"window": 2}),
    ("sliding_window", {"window": 2, "sink_tokens": 2}),
    ("prefix_lm", {"prefix_len": 3}),
]
KIND_IDS = ["causal", "full", "window", "window+sinks", "prefix_lm"]


@pytest.mark.parametrize(("kind", "params"), KINDS, ids=KIND_IDS)
@pytest.mark.parametrize(("sq", "sk"), [(9, 9), (3, 9), (1, 9)], ids=["train", "prefill", "decode"])
def test_padded_layer_mask_matches_its_definition_per_row(kind, params, sq, sk):
    """Rows: no padding, left padding (5 columns), right padding (3 columns), both, and padding
    only (a chunk of a row that has not started)."""
    attention_mask = torch.tensor(
        [
            [1] * 9,
            [0] * 5 + [1] * 4,
            [1] * 6 + [0] * 3,
            [0] * 2 + [1] * 5 + [0] * 2,
            [0] * 9,
        ]
    )
    positions = torch.where(attention_mask.bool(), attention_mask.cumsum(-1) - 1, -1)
    spec = MaskSpec(kind, **params)
    mask = padded_layer_mask(spec, positions[:, -sk:], sq)
    assert mask.seqlen_q == sq
    assert torch.equal(mask.to_dense(sq)[:, 0], dense_in_positions(spec, attention_mask, sq))
    # Without padding it is the column mask of layer_mask.
    unpadded = padded_layer_mask(spec, positions[:1], sq).to_dense(sq)
    assert torch.equal(unpadded, layer_mask(spec, sq, sk).to_dense(sq))


def _cache_argument(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.mark.parametrize(
    "step", ["prefill", "second-chunk", "decode"], ids=["prefill", "second-chunk", "decode"]
)
def test_left_padded_rows_get_their_policy_in_their_own_positions(recorded_masks, step):
    """Every layer's mask, per row: the spec in the row's own positions (sinks = its first real
    tokens, window and prefix counted from there), padding hidden. ``second-chunk``: 3 queries
    after 6 cached columns, some of them padding; ``decode``: one query after the prompt."""
    import transformers

    _, ids, mask = left_padded()
    model = tiny_model()
    apply_flashmask(model, mask=PADDED_POLICY)
    if step == "prefill":
        model(input_ids=ids, attention_mask=mask, use_cache=False)
        full_mask, seqlen_q = mask, ids.shape[1]
    else:
        cache = transformers.DynamicCache(config=model.config)
        extra = {_cache_argument(model): cache, "use_cache": True}
        split = 6 if step == "second-chunk" else ids.shape[1]
        model(input_ids=ids[:, :split], attention_mask=mask[:, :split], **extra)
        if step == "second-chunk":
            full_mask, new = mask, ids[:, split:]
        else:
            full_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            new = torch.tensor([[7], [8]])
        del recorded_masks[:]
        model(input_ids=new, attention_mask=full_mask, **extra)
        seqlen_q = new.shape[1]
    assert len(recorded_masks) == len(PADDED_POLICY)
    for layer, spec in enumerate(PADDED_POLICY):
        expected = dense_in_positions(spec, full_mask, seqlen_q)
        got = recorded_masks[layer]
        assert torch.equal(got.expand(-1, 1, -1, -1)[:, 0], expected), (step, spec)


def test_callable_policy_gets_each_rows_positions_and_its_mask_meets_the_padding(recorded_masks):
    """A callable sees ``ctx.key_positions`` of a padded batch (``None`` without padding); the
    mask it returns (here in column coordinates) is intersected with the padding."""
    seen: list[torch.Tensor | None] = []

    def policy(layer_idx, ctx):
        seen.append(ctx.key_positions)
        return masks.causal(ctx.seqlen_k, seqlen_q=ctx.seqlen_q)

    _, ids, mask = left_padded()
    model = tiny_model(num_hidden_layers=1)
    apply_flashmask(model, mask=policy)
    model(input_ids=ids[:1], use_cache=False)
    model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert seen[0] is None
    assert seen[1].tolist() == [list(range(9)), [-1] * 5 + list(range(4))]
    assert torch.equal(recorded_masks[1][:, 0], dense_in_positions(MaskSpec("causal"), mask, 9))


def test_left_padded_rows_give_the_logits_of_their_solo_runs():
    """``model(input_ids, attention_mask)`` on a left-padded batch (no position ids: the rows'
    RoPE positions are shifted by their padding, which rotary attention does not see): each
    row's logits at its real tokens are those of its prompt alone, in float32 as close to the
    float64 solo run as the float32 solo run is."""
    rows, ids, mask = left_padded()
    models = {}
    for dtype in (torch.float64, torch.float32):
        models[dtype] = tiny_model().to(dtype)
        apply_flashmask(models[dtype], mask=PADDED_POLICY)
    with torch.no_grad():
        batch = models[torch.float32](input_ids=ids, attention_mask=mask).logits
        for b, row in enumerate(rows):
            solo = {
                dtype: m(input_ids=torch.tensor([row])).logits[0] for dtype, m in models.items()
            }
            assert_close_to_reference(
                batch[b, -len(row) :],
                solo[torch.float64],
                solo[torch.float32],
                "logits",
                context=f"row {b} of {len(row)} tokens",
            )


def test_generate_on_a_left_padded_batch_gives_each_row_its_solo_tokens():
    """Greedy ``model.generate`` (prefill, then single-token decode steps over a dynamic cache)
    on a left-padded batch gives every row the tokens it gets alone."""
    rows, ids, mask = left_padded(seed=1)
    model = tiny_model().to(torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    apply_flashmask(model, mask=PADDED_POLICY)

    def generate(input_ids, attention_mask):
        out = model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False
        )
        return out[:, input_ids.shape[1] :]

    batch = generate(ids, mask)
    for b, row in enumerate(rows):
        solo = torch.tensor([row])
        assert torch.equal(batch[b], generate(solo, torch.ones_like(solo))[0]), b


def test_fullgraph_compile_of_a_policy_over_a_left_padded_batch():
    """The per-row masks are tensor operations only: ``torch.compile(fullgraph=True)`` (any graph
    break raises) traces the padded forward, and its logits are the eager forward's."""
    _, ids, mask = left_padded()
    model = tiny_model().to(torch.float32)
    apply_flashmask(model, mask=PADDED_POLICY)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        actual = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], rtol=0, atol=0)
