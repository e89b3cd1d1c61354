"""The runtime: train under a plan (``capuchin run``; ``capuchin.Runtime``).

engine.py (Runtime: lifecycle, iterations, report) -> tracker.py (the plan executor: the
TorchDispatchMode, its hot and slow paths, planned actions, restores) -> swap.py / recompute.py
(how storages leave and come back) and guards/ (the budget guards where no plan applies) ->
backend.py (CPU and CUDA copy engines) with memory.py (the device's memory accounting for the
guard) and state.py (per-storage state, storage-level primitives);
actions.py compiles a Plan into per-op tables; report.py measures and reports; launch.py runs a
script. The helpers for tests and benchmarks are in capuchin/testing/.
"""
