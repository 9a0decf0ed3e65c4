"""Searches over per-op strategies: each returns OpStrategy choices for `planner.assemble`."""
