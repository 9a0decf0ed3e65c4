"""Sharding core: device mesh, layouts, per-op rules, strategies and redistribution."""
