"""Tests of ``flashmask.kernels``: tile preparation and the Triton kernels (interpreter on CPU)."""
