"""The "flashmask" transformers backend against transformers' own eager and SDPA attention.

Every comparison runs the flashmask backend in float32 and checks it against the float64 eager
(or SDPA) model under the suite's tolerance rule, with a plain float32 run of the reference
backend as the low-precision yardstick.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashmask  # noqa: E402
from flashmask import FlashMask, masks  # noqa: E402
from flashmask.integrations import data  # noqa: E402
from flashmask.integrations import transformers as fm_transformers  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    additive,
    assert_results_close,
    compare,
    run,
    tiny_model,
    token_losses,
    variant,
)

F32, F64 = torch.float32, torch.float64


def _packed_inputs(doc_lens: list[list[int]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens in rows of packed documents: input_ids, position_ids and HF labels."""
    g = torch.Generator().manual_seed(seed)
    seqlen = sum(doc_lens[0])
    input_ids = torch.randint(1, 256, (len(doc_lens), seqlen), generator=g)
    position_ids = torch.cat(
        [torch.cat([torch.arange(n) for n in lens]).unsqueeze(0) for lens in doc_lens]
    )
    labels = input_ids.masked_fill(position_ids == 0, -100)
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


# ---------------------------------------------------------------------- registration
def test_import_registers_the_backend():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert AttentionInterface._global_mapping["flashmask"] is (
        fm_transformers.flashmask_attention_forward
    )
    assert ALL_MASK_ATTENTION_FUNCTIONS["flashmask"] is fm_transformers.flashmask_mask_interface
    config = transformers.LlamaConfig(**{"hidden_size": 32, "num_hidden_layers": 1})
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flashmask")
    assert model.config._attn_implementation == "flashmask"
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation("flashmask")
    assert model.config._attn_implementation == "flashmask"


def test_import_flashmask_does_not_import_transformers():
    code = (
        "import sys, flashmask, flashmask.integrations, flashmask.integrations.data\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------- the launcher
_TRAIN_TOOL = """\
import argparse, sys

import torch
import transformers


def main():
    # A tool that never imports flashmask and takes the backend's name on its command line.
    parser = argparse.ArgumentParser()
    parser.add_argument("--attn_implementation")
    args = parser.parse_args()
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=args.attn_implementation
    )
    model(torch.arange(8).unsqueeze(0), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))
    print("trained with", model.config._attn_implementation, sys.argv)
    return 0
"""


def _install_console_script(root, name: str, module: str, source: str) -> None:
    """A distribution under ``root`` (a ``sys.path`` entry) whose console script ``name`` runs
    ``module.main``, as ``pip install`` would register it."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[console_scripts]\n{name} = {module}:main\n")


def test_launcher_runs_a_console_script_that_never_imports_flashmask(tmp_path):
    """``python -m flashmask.run TOOL ...`` (as ``trl sft --attn_implementation flashmask``):
    the tool, resolved by name among the installed console scripts, runs in the launcher's
    process with the backend registered. Called without the launcher, the same tool fails with
    transformers' "not supported" error. (One interpreter does both, the launcher run exactly as
    ``python -m`` runs a module, to start torch and transformers once.)"""
    _install_console_script(tmp_path, "fm-train-tool", "fm_train_tool", _TRAIN_TOOL)
    code = (
        "import runpy, sys\n"
        "import fm_train_tool\n"
        "sys.argv = ['fm-train-tool', '--attn_implementation', 'flashmask']\n"
        "try:\n"
        "    fm_train_tool.main()\n"
        "except ValueError as error:\n"
        "    print('without the launcher:', error)\n"
        "assert 'flashmask' not in sys.modules\n"
        "sys.argv = ['-m', 'fm-train-tool', '--attn_implementation', 'flashmask']\n"
        "runpy.run_module('flashmask.run', run_name='__main__', alter_sys=True)\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.split("\n", 1)
    assert before.startswith("without the launcher:") and "is not supported" in before
    expected = "trained with flashmask ['fm-train-tool', '--attn_implementation', 'flashmask']"
    assert after.strip() == expected


def test_launcher_runs_files_and_modules_as_main(tmp_path, monkeypatch, capsys):
    from flashmask import run

    code = (
        "import sys\n"
        "from transformers import AttentionInterface\n"
        "assert __name__ == '__main__'\n"
        "print('registered', 'flashmask' in AttentionInterface._global_mapping, sys.argv[1:])\n"
        "sys.exit(int(sys.argv[-1]))\n"
    )
    (tmp_path / "fm_launch_target.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = sys.argv
    assert run.main([str(tmp_path / "fm_launch_target.py"), "--flag", "0"]) == 0
    assert run.main(["-m", "fm_launch_target", "3"]) == 3
    assert capsys.readouterr().out.splitlines() == [
        "registered True ['--flag', '0']",
        "registered True ['3']",
    ]
    assert sys.argv is argv  # restored


def test_launcher_usage_errors(capsys):
    from flashmask import run

    assert run.main([]) == 2
    assert "usage: python -m flashmask.run COMMAND" in capsys.readouterr().err
    assert run.main(["-m"]) == 2
    assert "-m needs a MODULE" in capsys.readouterr().err
    assert run.main(["no-such-tool-for-flashmask"]) == 2
    assert "neither a Python file nor a console script" in capsys.readouterr().err
    assert run.main(["--help"]) == 0
    assert "COMMAND is one of" in capsys.readouterr().out


# ---------------------------------------------------------------------- learnable sinks
def test_gpt_oss_with_learnable_sinks_trains_like_eager():
    """gpt-oss (sinks in every layer, sliding and full layers alternating): losses, logits and
    every gradient, the sinks' included, as eager attention's."""
    model = tiny_model("gpt_oss")
    with torch.no_grad():  # transformers initialises the sinks to 0; make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(2)
    inputs = {"input_ids": torch.randint(1, 256, (2, 16), generator=g)}
    compare(model, inputs, "eager", inputs, ctx="gpt_oss")
    result = run(variant(model, "flashmask", F32), inputs)
    assert any(name.endswith("sinks") for name in result if name.startswith("grad:"))


def test_gemma2_with_logit_softcapping_trains_like_eager():
    """Gemma 2 (attention logits capped at a low 2.0 so that the cap bites; sliding and full
    layers alternating): losses, logits and every gradient as eager attention's."""
    model = tiny_model("gemma2")
    with torch.no_grad():  # scores of a few units (at init they are ~0, below any cap)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(25.0)
            layer.self_attn.k_proj.weight.mul_(25.0)
    g = torch.Generator().manual_seed(5)
    inputs = {"input_ids": torch.randint(1, 256, (2, 16), generator=g)}
    compare(model, inputs, "eager", inputs, ctx="gemma2")


