"""Benchmarks (``python -m moefuse bench <family>``). Nothing here runs at import time."""
