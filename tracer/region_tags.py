"""Recompute tags inside compiled regions (Note [Region tags]): which saved activations of a
compiled forward region its backward could recompute cheaply (recorded while tracing), the tags
that make Inductor's partitioner recompute them (applied from a plan), and the verifying run
that keeps only tag sets that train bitwise like the untagged program.

# Note: [Region tags]
# A compiled region's saved activations (the forward region's outputs its backward region reads)
# are chosen by Inductor's partitioner (min-cut rematerialization) when the region compiles; no
# eviction at run time can lower the memory *inside* the backward region, which reads them all at
# once. A joint-graph node tagged ``node.meta["recompute"] = MUST_RECOMPUTE`` is not saved: the
# partitioner recomputes it inside the backward region (../shared/reports/compile-research.md,
# Q3b). capuchin reaches the joint graph through ``torch._inductor.config.custom_partitioner_fn``
# (``RegionPartitioner``): it tags the nodes the plan names, then calls the default partitioner
# exactly as Inductor does without it (so with no tags the compiled code is the same), and
# records the partition. It is installed while capuchin traces (recording only, unless
# ``trace --plan`` gives tags) and while a plan with tags runs, and Inductor's and AOTAutograd's
# caches are off while it is (``torch.compiler.config.force_disable_caches``): a graph compiled
# without the tags is never reused, and every partition runs, so is recorded.
# - Keys. A region's joint graph is identified by Dynamo's compile id (``"0/0"``: frame and
#   recompile count, stable across runs of one script) and a node by its FX name (the
#   partitioner keeps the joint graph's names in the forward graph's outputs). The tracer ties a
#   traced forward region (``inductor_compiled_code.<hash>``) to its compile id by its output
#   names (``original_gm``), which the record of each partition holds; a region whose output
#   names match no partition, or several, has no candidates.
# - Candidates. A saved output is a candidate when the nodes that make it from what the region
#   already keeps (its inputs, its other saved outputs) are all cheap: pointwise (``Tag.pointwise``)
#   or views, none drawing random numbers, at most ``MAX_CHAIN`` of them. Tagging that chain frees
#   the candidate's bytes without saving anything new in its place, and recomputing pointwise
#   nodes inside the backward changes the fusion of those kernels least (the research's advice).
#   A chain through a matmul, a reduction or an unsaved intermediate is no candidate.
# - Exactness is measured, not built in: tags change which kernels Inductor fuses, and a fused
#   kernel may round differently. ``verify_region_tags`` (capuchin/tracing.py) runs the
#   script's first optimizer steps twice in this process, untagged then tagged, from the same
#   RNG state, and compares every state tensor (parameters, gradients, optimizer state,
#   buffers; ``torch.equal``). A tag set that differs is dropped whole, with one line, and the
#   trace records the untagged program: its saved activations are then swapped like any
#   others. On CUDA tags are refused up front: no GPU has run this check, and GPU kernels that
#   reduce with atomics need not repeat bitwise at all.
# The hooks (``custom_partitioner_fn``, ``CustomPartitionerFn``, ``min_cut_rematerialization_
# partition``, ``CompileContext.current_compile_id``, the ``recompute``/``ac_graph_id`` meta
# keys) are private to torch and were checked on torch 2.13.0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import RegionTagsRefused

MAX_CHAIN = 64  # cheap nodes a candidate's chain may hold (Note [Region tags])


def _compile_id() -> str:
    cid = torch._guards.CompileContext.current_compile_id()
    return str(cid) if cid is not None else "?"


def _val_bytes(node) -> int:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return int(v.numel()) * v.element_size()
    return 0


def _is_view(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or len(schema.returns) != 1:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _cheap(node) -> bool:
    """A node the backward may recompute at little cost and exactly as the forward made it:
    pointwise or a view, drawing no random numbers."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    tags = node.target.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    return torch.Tag.pointwise in tags or _is_view(node.target)


def _chain(node, kept: set[str]) -> list[str] | None:
    """The cheap nodes that make ``node`` from placeholders and ``kept`` nodes, or None when a
    node on the way is not cheap (Note [Region tags])."""
    out: list[str] = []
    seen: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.op == "placeholder" or (n is not node and n.name in kept):
            continue
        if not _cheap(n) or len(out) >= MAX_CHAIN:
            return None
        out.append(n.name)
        stack.extend(a for a in n.all_input_nodes)
    return sorted(out)


def _output_names(gm) -> list[str | None]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    args = out.args[0] if isinstance(out.args[0], list | tuple) else [out.args[0]]
    return [getattr(a, "name", None) for a in args]


@dataclass
class Partition:
    """What the partitioner did for one compile id: the forward graph's outputs (names, in
    order; after ``num_fwd_outputs`` the saved ones), the candidates among the saved ones
    (``{"node", "bytes", "tags"}``) and the nodes tagged from the plan."""

    compile_id: str
    outputs: list[str | None]
    num_fwd_outputs: int
    candidates: list[dict[str, Any]] = field(default_factory=list)
    tagged: list[str] = field(default_factory=list)


def _partition_record(cid: str, joint, fw, num_fwd: int, tagged: list[str]) -> Partition:
    outputs = _output_names(fw)
    saved = [n for n in outputs[num_fwd:] if n is not None]
    kept = set(saved)
    nodes = {n.name: n for n in joint.graph.nodes}
    cands = []
    for name in saved:
        node = nodes.get(name)
        if node is None or node.op == "placeholder":
            continue
        chain = _chain(node, kept)
        if chain:
            cands.append({"node": name, "bytes": _val_bytes(node), "tags": chain})
    return Partition(cid, outputs, num_fwd, cands, tagged)


