"""`shardplan profiles`: list the hardware profiles, or show one's JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from planner.cli.args import Verbs
from planner.errors import ProfileError, ShardplanError
from planner.userfiles import read_json


def add_parser(verbs: Verbs) -> None:
    profiles = verbs.add_parser("profiles", help="list or show the hardware profiles")
    profiles.add_argument("action", nargs="?", default="list", choices=["list", "show"])
    profiles.add_argument("name", nargs="?", help="profile to show")
    profiles.add_argument("--json", action="store_true",
                          help="list as JSON: [{name, description, path}, ...]")


def run(args: argparse.Namespace) -> int:
    from costmodels.profile import list_profiles, load_profile

    if args.action == "list" and args.json:
        listed = [load_profile(name) for name in list_profiles()]
        print(json.dumps([{"name": name, "description": profile.description,
                           "path": str(profile.path)}
                          for name, profile in zip(list_profiles(), listed, strict=True)],
                         indent=2))
        return 0
    if args.action == "list":
        for name in list_profiles():
            profile = load_profile(name)
            print(f"{name:<14} {profile.description}")
        return 0
    if not args.name:
        raise ShardplanError("profiles show: give a profile name, e.g. `profiles show a100-80g`")
    profile = load_profile(args.name)
    print(json.dumps(read_json(Path(profile.path), "profile", ProfileError), indent=2))
    return 0
