"""The tracer: records what a training script does to its tensors (``capuchin trace``).

Modules (one concept each):
    schema    the trace format: columns, roles, kinds, metadata, ids (no torch)
    reader    load/validate and write trace files; derived DataFrames (no torch)
    hooks     torch-side op indexing shared with the runtime: iterations, phases, ids
    record    ``Tracer``: the dispatch mode that records the rows
    timing    per-op device times and allocator peaks from the profiler
    bandwidth host<->device copy bandwidth
    script    running an unmodified script (``trace_script``)
    summary   what ``capuchin show`` prints for a trace (no torch)

Nothing is imported here, so ``import capuchin.tracer.reader`` stays torch-free.
"""