def test_gpt_oss_greedy_generation_with_left_padding_matches_eager():
    """Prefill and decode steps over the cache, past the sliding layers' window, with sinks."""
    model = tiny_model("gpt_oss")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(13)
    input_ids = torch.randint(1, 256, (2, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    outputs = []
    for attn in ("flashmask", "eager"):
        m = variant(model, attn)
        m.generation_config.pad_token_id = 0
        outputs.append(
            m.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
        )
    assert torch.equal(outputs[0], outputs[1])


# ---------------------------------------------------------------------- packed sequences
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_position_ids_match_sdpa_packing(kind):
    """TRL padding-free batches (position ids only): same as transformers' own packing path."""
    model = tiny_model(kind)
    inputs = _packed_inputs([[7, 12, 5, 8], [20, 12]], seed=1)
    compare(model, inputs, "sdpa", inputs, ctx=kind)


def test_packed_position_ids_match_eager_with_dense_mask():
    """The flashmask backend in float64 and float32 against eager with the dense additive mask."""
    model = tiny_model("llama")
    doc_lens = [[9, 3, 11, 9], [1, 31]]
    inputs = _packed_inputs(doc_lens, seed=2)
    dense = masks.causal_document(doc_lens).to_dense()
    hi = run(variant(model, "eager", F64), {**inputs, "attention_mask": additive(dense, F64)})
    lo = run(variant(model, "eager", F32), {**inputs, "attention_mask": additive(dense, F32)})
    for dtype in (F64, F32):
        actual = run(variant(model, "flashmask", dtype), inputs)
        assert_results_close(actual, hi, lo, context=str(dtype))


def test_packed_sft_equals_training_each_document_separately():
    """Packed loss terms and gradients == those of a separate forward pass per sample."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    samples = []
    for n in (13, 5, 21, 8, 17, 2, 11):
        ids = torch.randint(1, 256, (n,), generator=g).tolist()
        labels = [-100] * (n // 3) + ids[n // 3 :]  # a "prompt" without loss
        samples.append({"input_ids": ids, "labels": labels})
    batch = data.pack_sft(samples, max_tokens=32)
    assert batch["input_ids"].shape[0] >= 2
    targets = sum(sum(t != -100 for t in s["labels"][1:]) for s in samples)

    def separate(attn: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        m = variant(model, attn, dtype)
        m.zero_grad(set_to_none=True)
        losses = []
        for s in samples:
            logits = m(input_ids=torch.tensor([s["input_ids"]]), use_cache=False).logits
            losses.append(token_losses(logits, torch.tensor([s["labels"]])))
            (losses[-1].sum() / targets).backward()  # the packed mean, one sample at a time
        result = {"token_losses": torch.cat(losses).detach()}
        for name, p in m.named_parameters():
            result[f"grad:{name}"] = p.grad.detach().clone()
        return result

    # Packed loss terms in sample order: each term belongs to the sample of its target token.
    labels = batch["labels"][:, 1:].flatten()
    owner = batch["sample_index"][:, 1:].flatten()[labels != -100]
    order = torch.sort(owner, stable=True).indices
    hi, lo = separate("eager", F64), separate("eager", F32)
    for dtype in (F64, F32):
        packed = run(variant(model, "flashmask", dtype), data.model_inputs(batch))
        del packed["logits"]
        packed["token_losses"] = packed["token_losses"][order]
        assert_results_close(packed, hi, lo, context=str(dtype))


def test_cu_seq_lens_from_hf_flattening_collator():
    """transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True) batches."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    features = [{"input_ids": torch.randint(1, 256, (n,), generator=g).tolist()} for n in (6, 9)]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collate(features)
    flat = {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "cu_seq_lens_q": batch["cu_seq_lens_q"],
        "cu_seq_lens_k": batch["cu_seq_lens_k"],
        "max_length_q": batch["max_length_q"],
        "max_length_k": batch["max_length_k"],
    }
    dense = masks.causal_document([6, 9]).to_dense()
    reference = {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "attention_mask": dense,
    }
    compare(model, flat, "sdpa", reference)


# ---------------------------------------------------------------------- explicit masks
@pytest.mark.parametrize("how", ["flashmask", "startend_row_indices"])
def test_explicit_share_question_mask(how):
    model = tiny_model("llama")
    docs = [[[4, 6, 5], [3, 2, 2]], [[10, 4, 3], [2, 3, 1]]]  # 22 and 23 tokens
    mask = masks.share_question(docs)
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(1, 256, (2, 23), generator=g)
    real = torch.ones(2, 23, dtype=torch.bool)
    real[0, 22] = False
    labels = input_ids.masked_fill(~real, -100)
    kwarg = mask if how == "flashmask" else mask.startend_row_indices
    dense = data.dense_attention_mask(mask)
    compare(
        model,
        {"input_ids": input_ids, "labels": labels, how: kwarg},
        "sdpa",
        {"input_ids": input_ids, "labels": labels, "attention_mask": dense},
        real=real,
        ctx=how,
    )


def test_explicit_mask_with_padding_tail_and_broadcast_batch():
    model = tiny_model("llama")
    mask = masks.causal_document([5, 7], seqlen=16)  # 4 padding tokens, batch 1
    g = torch.Generator().manual_seed(6)
    input_ids = torch.randint(1, 256, (3, 16), generator=g)
    real = torch.ones(3, 16, dtype=torch.bool)
    real[:, 12:] = False
    labels = input_ids.masked_fill(~real, -100)
    labels[:, [0, 5]] = -100
    dense = data.dense_attention_mask(mask)
    compare(
        model,
        {"input_ids": input_ids, "labels": labels, "flashmask": mask},
        "sdpa",
        {"input_ids": input_ids, "labels": labels, "attention_mask": dense},
        real=real,
    )


def test_dense_4d_mask_is_converted():
    """A 4-D mask transformers hands through unchanged is read with FlashMask.from_dense."""
    model = tiny_model("llama")
    mask = masks.causal_document([[3, 9, 4], [8, 8]])
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(1, 256, (2, 16), generator=g)
    via_flashmask = run(variant(model, "flashmask"), {"input_ids": input_ids, "flashmask": mask})
    for mask_4d in (mask.to_dense(), additive(mask.to_dense(), F64)):
        via_dense = run(
            variant(model, "flashmask"), {"input_ids": input_ids, "attention_mask": mask_4d}
        )
        for key, value in via_flashmask.items():
            torch.testing.assert_close(via_dense[key], value, rtol=0, atol=0, msg=key)


def test_explicit_mask_errors():
    model = variant(tiny_model("llama"), "flashmask")
    input_ids = torch.randint(1, 256, (1, 8))
    mask = masks.causal(8)
    with pytest.raises(ValueError, match="either flashmask or startend_row_indices"):
        model(input_ids, flashmask=mask, startend_row_indices=mask.startend_row_indices)
    with pytest.raises(ValueError, match="covers 6 keys"):
        model(input_ids, flashmask=masks.causal(6))
    with pytest.raises(TypeError, match="flashmask must be a FlashMask"):
        model(input_ids, flashmask="causal")


def test_non_causal_explicit_mask_on_a_causal_model_needs_an_opt_in():
    """A bidirectional document mask on a decoder would let tokens see later tokens: it is an
    error naming the argument, and ``flashmask_bidirectional=True`` allows it on purpose."""
    model = tiny_model("llama")
    mask = masks.document([[5, 7], [12]])
    input_ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(11))
    fm = variant(model, "flashmask")
    with pytest.raises(ValueError, match=r"flashmask is a non-causal .*flashmask_bidirectional"):
        fm(input_ids, flashmask=mask)
    c4 = FlashMask(torch.tensor([12, 12, 0, 0], dtype=torch.int32).expand(2, 1, 12, 4), False)
    with pytest.raises(ValueError, match="startend_row_indices is a non-causal mask"):
        fm(input_ids, startend_row_indices=c4.startend_row_indices)  # raw C = 4: non-causal
    with pytest.raises(TypeError, match="flashmask_bidirectional must be a bool"):
        fm(input_ids, flashmask=mask, flashmask_bidirectional="yes")
    compare(
        model,
        {"input_ids": input_ids, "flashmask": mask, "flashmask_bidirectional": True},
        "sdpa",
        {"input_ids": input_ids, "attention_mask": mask.to_dense()},
    )


