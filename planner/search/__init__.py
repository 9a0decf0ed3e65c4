"""The search layer: choices of strategies, meshes and pipeline configurations.

Every search returns decisions (`planner.search.decisions`); the plan builder
(`planner.plans.build`) derives and prices plans from them. `problem` tabulates one
mesh's choice problem for the solvers (`ilp`, `elimination`, `propagation`, run by
`solve`); `oplevel` searches mesh shapes, `joint` the pipeline space with `stages` (the
partition DP); `baselines`, `megatron` give the plans priced beside the result.
"""
