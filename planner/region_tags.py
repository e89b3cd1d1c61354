"""The plan's recompute tags inside compiled regions (Note [Region tags] in
tracer/region_tags.py), from the trace's metadata. No torch.

# Note: [Planning region tags]
# Tags change the compiled program, so a plan cannot both propose tags and schedule the tagged
# program's storages from one trace. The loop is:
# 1. ``capuchin plan --region-tags TRACE`` on a trace recorded without tags proposes every
#    candidate the trace recorded (``region_candidates``: saved activations made by pointwise and
#    view nodes from what the region keeps anyway), whose bytes the tags take out of each
#    backward region's inputs. The plan carries them with ``traced: false``; its decisions are
#    the untagged trace's (best effort, never refused for the budget) and ``capuchin run``
#    refuses it.
# 2. ``capuchin trace --plan PLAN`` checks the tags by a verifying run (dropped, with one line,
#    when not bitwise) and records the tagged program; its trace holds the tags it ran with
#    (``region_tags``).
# 3. Any plan of that trace (with or without ``--region-tags``) carries those tags with
#    ``traced: true``, and the runtime compiles with them, so its regions are the trace's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import RegionTagsRefused
from .plan import Plan, RegionTags


def proposed_tags(candidates: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, list[str]], int]:
    """Every candidate's tags by compile id, and the candidates' bytes (one call of each
    region: a region called several times a step saves them at each call)."""
    tags: dict[str, set[str]] = {}
    total = 0
    for entry in candidates.values():
        for c in entry.get("candidates", ()):
            tags.setdefault(entry["compile_id"], set()).update(c["tags"])
            total += int(c["bytes"])
    return {cid: sorted(names) for cid, names in sorted(tags.items())}, total


def plan_region_tags(meta, propose: bool) -> tuple[RegionTags | None, str | None]:
    """The ``region_tags`` of a plan of a trace with metadata ``meta`` (Note [Planning region
    tags]), and a line for the user (None: nothing to say)."""
    traced = getattr(meta, "region_tags", None)
    if traced:
        line = None
        if propose:
            line = "region tags: kept the tags the trace was recorded with"
        return RegionTags({k: list(v) for k, v in traced.items()}, True), line
    if not propose:
        return None, None
    if getattr(meta, "device", "cpu") != "cpu":
        raise RegionTagsRefused(
            "--region-tags: recompute tags inside compiled regions are refused on "
            f"{meta.device}: their bit-identity is checked by a verifying run, and none has "
            "run on a GPU"
        )
    tags, total = proposed_tags(getattr(meta, "region_candidates", None) or {})
    if not tags:
        return None, "region tags: the trace recorded no candidate inside a compiled region"
    n = sum(len(v) for v in tags.values())
    return RegionTags(tags, False, total), (
        f"region tags: proposed {n} node(s) in {len(tags)} compiled region(s), recomputed inside "
        f"the backward instead of saving {total} B per call; this plan's decisions are for "
        "the untagged program and it cannot run: retrace with `capuchin trace --plan PLAN` "
        "and plan that trace"
    )


def with_region_tags(plan: Plan, meta, propose: bool) -> Plan:
    """``plan`` with its ``region_tags`` set from the trace's ``meta`` (and a note)."""
    tags, line = plan_region_tags(meta, propose)
    plan.region_tags = tags
    if line is not None:
        plan.predictions.notes.append(line)
    return plan
