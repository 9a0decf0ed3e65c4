"""Plans in other frameworks' forms: MindSpore's strategy checkpoint, DTensor placements.

Readers of a plan: they import the plan model and the sharding core's layout
conversions (`planner.sharding.convert`), nothing of the search or the pricing.
"""
