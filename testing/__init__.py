"""Helpers for tests, benchmarks and notebooks; not used by the tools themselves.

synthetic.py  traces in the real trace format from hand-written op lists, and generated
              transformer-like and random iterations (no torch)
training.py   train a bundled example in-process and compare its final state bit for bit;
              hand-made plans that force one runtime mechanism (imports torch)
"""
