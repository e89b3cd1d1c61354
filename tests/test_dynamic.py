"""Dynamic mode (runtime/guards/dtr.py: DTR's eviction and rematerialization where no plan applies):
every bundled example and a Hugging Face model train 5 steps at 50% of their peak with every
parameter, gradient, optimizer state and buffer ``torch.equal`` to plain training, the measured
peak (PyTorch's allocator accounting) within 1.05 x the budget in every iteration; replays
(forced with ``remat="recompute"``) are exact, including dropout (RNG replay), in-place chains
and sources that were freed (regenerated on the way); the LRU passive mode stays selectable."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from capuchin.errors import PlanFormatError, RecomputeError
from capuchin.planner.problem import Problem
from capuchin.runtime.engine import Runtime
from capuchin.runtime.snapshot import state_of
from capuchin.runtime.state import storage_key
from capuchin.testing.training import (
    TRACES,
    state_mismatches,
    train_mismatches,
    train_tiny_bert,
)
from capuchin.tracer.reader import load_trace

SLACK = 1.05
STEPS5 = ("--steps", "5")


@cache
def peak(name: str) -> int:
    return Problem.from_trace(load_trace(TRACES / f"{name}.trace.parquet")).peak_bytes


def complete(rt: Runtime):
    return [s for s in rt.report.iterations if s.complete]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn", "transformer", "mlp"])
def test_examples_at_half_the_peak_train_bitwise_within_budget(name):
    budget = peak(name) // 2
    rt = Runtime(device="cpu", budget_bytes=budget, measure_memory=True)
    assert train_mismatches(name, rt, STEPS5) == []
    its = complete(rt)
    assert len(its) == 5
    assert all(s.passive_evictions > 0 for s in its), "50% of the peak needs eviction"
    for s in its:
        assert s.passive_short_bytes == 0, s
        assert s.peak_bytes <= SLACK * budget, (s.iteration, s.peak_bytes, budget)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformer", "mlp", "cnn"])
def test_forced_replay_is_exact(name):
    """Every evicted storage that can be replayed exactly is dropped and replayed: dropout's
    bernoulli_ (RNG replay), in-place chains (relu_, dropout's mul_), freed sources (the MLP's
    addmm outputs behind tanh) regenerated on the way; bitwise-identical training."""
    rt = Runtime(
        device="cpu", budget_bytes=peak(name) // 2, measure_memory=False, remat="recompute"
    )
    assert train_mismatches(name, rt, STEPS5) == []
    its = complete(rt)
    assert sum(s.dynamic_drops for s in its) > 0
    assert sum(s.recomputed_ops for s in its) > 0


def test_lru_passive_mode_stays_selectable():
    rt = Runtime(device="cpu", budget_bytes=peak("mlp") // 2, measure_memory=False, eviction="lru")
    assert train_mismatches("mlp", rt) == []
    its = complete(rt)
    assert sum(s.passive_evictions for s in its) > 0
    assert sum(s.dynamic_drops + s.dynamic_swaps for s in its) == 0
    with pytest.raises(PlanFormatError, match="eviction"):
        Runtime(device="cpu", budget_bytes=1, eviction="fifo")


def test_swap_only_dynamic_mode_never_replays():
    rt = Runtime(
        device="cpu", budget_bytes=peak("transformer") // 2, measure_memory=False, remat="swap"
    )
    assert train_mismatches("transformer", rt) == []
    its = complete(rt)
    assert sum(s.dynamic_swaps for s in its) > 0
    assert sum(s.dynamic_drops + s.recomputed_ops for s in its) == 0


def _drop(rt: Runtime, t: torch.Tensor) -> None:
    """Evict ``t``'s storage by dropping it, as dynamic mode's eviction does."""
    g = rt.ex.guard
    key = storage_key(t.untyped_storage())
    plan = g.tracker.replay_plan(key)
    assert plan is not None
    g._drop(key, t.untyped_storage(), t.untyped_storage().nbytes(), plan)
    assert t.untyped_storage().nbytes() == 0


def test_a_recorded_call_s_template_holds_no_tensor():
    """A recorded call's template replaces every tensor by its flat position, in nested lists too
    (``aten.index``'s indices: a list whose tensor is not the call's first; a template that kept
    it, from reusing the list position as the flat one, replayed the first iteration's indices:
    an IndexError in tests/test_runtime_resync.py, flakily); filled back, it is the call."""
    from capuchin.runtime.guards.dtr import _template
    from capuchin.runtime.recompute import _fill

    a, b, c = torch.ones(2), torch.zeros(3), torch.arange(4)
    call = (a, [b, None, c], 3, [1, 2], (c,))

    def leaves(x):
        if isinstance(x, (list, tuple)):
            for v in x:
                yield from leaves(v)
        else:
            yield x

    t = _template(call, [0])
    assert not any(isinstance(v, torch.Tensor) for v in leaves(t)), t
    got = _fill(t, [a, b, c, c])
    assert got[0] is a and got[1][0] is b and got[1][1] is None and got[1][2] is c
    assert got[2:4] == (3, [1, 2]) and got[4][0] is c
    assert type(got[1]) is list and type(got[4]) is tuple


def test_replay_of_dropout_inplace_chain_and_freed_source_is_exact():
    """Unit level: a dropped storage comes back with the same bytes when the script reads it:
    dropout (RNG replay under the recorded state, the global stream untouched), an in-place
    chain (R1), a source the script freed (regenerated on the way)."""
    rt = Runtime(device="cpu", budget_bytes=1 << 40, measure_memory=False, remat="recompute")
    with rt:
        a = torch.randn(64, 64)
        d = torch.nn.functional.dropout(a, 0.5, training=True)
        c = a.exp()
        c.mul_(3).add_(1)  # chain: exp, mul_, add_
        b = a.sin()
        e = b.tanh()
        del b  # e's source is gone; its replay regenerates it
        want = {n: t.clone() for n, t in (("d", d), ("c", c), ("e", e))}
        for t in (d, c, e):
            _drop(rt, t)
        state = torch.get_rng_state()
        got = {"d": d + 0, "c": c + 0, "e": e + 0}
        assert torch.equal(torch.get_rng_state(), state), "a replay moved the global RNG"
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert rt.report.iterations[0].recomputed_ops >= 1 + 3 + 2


def test_r2_a_source_written_since_makes_a_storage_swap_only():
    """A storage whose replay would read a source written after it was read is never dropped
    (the eviction-time check; without it the replay would raise or read the new value)."""
    rt = Runtime(device="cpu", budget_bytes=1 << 40, measure_memory=False, remat="recompute")
    with rt:
        x = torch.randn(64, 64)
        y = x * 2
        tr = rt.ex.guard.tracker
        ky = storage_key(y.untyped_storage())
        assert tr.replay_plan(ky) is not None
        x.add_(1)
        assert tr.replay_plan(ky) is None
        z = x.cos()
        del x  # a freed source written before it was read is fine; written after, not
        assert tr.replay_plan(storage_key(z.untyped_storage())) is not None


def test_a_regenerated_source_never_shadows_a_live_sibling_written_since():
    """Regenerating a freed source replays its producer, which also remakes the producer's other
    outputs; where one of those is alive and was written since (the CNN: batch norm's output,
    relu_ in place, next to its freed saved statistics), the replay would read the remade copy.
    Such a storage is not dropped (it was: wrong bytes, caught by CAPUCHIN_VERIFY)."""
    rt = Runtime(device="cpu", budget_bytes=1 << 40, measure_memory=False, remat="recompute")
    with rt:
        a = torch.randn(64, 64)
        v, i = torch.sort(a)
        v.add_(1)
        x = v + i
        del i  # freed: x's replay would regenerate it by replaying sort, remaking v too
        tr = rt.ex.guard.tracker
        assert tr.replay_plan(storage_key(x.untyped_storage())) is None
        y = v * 2  # reads only the live v: replayable
        assert tr.replay_plan(storage_key(y.untyped_storage())) is not None


def test_r3_a_dropped_storage_comes_back_before_its_source_is_overwritten():
    rt = Runtime(device="cpu", budget_bytes=1 << 40, measure_memory=False, remat="recompute")
    with rt:
        x = torch.randn(64, 64)
        y = x * 2
        want = y.clone()
        _drop(rt, y)
        x.add_(1)  # y must be regenerated from the old x first
        got = y + 0
    assert torch.equal(got, want)
    assert rt.report.iterations[0].cow_restores >= 1


def test_storages_whose_replays_read_each_other_are_never_both_dropped():
    """Batch norm writes running_mean and running_var in one op, so where they were created in the
    iteration (the one that builds the model) each one's chain reads the other. With one dropped,
    the other is swapped, never dropped (Note [Cycles of dropped storages]): both dropped, each
    replay would need the other back first."""
    rt = Runtime(device="cpu", budget_bytes=1 << 40, measure_memory=False, remat="recompute")
    with rt:
        x = torch.randn(8, 4, 5, 5)
        mean, var = torch.zeros(4), torch.ones(4)
        torch.nn.functional.batch_norm(x, mean, var, training=True)
        want = var.clone()
        g = rt.ex.guard
        km, kv = storage_key(mean.untyped_storage()), storage_key(var.untyped_storage())
        assert km in g.tracker.replay_plan(kv)[1], "var's replay reads mean"
        _drop(rt, mean)
        assert g.tracker.replay_plan(kv) is not None  # replayable, but not while mean is out
        assert g.drop_plan(kv) is None
        keep = {storage_key(t.untyped_storage()) for t in (x, want)}
        assert g.evict(1, keep) > 0  # var: the only candidate
        assert rt.ex.entries[kv].swap
        got = var + 0
    assert torch.equal(got, want)


def test_a_cycle_of_dropped_storages_raises_instead_of_recursing():
    """Dropped past the check above (by hand), the cycle is found at replay: a clear error."""
    rt = Runtime(device="cpu", budget_bytes=1 << 40, measure_memory=False, remat="recompute")
    with pytest.raises(RecomputeError, match="cycle of dropped storages"), rt:
        x = torch.randn(8, 4, 5, 5)
        mean, var = torch.zeros(4), torch.ones(4)
        torch.nn.functional.batch_norm(x, mean, var, training=True)
        _drop(rt, mean)
        _drop(rt, var)
        mean + 0


@pytest.mark.slow
def test_forced_replay_on_the_cnn_at_a_quarter_of_its_peak_is_exact():
    """The model-building iteration of the CNN drops batch norm's running statistics; at 25% of
    the peak both were dropped and the replays recursed until the stack ran out."""
    rt = Runtime(
        device="cpu", budget_bytes=peak("cnn") // 4, measure_memory=False, remat="recompute"
    )
    assert train_mismatches("cnn", rt, STEPS5) == []
    assert sum(s.dynamic_drops for s in complete(rt)) > 0


def test_restoring_a_stale_entry_leaves_the_storage_s_new_one_alone():
    """A storage brought back and evicted again has a new entry; the step end's restore pass
    works from a list taken before, so it can meet the old entry after the new one was made.
    Restoring the old entry is a no-op: before, it removed the new entry and left the storage
    empty and untracked (the transformer at 25% of its peak with ``remat="recompute"``: wrong
    gradients, caught by ``CAPUCHIN_VERIFY=1``)."""
    rt = Runtime(device="cpu", budget_bytes=1 << 40, measure_memory=False)
    with rt:
        x = torch.randn(64, 64)
        y = x * 2
        want = y.clone()
        g, ex = rt.ex.guard, rt.ex
        st = y.untyped_storage()
        key = storage_key(st)
        g._swap(key, st, st.nbytes())
        old = ex.entries[key]
        ex.restore(old)
        g._swap(key, st, st.nbytes())
        new = ex.entries[key]
        ex.restore(old)  # stale
        assert ex.entries.get(key) is new
        assert st.nbytes() == 0
        got = y + 0
    assert torch.equal(got, want)


@pytest.mark.slow
def test_forced_replay_on_the_transformer_at_a_fifth_of_its_peak_is_exact(monkeypatch):
    """At 20% the step end's restores make room by evicting again: a stale entry met later in
    the same pass (above), and storages dropped then outlive the iteration, so their replay in
    the next one needs their own records and copy-on-write registration
    (``DynamicGuard.new_iteration``; it raised ``RecomputeError``: op not recorded). Every
    storage that comes back is checked against a copy (``CAPUCHIN_VERIFY=1``)."""
    monkeypatch.setenv("CAPUCHIN_VERIFY", "1")
    rt = Runtime(
        device="cpu", budget_bytes=peak("transformer") // 5, measure_memory=False, remat="recompute"
    )
    assert train_mismatches("transformer", rt, STEPS5) == []
    assert sum(s.dynamic_drops for s in complete(rt)) > 0


def test_an_iteration_records_only_after_one_that_dropped(monkeypatch):
    """Note [Recording only while replay pays]: with ``remat="auto"`` the first two iterations
    record; a later one records only if the one before dropped a storage (or every
    PROBE_EVERY-th); recording or not, training is bitwise plain training's. Costs are fixed so
    that the CNN drops nothing: every op takes 1 ms on a ticking clock and swaps cost what the
    bandwidth says (their measured times are not fitted), so a swap is always cheaper."""
    from capuchin.runtime.guards import dtr as dynamic

    monkeypatch.setattr(dynamic, "seconds", ticking_clock(1e-3))
    monkeypatch.setattr(dynamic._CopyTime, "add", lambda self, n, dt: None)

    calls: dict[int, int] = {}
    real = dynamic.DynamicTracker.recorded

    def counting(self, pending, dt, outs, in_keys):
        calls[rt.ex.ix.iteration] = calls.get(rt.ex.ix.iteration, 0) + 1
        return real(self, pending, dt, outs, in_keys)

    monkeypatch.setattr(dynamic.DynamicTracker, "recorded", counting)
    monkeypatch.setattr(dynamic, "PROBE_EVERY", 4)
    monkeypatch.setattr(dynamic, "RECORD_OP_S", 0.0)  # any drop pays for recording
    rt = Runtime(device="cpu", budget_bytes=peak("cnn") // 2, measure_memory=False)
    assert train_mismatches("cnn", rt, ("--steps", "6")) == []
    its = {s.iteration: s for s in rt.report.iterations}
    assert calls.get(0) and calls.get(1)
    for i in range(2, 6):
        expect = its[i - 1].dynamic_drops > 0 or i % 4 == 0
        assert bool(calls.get(i)) == expect, (i, calls, [its[j].dynamic_drops for j in its])
    assert not all(calls.get(i) for i in range(2, 6)), "the CNN drops nothing: some skip"


def ticking_clock(step_s: float):
    """A clock that advances ``step_s`` at each reading: every op, copy and replay dynamic mode
    times lasts one step, whatever the machine is doing."""
    now = [0.0]

    def seconds() -> float:
        now[0] += step_s
        return now[0]

    return seconds


def test_drops_that_save_less_than_recording_costs_stop_the_recording(monkeypatch):
    """Note [Recording only while replay pays]: the transformer at 80% drops a few storages in
    its first step, saving less than its recording costs: later iterations record only to probe,
    and swap; training stays bitwise. Costs come from a ticking clock (every op, copy and replay
    takes 0.1 ms), so a replay is cheaper than the swap's two copies and the first step drops,
    and each drop saves about 0.1 ms against 1 ms of recording per op."""
    from capuchin.runtime.guards import dtr as dynamic

    calls: dict[int, int] = {}
    real = dynamic.DynamicTracker.recorded

    def counting(self, pending, dt, outs, in_keys):
        calls[rt.ex.ix.iteration] = calls.get(rt.ex.ix.iteration, 0) + 1
        return real(self, pending, dt, outs, in_keys)

    monkeypatch.setattr(dynamic.DynamicTracker, "recorded", counting)
    monkeypatch.setattr(dynamic, "seconds", ticking_clock(1e-4))
    monkeypatch.setattr(dynamic, "PROBE_EVERY", 4)
    monkeypatch.setattr(dynamic, "RECORD_OP_S", 1e-3)
    rt = Runtime(device="cpu", budget_bytes=int(peak("transformer") * 0.8), measure_memory=False)
    assert train_mismatches("transformer", rt, ("--steps", "6")) == []
    its = {s.iteration: s for s in rt.report.iterations}
    assert its[1].dynamic_drops > 0, "the premise: the first step drops"
    assert [i for i in range(2, 6) if calls.get(i)] == [4], calls  # the probe alone


def test_probes_that_do_not_pay_come_twice_as_far_apart_each_time(monkeypatch):
    """Note [Recording only while replay pays]: with no drop ever paying for its recording,
    the iterations after the first two record only to probe, at PROBE_EVERY, then after twice
    the gap each time (here 2, 4, 8: iterations 2, 4, 8 of 10)."""
    from capuchin.runtime.guards import dtr as dynamic

    monkeypatch.setattr(dynamic, "PROBE_EVERY", 2)
    monkeypatch.setattr(dynamic, "RECORD_OP_S", 1.0)  # no drop pays
    rt = Runtime(device="cpu", budget_bytes=int(peak("mlp") * 0.8), measure_memory=False)
    recording = []
    real = dynamic.DynamicGuard.new_iteration

    def new_iteration(self):
        real(self)
        recording.append(self.recording)

    monkeypatch.setattr(dynamic.DynamicGuard, "new_iteration", new_iteration)
    assert train_mismatches("mlp", rt, ("--steps", "10")) == []
    assert [i for i, r in enumerate(recording) if r] == [0, 1, 2, 4, 8], recording


def test_a_swap_s_cost_is_fitted_as_fixed_plus_bytes_over_bandwidth():
    """Note [What a swap costs]: swaps of several sizes give the fixed part and the bandwidth;
    one swap that took far longer (preempted) moves the fit by a bounded factor."""
    from capuchin.runtime.guards.dtr import _CopyTime

    c = _CopyTime(12e9)
    assert c.fixed_s == 0.0 and c.s_per_byte == pytest.approx(1 / 12e9)
    for _ in range(100):
        for n in (4096, 1 << 16, 1 << 20, 1 << 22):
            c.add(n, 20e-6 + n / 5e9)
    assert c.fixed_s == pytest.approx(20e-6, rel=1e-3)
    assert c.s_per_byte == pytest.approx(1 / 5e9, rel=1e-3)
    before = c.predict(1 << 20)
    c.add(1 << 20, 1.0)
    assert c.predict(1 << 20) < 2 * before


def test_a_swap_s_fixed_cost_makes_one_large_victim_cheaper_than_many_small_ones():
    """h = C/(M*L) with C = fixed + bytes/bandwidth: where the fixed part dominates, one recent
    large storage goes before eight staler small ones (bytes only: the small ones, oldest
    first, as LRU)."""
    rt = Runtime(device="cpu", budget_bytes=1 << 40, measure_memory=False, remat="swap")
    with rt:
        g = rt.ex.guard
        small = [torch.ones(1024) * i for i in range(8)]  # 4 KiB each, made first
        large = torch.ones(1 << 18) * 2  # 1 MiB, made last
        for c in (g.copy_out, g.copy_in):
            c.fixed_s, c.s_per_byte = 1e-3, 1 / 10e9
        assert g.evict(8 * 4096, set()) == 1 << 20
        assert large.untyped_storage().nbytes() == 0
        assert all(t.untyped_storage().nbytes() == 4096 for t in small)
        want = [t.clone() for t in small] + [torch.full((1 << 18,), 2.0)]
        got = [t + 0 for t in (*small, large)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_an_output_s_allocation_is_its_first_access_when_nothing_records():
    """The rule under the test below, directly: with recording off (remat="swap"), a new
    output's staleness starts at its allocation, not at 0 (the stalest of all)."""
    rt = Runtime(device="cpu", budget_bytes=1 << 40, measure_memory=False, remat="swap")
    with rt:
        x = torch.randn(64, 64)
        for _ in range(5):
            x = x * 2
        tr = rt.ex.guard.tracker
        assert not rt.ex.guard.recording
        assert tr.last_access.get(storage_key(x.untyped_storage()), 0) == tr.clock


