"""Test suite for flashmask; shared helpers live in ``tests.tolerance`` and ``tests.strategies``."""
