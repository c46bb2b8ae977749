"""Benchmark scripts and their helpers; run a script from the repository root with PYTHONPATH=."""
