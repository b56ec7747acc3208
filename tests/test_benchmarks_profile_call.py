"""``benchmarks/profile_call.py`` on CPU: the Nsight Compute command it prints for our call (the
attention kernels of every family, CuTe's among them, and the preparation's) and for
FlashMask-4's (its whole call), the options FlashMask-4's call refuses, and that it times
nothing without a GPU."""

from __future__ import annotations

import shlex

import pytest
import torch


@pytest.fixture
def script(import_benchmark):
    return import_benchmark("profile_call")


def ncu_words(script, capsys, argv: list[str]) -> list[str]:
    assert script.main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("PYTHONPATH=src ncu ")
    return shlex.split(line.removeprefix("PYTHONPATH=src "))


def test_the_ncu_command_for_our_call_selects_every_kernel_family(script, capsys):
    words = ncu_words(script, capsys, ["--mask", "causal", "--seqlen", "8192", "--ncu"])
    kernels = words[words.index("-k") + 1]
    for family in ("flashmask_", "gluon_", "kernel_cutlass_kernel_flashmask", "tile_list_kernel"):
        assert family in kernels
    assert words[words.index("-o") + 1] == "flashmask_causal_8192"
    # It reruns this script with the same options under the profiler, marked for it.
    rerun = words[words.index("benchmarks/profile_call.py") + 1 :]
    assert rerun == ["--mask", "causal", "--seqlen", "8192", "--under-ncu"]


def test_the_ncu_command_for_flashmask4_profiles_its_whole_call(script, capsys):
    argv = ["--mask", "document", "--seqlen", "32768", "--impl", "fm4", "--ncu"]
    words = ncu_words(script, capsys, argv)
    assert "-k" not in words
    assert words[words.index("-o") + 1] == "fm4_document_32768"
    rerun = words[words.index("benchmarks/profile_call.py") + 1 :]
    assert rerun == ["--mask", "document", "--seqlen", "32768", "--impl", "fm4", "--under-ncu"]


@pytest.mark.parametrize("option", [["--fp8"], ["--deterministic"], ["--kv-heads", "4"]])
def test_flashmask4_refuses_the_options_only_our_call_has(script, capsys, option):
    with pytest.raises(SystemExit):
        script.parse(["--impl", "fm4", *option])
    assert "--impl fm4" in capsys.readouterr().err


def test_an_unknown_implementation_is_refused_naming_the_option(script, capsys):
    with pytest.raises(SystemExit):
        script.parse(["--impl", "flex"])
    assert "--impl" in capsys.readouterr().err


def test_it_refuses_to_time_without_a_gpu(script):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        script.main(["--mask", "full", "--impl", "fm4"])
