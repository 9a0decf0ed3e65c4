"""`python -m planner.cli ...`: the same as `shardplan ...`."""

import sys

from planner.cli import main

sys.exit(main())
