"""Recompute tags inside compiled regions (Note [Region tags] in tracer/region_tags.py, Note
[Planning region tags] in planner/region_tags.py): the trace records each forward region's
candidates, ``plan --region-tags`` proposes them, ``trace --plan`` verifies them bitwise and
compiles them in, and a plan of that trace runs bitwise with them; refused where unchecked."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from capuchin.errors import InfeasibleBudgetError, PlanFormatError, RegionTagsRefused
from capuchin.planner.api import make_plan
from capuchin.planner.plan import Plan, RegionTags
from capuchin.planner.problem import Problem
from capuchin.planner.region_tags import plan_region_tags, proposed_tags
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import state_mismatches
from capuchin.tracer.reader import load_trace
from capuchin.tracer.schema import Phase, TraceMeta, is_compiled_region
from capuchin.tracing import state_after_steps, trace_script

FRAMEWORKS = Path(__file__).resolve().parent / "frameworks"
GPT = FRAMEWORKS / "nanogpt_compiled.py"
MLP_TRACE = Path(__file__).resolve().parent.parent / "traces" / "mlp.trace.parquet"
STEPS = ["--steps", "5"]


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread():
    """As in tests/test_frameworks_compile.py: Inductor's CPU kernels are bitwise reproducible
    at one intra-op thread only, so the references here repeat only there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _quiet(line: str) -> None:
    pass


@pytest.fixture(scope="module")
def untagged(tmp_path_factory):
    out = tmp_path_factory.mktemp("untagged") / "t.parquet"
    return trace_script(GPT, ["--steps", "6"], output=out, log=_quiet, plain_steps=0)


def _smallest(trace) -> int:
    with pytest.raises(InfeasibleBudgetError) as e:
        make_plan(trace, "1%")
    return e.value.smallest_feasible_bytes


def _saved_bytes(trace_path) -> int:
    """Bytes the backward regions read from forward-region outputs (the saved activations)."""
    p = Problem.from_trace(load_trace(trace_path))
    total = 0
    for o in p.ops:
        if is_compiled_region(o.name) and o.phase is Phase.FORWARD:
            for x in o.allocs:
                st = p.storages[x]
                if any(
                    is_compiled_region(p.ops[k].name) and p.ops[k].phase is Phase.BACKWARD
                    for k in st.accesses
                ):
                    total += st.size_bytes
    return total


@pytest.mark.slow
def test_candidates_are_recorded_in_the_trace(untagged):
    """The compiled nanoGPT's forward region: candidates named by compile id and node, each at
    an output position of the region whose storage the backward region reads."""
    tr = load_trace(untagged)
    assert tr.meta.region_tags is None
    (region, entry), *rest = tr.meta.region_candidates.items()
    assert not rest and entry["compile_id"] == "0/0" and entry["tagged"] == []
    assert entry["candidates"]
    p = Problem.from_trace(tr)
    fwd = next(o for o in p.ops if o.name == region)
    assert fwd.phase is Phase.FORWARD
    bwd = {o.index for o in p.ops if is_compiled_region(o.name) and o.phase is Phase.BACKWARD}
    for c in entry["candidates"]:
        assert c["bytes"] > 0 and c["node"] in c["tags"]
        sid = f"{fwd.index}:{c['output']}"
        assert sid in p.storages and bwd & set(p.storages[sid].accesses), c


@pytest.mark.slow
def test_tagged_retrace_lowers_the_smallest_budget_and_trains_bitwise(untagged, tmp_path):
    """The loop: plan --region-tags proposes the candidates (a plan that cannot run), the
    retrace verifies and compiles them in (the forward region saves less, the smallest feasible
    budget drops), a plan of the retrace carries them and runs bitwise equal to the compiled
    script without capuchin, within 1.05x the budget, without divergence; the same plan run
    without its tags diverges (its regions are the tagged program's)."""
    first = make_plan(untagged, "60%", region_tags=True)
    assert first.region_tags is not None and not first.region_tags.traced
    assert first.region_tags.tags == proposed_tags(load_trace(untagged).meta.region_candidates)[0]
    with pytest.raises(RegionTagsRefused, match="not recorded with"):
        Runtime(first)
    path = tmp_path / "first.json"
    first.save(path)
    tagged = trace_script(
        GPT, ["--steps", "6"], output=tmp_path / "t.parquet", log=_quiet, plan=path
    )
    meta = load_trace(tagged).meta
    assert meta.region_tags == first.region_tags.tags
    (entry,) = meta.region_candidates.values()
    assert entry["tagged"] == first.region_tags.tags["0/0"]
    assert _saved_bytes(tagged) < _saved_bytes(untagged)
    smallest = _smallest(tagged)
    assert smallest < _smallest(untagged)
    plan = make_plan(tagged, smallest)
    assert plan.region_tags == RegionTags(first.region_tags.tags, True)
    ref = _gpt_state()
    rt = Runtime(plan)
    assert state_mismatches(ref, _gpt_state(rt)) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert len(its) == 4 and not any(s.diverged for s in its)
    assert all(s.peak_bytes <= 1.05 * plan.budget_bytes for s in its), (
        [s.peak_bytes for s in its],
        plan.budget_bytes,
    )
    bare = Runtime(replace(plan, region_tags=None))
    _gpt_state(bare)
    assert any(s.diverged for s in bare.report.iterations if s.iteration >= 1)


