"""The head-dim-256 Gluon backward experiment (``benchmarks/gluon_backward_hd256.py``) compiles
for Hopper into the library backward's partitions (two consumer warpgroups raised to 240
registers, the producer and the dQ writers), with warpgroup MMAs for all five products, TMA
loads and vector atomics for dQ, within the H200's shared memory. Whether its results are right
(and faster than the Triton hd256 backward) is for a GPU session to check."""

from tests.kernels.sm90_compile import compile_reports


def test_hd256_backward_compiles_into_two_consumer_warpgroups_a_producer_and_writers():
    reports = compile_reports("gluon_backward_hd256.py")
    assert {(r["causal"], r["has_mask"], r["dq_tma"]) for r in reports} == {
        (False, False, False), (False, True, False), (True, False, False), (True, True, False),
        (True, True, True),  # dQ through TMA reduce-adds (gluon_bwd.DQ_TMA's path)
    }  # fmt: skip
    for report in reports:
        assert report["warps"] == 12, report  # 8 consumer warps, the producer's warpgroup
        assert any("inc.sync.aligned.u32 240" in s for s in report["setmaxnreg"]), report
        # Per warpgroup: S^T and dP^T over D = 256 (16 k-steps each), dV, dK, dQ (4 each).
        assert report["HGMMA"] >= 44, report
        assert report["UTMALDG"] > 0, report
        if report["dq_tma"]:
            assert report["UTMAREDG"] > 0 and report["REDG"] == 0, report
        else:
            assert report["REDG"] > 0 and report["UTMAREDG"] == 0, report
        # The dQ writer's 24 registers hold a 8x256 fp32 slice: a few spills there (64 bytes
        # under Triton 3.6); none in the consumers, none with the TMA reduce.
        assert report["spill_bytes"] <= 256, report
        assert report["shared_kb"] <= 227, report
