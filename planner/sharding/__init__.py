"""Sharding core: device mesh, layouts, strategies, local programs and redistribution.

What each op type is (its labelling, work, local rewrite) lives one layer down, in the op
registry `planner.ops`.
"""