def _gpt_state(context=None) -> dict[str, torch.Tensor]:
    """The script's final state, found without global module hooks (which Dynamo would compile
    into other regions than the trace saw)."""
    import contextlib

    return state_after_steps(GPT, STEPS, 10**6, context or contextlib.nullcontext())


@pytest.mark.slow
def test_a_tag_set_that_is_not_bitwise_is_dropped(untagged, tmp_path, monkeypatch):
    """The verifying run compares the tagged program's state with the untagged one's; a tag set
    whose run differs is dropped with one line, and the trace records the untagged program.
    Forced here: the tagged run also compiles Inductor's CPU kernels without vectorization
    (``cpp.simdlen`` 1), which sums reductions in another order, as a fusion change may."""
    import contextlib

    import torch._inductor.config as ic
    from capuchin.tracer import region_tags

    real = region_tags.tagged

    @contextlib.contextmanager
    def differs(tags):
        with real(tags) as part, ic.patch({"cpp.simdlen": 1}):
            yield part

    monkeypatch.setattr(region_tags, "tagged", differs)
    first = make_plan(untagged, "60%", region_tags=True)
    path = tmp_path / "first.json"
    first.save(path)
    lines: list[str] = []
    out = trace_script(
        GPT,
        ["--steps", "4"],
        output=tmp_path / "t.parquet",
        log=lines.append,
        plan=path,
        plain_steps=0,
    )
    dropped = [x for x in lines if "region tags dropped" in x]
    assert len(dropped) == 1 and "state tensor(s) differ" in dropped[0], lines
    meta = load_trace(out).meta
    assert meta.region_tags is None
    assert all(e["tagged"] == [] for e in meta.region_candidates.values())
    assert make_plan(out, "60%").region_tags is None


@pytest.mark.slow
def test_every_partition_runs_under_the_partitioner():
    """Inductor's and AOTAutograd's caches are off while the partitioner is installed: a
    function compiled again (the same script traced twice in one process, or compiled before
    capuchin) still goes through it, so its partition is recorded and its tags applied."""
    import torch._dynamo
    from capuchin.tracer import region_tags

    def f(x, w):
        return (torch.nn.functional.gelu(x @ w) * 2).sum()

    x, w = torch.randn(8, 16), torch.randn(16, 32, requires_grad=True)
    for _ in range(2):
        with region_tags.tagged({}) as part:
            torch.compile(f)(x, w).backward()
        assert part.partitions, "the partition ran"


# ---- refusals and formats (fast) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_plan():
    return make_plan(MLP_TRACE, "60%")


def test_a_plan_with_untraced_tags_is_refused_by_the_runtime(mlp_plan):
    plan = replace(mlp_plan, region_tags=RegionTags({"0/0": ["mul"]}, traced=False))
    with pytest.raises(RegionTagsRefused, match="not recorded with"):
        Runtime(plan)


def test_region_tags_are_refused_on_cuda(mlp_plan, tmp_path):
    """Nothing about tags was checked on a GPU: the runtime, the planner and trace --plan refuse
    them there before CUDA is even looked for."""
    prov = replace(mlp_plan.provenance, device="cuda")
    plan = replace(mlp_plan, provenance=prov, region_tags=RegionTags({"0/0": ["mul"]}, True))
    with pytest.raises(RegionTagsRefused, match="refused on cuda"):
        Runtime(plan)
    meta = TraceMeta(
        device="cuda",
        region_candidates={"r": {"compile_id": "0/0", "tagged": [], "candidates": []}},
    )
    with pytest.raises(RegionTagsRefused, match="refused on cuda"):
        plan_region_tags(meta, propose=True)
    path = tmp_path / "p.json"
    replace(mlp_plan, region_tags=RegionTags({"0/0": ["mul"]}, False)).save(path)
    with pytest.raises(RegionTagsRefused, match="refused on cuda"):
        trace_script(GPT, ["--steps", "2"], output=tmp_path / "t.parquet", plan=path, device="cuda")
    assert not (tmp_path / "t.parquet").exists()


