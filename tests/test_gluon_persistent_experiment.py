"""The persistent-grid forward experiment (``benchmarks/gluon_forward_persistent.py``) compiles
for Hopper into the library kernel's three partitions (two compute warpgroups at 240 registers
and the producer), with warpgroup MMAs and TMA loads, no spills, within the H200's shared
memory. Whether its work-item loop is right (and faster) is for a GPU session to check against
the library's Gluon forward."""

from tests.kernels.sm90_compile import compile_reports


def test_persistent_forward_compiles_into_two_compute_warpgroups_and_a_producer():
    reports = compile_reports("gluon_forward_persistent.py")
    assert {(r["causal"], r["has_mask"]) for r in reports} == {
        (False, False), (False, True), (True, False), (True, True),
    }  # fmt: skip
    for report in reports:
        assert report["warps"] == 12, report  # 4 + 4 compute warps, the producer's warpgroup
        assert any(s.endswith(" 240;") for s in report["setmaxnreg"]), report
        assert report["HGMMA"] > 0 and report["UTMALDG"] > 0, report
        assert report["spill_bytes"] <= 16, report
        assert report["shared_kb"] <= 227, report
