"""Model-level mask policies: ``apply_flashmask`` and schedules (streaming generation:
``test_streaming.py``).

Each policy is checked against the dense definition: the mask every layer applies (recorded from
the backend) equals the policy's dense mask AND the batch's document mask, and a uniform policy
gives the same logits as eager attention with that dense mask.
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
    remove_flashmask,
)
from tests.integrations.tiny import additive, tiny_model


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