def test_a_storage_made_in_an_iteration_that_does_not_record_is_not_the_stalest():
    """The transformer at 80% swapping DTR's victims (no replay, no recording): a storage's
    first access is its allocation, so it evicts no more storages per step than LRU (25 to
    LRU's 19 when the outputs of an iteration that does not record had no access at all and
    went first); training bitwise."""
    budget = int(peak("transformer") * 0.8)
    per_step = {}
    for eviction, remat in (("dtr", "swap"), ("lru", "auto")):
        rt = Runtime(
            device="cpu", budget_bytes=budget, measure_memory=False, eviction=eviction, remat=remat
        )
        assert train_mismatches("transformer", rt, STEPS5) == []
        per_step[eviction] = [s.passive_evictions for s in complete(rt)[2:]]
    assert max(per_step["dtr"]) <= min(per_step["lru"]), per_step


# ---- a third-party model ---------------------------------------------------------------------


def _train_bert(steps: int, context=None) -> dict[str, torch.Tensor]:
    """testing.training.train_tiny_bert inside ``context``; every parameter, gradient, optimizer
    state and state_dict entry after ``steps``."""
    import contextlib

    with context or contextlib.nullcontext():
        model, opt = train_tiny_bert(steps)
    return state_of([opt], [("model", model)])


