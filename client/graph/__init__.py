"""The stage-graph family: a model the caller holds → its stage chain, op graph and plan key.

One subsystem, several modules cut by concern (each module's docstring says what it owns)::

    fx_trace.py      the tracer (StochasticDepth a leaf), trace_model, the train/eval mode context
    mask_skips.py    transformers' attention masks built or left out per call, as its eager forward does
    write_probe.py   the recording probe run (in-place and buffer writes), ProbeFacts, preserved_state
    boundaries.py    cut vertices over tensor edges, in-place safety of boundaries, the brute-force reference
    stage_chain.py   StageChain: segments under non-reentrant checkpoint with BN-safe recompute and RNG replay
    stage_graph.py   build_stage_chain: the chain cut at safe articulation nodes
    op_graph.py      build_op_graph: every tensor a vertex, for graph plans; OpGraph.run
    hashing.py       the architecture hash (graph, module configs, parameter shapes; never weights)
    export_cache.py  exported graphs on disk (JSON, no pickle) under a pre-key computed without tracing
    size_guards.py   what an export for any sizes assumed about sizes, as data: asked before a call at new sizes

Every module here needs torch; ``import remat.client`` does not load this package.
"""