@pytest.mark.parametrize("name", ["cu_seq_lens_q", "cu_seq_lens_k"])
def test_float_cumulative_lengths_are_rejected(name):
    """A float tensor would be truncated to integers without a word."""
    module = torch.nn.Module()
    q = torch.randn(1, 2, 8, 4)
    lengths = {"cu_seq_lens_q": torch.tensor([0, 3, 8]), "cu_seq_lens_k": torch.tensor([0, 3, 8])}
    lengths[name] = torch.tensor([0.0, 3.5, 8.0])
    with pytest.raises(TypeError, match=f"{name} must be an integer tensor"):
        fm_transformers.flashmask_attention_forward(module, q, q, q, None, **lengths)
    lengths[name] = torch.tensor([0, 3, 8])
    out, _ = fm_transformers.flashmask_attention_forward(module, q, q, q, None, **lengths)
    assert out.shape == (1, 8, 2, 4)


def test_explicit_mask_built_for_another_query_length_is_an_error():
    """A training mask (8 queries) reused on a 3-query call over the same 8 keys."""
    module = torch.nn.Module()
    q, kv = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 8, 4)
    mask = masks.causal_document([5, 3])
    with pytest.raises(ValueError, match=r"built for seqlen_q=8 .*with_seqlen_q\(3\)"):
        fm_transformers.flashmask_attention_forward(module, q, kv, kv, None, flashmask=mask)
    decode = masks.causal_document([5, 3]).with_seqlen_q(None)  # raw indices: any length
    out, _ = fm_transformers.flashmask_attention_forward(module, q, kv, kv, None, flashmask=decode)
    assert out.shape == (1, 3, 2, 4)


