"""The ping-pong forward experiment (``benchmarks/gluon_forward_pingpong.py``) compiles for
Hopper into three partitions (two compute warpgroups and the producer) with registers moved to
the compute warpgroups, warpgroup MMAs and TMA loads, spilling at most a few bytes (none under
Triton 3.6). Whether its turn-taking is right (and faster) is for a GPU session to check
against the library's Gluon forward."""

from tests.kernels.sm90_compile import compile_reports


def test_pingpong_forward_compiles_into_two_compute_warpgroups_and_a_producer():
    reports = compile_reports("gluon_forward_pingpong.py")
    variants = {(r["causal"], r["has_mask"], r["num_buffers"]) for r in reports}
    assert len(variants) == 8
    for report in reports:
        assert report["warps"] == 12, report  # 4 + 4 compute warps, the producer's warpgroup
        assert any(s.endswith(" 240;") for s in report["setmaxnreg"]), report
        assert report["HGMMA"] > 0 and report["UTMALDG"] > 0, report
        assert report["spill_bytes"] <= 16, report
        assert report["shared_kb"] <= 227, report  # fits the H200's shared memory per block
