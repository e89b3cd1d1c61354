"""The planner: from one traced iteration to a swap/recompute plan. Never imports torch.

problem.py    Problem: ops and storages of one steady iteration, baseline memory curve
simulator.py  simulate(problem, decisions) -> SimResult: the one judge of every plan
lineage.py    replay chains and sources for recomputation (resolve_recompute)
swapping.py   copy channels, free time, in-trigger search (for policies)
gaps.py       AccessGap: a storage between two accesses, what every policy decides about
msps.py       Algorithm 2: recompute candidates by MSPS with the iterative update
registry.py   @register("name"), get_policy(name), the Policy protocol and PolicyResult
policies/     one module per policy (capuchin, swap, recompute, and the comparison ones)
build.py      build_plan(problem, decisions, ...) -> (Plan, SimResult)
plan.py       the plan format (Plan, Decision, Action; to_json/from_json)
api.py        make_plan(trace, budget=..., policy=...), plan_file (the CLI's)
budget.py     "8G", "8GB", "60%" -> bytes
report.py     summaries, show_plan, memory plot, Chrome trace
"""