# ---------------------------------------------------------------------- padding
@pytest.mark.parametrize("side", ["left", "right", "both", "holes"])
def test_padding_mask_matches_sdpa(side):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(8)
    input_ids = torch.randint(1, 256, (3, 12), generator=g)
    attention_mask = torch.ones(3, 12, dtype=torch.long)
    if side in ("left", "both"):
        attention_mask[0, :4] = 0
        attention_mask[2, :1] = 0
    if side in ("right", "both"):
        attention_mask[1, 7:] = 0
    if side == "holes":
        attention_mask[0, [3, 4, 9]] = 0
        attention_mask[1, 5] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    real = attention_mask.bool()

    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    # Padded rows differ by design: compare (and differentiate) the logits of real rows only.
    compare(model, inputs, "sdpa", inputs, real=real, ctx=side)


def test_resolve_mask_padding_forms():
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    mask = fm_transformers.resolve_mask(3, 5, 5, device=torch.device("cpu"), attention_mask=valid)
    dense = mask.to_dense()[:, 0]
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    contiguous = causal & valid[:, None, :] & valid[:, :, None]
    assert torch.equal(dense[:2], contiguous[:2])  # padded rows see nothing
    assert torch.equal(dense[2], causal & valid[2][None, :])  # holes: only keys hidden