def _partitioner_class():
    """``RegionPartitioner``, made once: its base class is imported only when tags are used,
    and it is bound at module level so that Inductor can pickle it into a cache key."""
    cls = globals().get("RegionPartitioner")
    if cls is not None:
        return cls
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class RegionPartitioner(CustomPartitionerFn):
        """Tags the joint graph's nodes the plan names, partitions as Inductor does by default,
        records the partition (Note [Region tags])."""

        def __init__(self, tags: Mapping[str, list[str]]):
            self.tags = {cid: frozenset(names) for cid, names in tags.items()}
            self.partitions: dict[str, Partition] = {}

        def __call__(self, gm, joint_inputs, **kwargs):
            from torch._functorch.partitioners import min_cut_rematerialization_partition
            from torch.utils.checkpoint import CheckpointPolicy

            cid = _compile_id()
            wanted = self.tags.get(cid, frozenset())
            tagged = []
            for node in gm.graph.nodes:
                if node.name in wanted and node.op == "call_function":
                    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    node.meta["ac_graph_id"] = 0
                    tagged.append(node.name)
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
            num_fwd = int(kwargs.get("num_fwd_outputs", 0))
            self.partitions[cid] = _partition_record(cid, gm, fw, num_fwd, tagged)
            return fw, bw

        def uuid(self):
            # caches are off while installed (``install``); the tags name the partition anyway
            return repr(sorted((k, sorted(v)) for k, v in self.tags.items()))

    RegionPartitioner.__qualname__ = "RegionPartitioner"
    RegionPartitioner.__module__ = __name__
    globals()["RegionPartitioner"] = RegionPartitioner
    return RegionPartitioner


# (installed partitioner, the partitioner config value and the cache switch it replaced)
_STACK: list[tuple[Any, Any, bool]] = []


def install(tags: Mapping[str, list[str]] | None = None):
    """Make Inductor partition through a ``RegionPartitioner`` with ``tags`` (compile id ->
    node names) until ``uninstall``; Dynamo's caches are reset so that nothing compiled before
    runs untagged. Refuses a partitioner the user set (it would be replaced silently)."""
    import torch._dynamo
    import torch._inductor.config as ic

    before = ic.custom_partitioner_fn
    if before is not None and not (_STACK and before is _STACK[-1][0]):
        raise RegionTagsRefused(
            "torch._inductor.config.custom_partitioner_fn is set: capuchin partitions compiled "
            "regions itself while it traces or runs with region tags; unset it"
        )
    part = _partitioner_class()(dict(tags or {}))
    _STACK.append((part, before, torch.compiler.config.force_disable_caches))
    ic.custom_partitioner_fn = part
    # no graph compiled without these tags comes back from Inductor's or AOTAutograd's caches,
    # and every region's partition runs (and is recorded) here
    torch.compiler.config.force_disable_caches = True
    torch._dynamo.reset()
    return part


def uninstall() -> None:
    import torch._inductor.config as ic

    if _STACK:
        _, before, caches_off = _STACK.pop()
        ic.custom_partitioner_fn = before
        torch.compiler.config.force_disable_caches = caches_off


def current():
    """The installed ``RegionPartitioner``, or None."""
    return _STACK[-1][0] if _STACK else None


@contextlib.contextmanager
def tagged(tags: Mapping[str, list[str]] | None):
    part = install(tags)
    try:
        yield part
    finally:
        uninstall()


def region_output_names(callable_) -> tuple[str | None, ...]:
    """The output names of a compiled region's graph (``original_gm``), () without one."""
    from torch._higher_order_ops.wrap import _resolve_inductor_callable

    c = _resolve_inductor_callable(callable_)
    got = getattr(c, "_capuchin_outputs", None)
    if got is None:
        gm = getattr(c, "original_gm", None)
        got = tuple(_output_names(gm)) if gm is not None else ()
        with contextlib.suppress(AttributeError):
            c._capuchin_outputs = got
    return got


def region_candidates(
    part, forward_outputs: Mapping[str, tuple[str | None, ...]]
) -> dict[str, dict[str, Any]]:
    """The trace's ``region_candidates`` (docs/tracing.md): for each forward region (by op
    name) whose output names match exactly one recorded partition, its compile id and its
    candidates, each with its output position (Note [Region tags])."""
    if part is None:
        return {}
    got: dict[str, dict[str, Any]] = {}
    for region, names in sorted(forward_outputs.items()):
        match = [p for p in part.partitions.values() if tuple(p.outputs) == tuple(names)]
        if len(match) != 1:
            continue
        p = match[0]
        cands = [{**c, "output": list(names).index(c["node"])} for c in p.candidates]
        got[region] = {"compile_id": p.compile_id, "tagged": sorted(p.tagged), "candidates": cands}
    return got


def refuse_on(device: str, where: str) -> None:
    """Tags are checked bitwise on CPU only (Note [Region tags])."""
    if device != "cpu":
        raise RegionTagsRefused(
            f"{where}: recompute tags inside compiled regions are refused on {device}: their "
            "bit-identity is checked by a verifying run, and none has run on a GPU"
        )


def state_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the state tensors not ``torch.equal`` (or present in one only)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]
