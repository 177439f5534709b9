"""The planning core: torch-free, below both the service and the workers.

A trace in, plans out. Everything here is pure Python over ``remat.client.trace.Trace`` (and, for graph
plans, the op graph a trace carries and a recorded graph profile), so the API server plans uploaded traces
and the CLI plans trace files without loading torch, and the workers plan what they profiled with the same
code.

Where each part lives::

    planners/        one module per algorithm; PLANNERS, the registry, and DEFAULT_PLANNER
    cost_models.py   the classic and the PyTorch-faithful peak of a plan (PytorchTables)
    recompute_time.py the one estimate of what a plan's recomputation costs in time
    nested.py        the nested planner: one more level of re-runs, its price, plan and time estimate
    plans.py         planner output -> the reported Plan; the Pareto frontier as budget plans
    graph_predict.py a recorded step on the op graph replayed for any dropped set (graph plans' peaks)
"""
