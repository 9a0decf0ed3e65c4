"""Bundled hardware profiles: one JSON file per device kind and system.

This folder is a package only so the JSON files ship as package data and can be
found next to the code; `costmodels.profile` reads and validates them.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

_root = files(__name__)

#: Folder that holds the bundled `<name>.json` profiles.
PROFILE_DIR: Path = _root if isinstance(_root, Path) else Path(str(_root))
