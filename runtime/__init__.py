"""The runtime: train under a plan (``capuchin run``; ``capuchin.Runtime``).

engine.py (Runtime: lifecycle, iterations, report) -> tracker.py (the TorchDispatchMode and its slow
path) -> swap.py / recompute.py / passive.py (the three ways storages leave and come back) ->
backend.py (CPU and CUDA copy engines) and state.py (per-storage state, storage-level primitives);
actions.py compiles a Plan into per-op tables; report.py measures and reports; launch.py runs a
script; testing.py holds helpers for tests and benchmarks.
"""