# ---------------------------------------------------------------------- sliding window
@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("mistral", {"sliding_window": 5}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ],
)
def test_sliding_window_with_packing_matches_sdpa(kind, extra):
    model = tiny_model(kind, **extra)
    inputs = _packed_inputs([[3, 12, 9, 8], [20, 12]], seed=9)
    compare(model, inputs, "sdpa", inputs, ctx=kind)


def test_sliding_window_with_padding_matches_sdpa():
    model = tiny_model("mistral", sliding_window=3)
    g = torch.Generator().manual_seed(10)
    input_ids = torch.randint(1, 256, (2, 12), generator=g)
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[0, :3] = 0
    attention_mask[1, 9:] = 0
    real = attention_mask.bool()
    labels = input_ids.masked_fill(~real, -100)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    compare(model, inputs, "sdpa", inputs, real=real)


def test_sliding_window_and_explicit_mask_intersect():
    mask = masks.share_question([[3, 4, 4]])
    window = fm_transformers.resolve_mask(
        1, 11, 11, device=torch.device("cpu"), explicit=mask, sliding_window=3
    )
    expected = mask.to_dense() & masks.sliding_window(11, 2).to_dense()
    assert torch.equal(window.to_dense(), expected)


# ---------------------------------------------------------------------- errors, generation
def test_training_with_attention_dropout_is_an_error():
    model = variant(tiny_model("llama", attention_dropout=0.1), "flashmask")
    input_ids = torch.randint(1, 256, (1, 8))
    model(input_ids)  # eval: dropout is off
    model.train()
    with pytest.raises(ValueError, match="attention_dropout"):
        model(input_ids)


def test_unsupported_arguments_are_errors():
    module = torch.nn.Module()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        fm_transformers.flashmask_attention_forward(module, q, q, q, None, sliding_window=0)


def test_gqa_scaling_and_layout_against_sdpa_directly():
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 6, 10, 16, generator=g, dtype=F64)
    k, v = (torch.randn(2, 3, 10, 16, generator=g, dtype=F64) for _ in range(2))
    out, weights = fm_transformers.flashmask_attention_forward(module, q, k, v, None, scaling=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.3, enable_gqa=True
    ).transpose(1, 2)
    assert weights is None
    assert out.shape == (2, 10, 6, 16)
    torch.testing.assert_close(out, expected)


