"""`python -m planner.cli ...`: the same as `shardplan ...`."""

from planner.cli import console

console()
