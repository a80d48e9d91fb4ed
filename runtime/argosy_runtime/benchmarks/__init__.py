"""Benchmarks behind `argosy bench` (modules import heavy dependencies inside run())."""