def test_a_users_own_partitioner_is_refused(monkeypatch):
    """capuchin partitions compiled regions itself while it traces: a partitioner the user set
    would be replaced silently, so it is refused."""
    import torch._inductor.config as ic
    from capuchin.tracer import region_tags
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class Own(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            raise AssertionError("not called")

        def uuid(self):
            return "own"

    own = Own()
    monkeypatch.setattr(ic, "custom_partitioner_fn", own)
    with pytest.raises(RegionTagsRefused, match="custom_partitioner_fn is set"):
        region_tags.install({})
    assert ic.custom_partitioner_fn is own and region_tags.current() is None


def test_trace_plan_without_tags_is_refused(mlp_plan, tmp_path):
    path = tmp_path / "p.json"
    mlp_plan.save(path)
    with pytest.raises(RegionTagsRefused, match="carries no region tags"):
        trace_script(GPT, ["--steps", "2"], output=tmp_path / "t.parquet", plan=path)


def test_plan_region_tags_from_the_trace_meta():
    cands = {
        "inductor_compiled_code.a": {
            "compile_id": "0/0",
            "tagged": [],
            "candidates": [
                {"node": "view", "output": 3, "bytes": 64, "tags": ["mul", "view"]},
                {"node": "view_2", "output": 4, "bytes": 32, "tags": ["add", "view_2"]},
            ],
        },
        "inductor_compiled_code.b": {
            "compile_id": "1/0",
            "tagged": [],
            "candidates": [{"node": "x", "output": 1, "bytes": 8, "tags": ["x"]}],
        },
    }
    tags, total = proposed_tags(cands)
    assert tags == {"0/0": ["add", "mul", "view", "view_2"], "1/0": ["x"]} and total == 104
    untagged = TraceMeta(region_candidates=cands)
    assert plan_region_tags(untagged, propose=False) == (None, None)
    got, line = plan_region_tags(untagged, propose=True)
    assert got == RegionTags(tags, traced=False, candidate_bytes=104) and "retrace" in line
    traced = TraceMeta(region_candidates=cands, region_tags={"0/0": ["mul"]})
    for propose in (False, True):  # a plan of a tagged trace keeps its tags either way
        assert plan_region_tags(traced, propose)[0] == RegionTags({"0/0": ["mul"]}, True)
    none, line = plan_region_tags(TraceMeta(), propose=True)
    assert none is None and "no candidate" in line


def test_region_tags_round_trip_in_the_plan_and_old_files_load(mlp_plan):
    tagged = replace(mlp_plan, region_tags=RegionTags({"0/0": ["mul", "view"]}, True, 96))
    back = Plan.from_json(tagged.to_json())
    assert back.region_tags == tagged.region_tags
    doc = json.loads(mlp_plan.to_json())
    assert "region_tags" not in doc  # additive: a plan without tags is as before
    assert Plan.from_json(json.dumps(doc)).region_tags is None
    doc["region_tags"] = {"tags": {"0/0": "mul"}, "traced": True}
    with pytest.raises(PlanFormatError, match="region_tags.tags.0/0"):
        Plan.from_json(json.dumps(doc))
    doc["region_tags"] = {"tags": {}, "traced": "yes"}
    with pytest.raises(PlanFormatError, match="region_tags.traced"):
        Plan.from_json(json.dumps(doc))


def test_trace_meta_fields_are_additive():
    old = {k: v for k, v in json.loads(TraceMeta().to_bytes()).items()}
    del old["region_candidates"], old["region_tags"]
    meta = TraceMeta.from_bytes(json.dumps(old).encode())
    assert meta.region_candidates == {} and meta.region_tags is None
    meta = TraceMeta(region_candidates={"r": {"compile_id": "0/0"}}, region_tags={"0/0": ["a"]})
    back = TraceMeta.from_bytes(meta.to_bytes())
    assert back.region_candidates == meta.region_candidates and back.region_tags == {"0/0": ["a"]}