@pytest.mark.slow
def test_hugging_face_bert_at_half_its_peak_trains_bitwise_within_budget():
    pytest.importorskip("transformers")
    ref = _train_bert(5)
    probe = Runtime(device="cpu", budget_bytes=1 << 40, measure_memory=True)
    _train_bert(2, probe)
    full = max(s.peak_bytes for s in complete(probe))
    budget = full // 2
    rt = Runtime(device="cpu", budget_bytes=budget, measure_memory=True)
    got = _train_bert(5, rt)
    assert state_mismatches(ref, got) == []
    its = complete(rt)
    assert len(its) == 5
    assert all(s.passive_evictions > 0 for s in its)
    for s in its:
        assert s.passive_short_bytes == 0, s
        assert s.peak_bytes <= SLACK * budget, (s.iteration, s.peak_bytes, budget)


@pytest.mark.parametrize("eviction", ["dtr", "lru"])
def test_cli_run_with_only_a_budget_uses_dynamic_mode(tmp_path, eviction):
    import json

    from capuchin.cli import main
    from click.testing import CliRunner

    rep = tmp_path / "report.json"
    r = CliRunner().invoke(
        main,
        [
            "run",
            "--budget",
            "12MiB",
            "--no-measure",
            "--eviction",
            eviction,
            "--report",
            str(rep),
            str(TRACES / "mlp.py"),
            "--steps",
            "2",
        ],
    )
    assert r.exit_code == 0, r.output
    its = json.loads(rep.read_text())["iterations"]
    assert sum(i["passive_evictions"] for i in its) > 0
    dyn = sum(i["dynamic_drops"] + i["dynamic_swaps"] for i in its)
    assert (dyn > 0) if eviction == "dtr" else (dyn == 0)