def test_greedy_generation_with_left_padding_matches_sdpa():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(12)
    input_ids = torch.randint(1, 256, (2, 7), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    outputs = []
    for attn in ("flashmask", "sdpa"):
        m = variant(model, attn)
        m.generation_config.pad_token_id = 0
        outputs.append(
            m.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
        )
    assert torch.equal(outputs[0], outputs[1])


def test_cpu_inputs_keep_their_dtype_and_mixed_dtypes_are_promoted():
    module = torch.nn.Linear(4, 4).to(torch.bfloat16)
    q = torch.zeros(1, 2, 2, 4)
    assert fm_transformers._dtypes(q, q, q, module) == (F32, F32)
    assert fm_transformers._dtypes(q, q, q.bfloat16(), module) == (F32, F32)


def test_autocast_runs_in_the_autocast_dtype_like_sdpa():
    """Under autocast Llama hands over float32 q/k (after RoPE) and a bf16 v."""
    model = tiny_model("llama")
    input_ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(13))
    logits = {}
    for attn in ("flashmask", "sdpa"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits[attn] = variant(model, attn, F32)(input_ids, use_cache=False).logits.float()
    reference = variant(model, "eager", F64)(input_ids, use_cache=False).logits
    error = (logits["flashmask"] - reference).abs().max()
    assert error <= 2 * (logits["sdpa"] - reference).abs().max()


@pytest.mark.gpu
def test_float32_cuda_inputs_run_in_the_weight_dtype():
    module = torch.nn.Module()
    module.q_proj = torch.nn.Linear(16, 16).to("cuda", torch.bfloat16)
    module.is_causal = True
    q, k, v = (torch.randn(1, 2, 64, 16, device="cuda") for _ in range(3))
    out, _ = fm_transformers.flashmask_attention_forward(module, q, k, v, None)
    assert out.dtype == torch.float32
    expected = flashmask.flashmask_attention(
        *(t.transpose(1, 2).bfloat16() for t in (q, k, v)), causal=True
    )
    torch.testing.assert_close(out, expected.float())


def test_enable_activation_checkpointing_works_on_any_transformers_5_model():
    model = tiny_model()
    fm_transformers.enable_activation_checkpointing(model)
    # 5.2x renamed the flag too; read whichever this version has (the old name warns there).
    name = "is_activation_checkpointing"
    if not hasattr(type(model), name):
        name = "is_gradient_checkpointing"
    assert getattr(model, name)


def test_enable_activation_checkpointing_rejects_non_models():
    with pytest.raises(TypeError, match="model"):
        fm_transformers.enable_activation_checkpointing(torch.nn.Linear(2, 2))


def test_packed_position_ids_are_resolved_once_per_forward(monkeypatch):
    """Every layer gets the same ``position_ids`` object: the document bounds (and the host sync
    that derives them) are computed once per forward, not once per layer."""
    calls = []
    original = fm_transformers._document_bounds

    def counting(starts):
        calls.append(starts.shape)
        return original(starts)

    monkeypatch.setattr(fm_transformers, "_document_bounds", counting)
    model = variant(tiny_model(num_hidden_layers=3), "flashmask")
    inputs = _packed_inputs([[5, 7, 4]])
    with torch.no_grad():
        model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False)
        assert len(calls) == 1
        # A new position tensor (the next batch) is resolved again.
        model(
            input_ids=inputs["input_ids"],
            position_ids=inputs["position_ids"].clone(),
            use_cache=False,
        )
    assert len(calls) == 2


def test_the_per_forward_memo_sees_in_place_edits():
    """Editing ``position_ids`` in place between calls changes the mask (``_version`` key)."""
    cpu = torch.device("cpu")
    positions = torch.cat([torch.arange(4), torch.arange(4)]).unsqueeze(0)
    first = fm_transformers.resolve_mask(1, 8, 8, device=cpu, position_ids=positions)
    positions[0, 4:] += 4  # one document now
    second = fm_transformers.resolve_mask(1, 8, 8, device=cpu, position_ids=positions)
    assert first is not None and not bool(first.to_dense()[0, 0, 5, :4].any())
    assert second is None  # plain causal: the maskless fast path


@pytest.mark.parametrize("source", ["cu_seq_lens_q", "attention_mask", "position_ids"])
def test_layers_of_a_forward_share_one_mask_tensor(source):
    """The same batch-describing tensor gives the same FlashMask object, layer after layer, so
    every layer passes the kernels the same ``startend_row_indices`` tensor and their mask
    preparation is done once (``flashmask.kernels.prepare_cached``); layers that differ in
    window (hybrid models) each keep theirs."""
    cpu = torch.device("cpu")
    inputs = {
        "cu_seq_lens_q": torch.tensor([0, 3, 8], dtype=torch.int32),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]),
        "position_ids": torch.cat([torch.arange(3), torch.arange(5)]).unsqueeze(0),
    }
    tensor = inputs[source]

    def resolve(window=None):
        return fm_transformers.resolve_mask(
            1, 8, 8, device=cpu, sliding_window=window, **{source: tensor}
        )

    first, windowed = resolve(), resolve(window=2)
    assert first is not None and windowed is not None
    assert resolve() is first and resolve(window=2) is windowed
    assert windowed.startend_row_indices is not first.startend_row_indices
    assert torch.equal(resolve(window=2).to_dense(), windowed.to_dense())
