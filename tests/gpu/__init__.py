"""Tests that need a CUDA GPU (skipped on CPU-only machines)."""
