"""The `shardplan` command line.

Exit codes: 0 ok, 2 bad input (a one-line message naming the cause), 3 no plan fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from planner.errors import NoPlanFits, ShardplanError

DEMO_PRESET = "gpt2-small"
DEMO_DIMS = {"seq": 1024}
DEMO_BATCH = 32


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line, like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _dim(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--dim {text!r}: expected NAME=VALUE, e.g. seq=2048")
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dim {text!r}: {value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"--dim {text!r}: a dim must be positive")
    return name, number


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardplan", description=__doc__.splitlines()[0] if __doc__ else "")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    plan = verbs.add_parser("plan", help="plan a training step of an ONNX model")
    plan.add_argument("model", nargs="?", help="the .onnx file (default: a bundled GPT-2 demo)")
    plan.add_argument("--profile", default="a100-80g",
                      help="hardware profile name or JSON file (see `shardplan profiles`)")
    plan.add_argument("--devices", type=_positive_int, default=8, help="number of devices")
    plan.add_argument("--batch", type=_positive_int, help="global batch size (binds dim 0)")
    plan.add_argument("--dim", type=_dim, action="append", default=[], metavar="NAME=N",
                      help="bind a symbolic input dim, e.g. --dim seq=2048 (repeatable)")
    plan.add_argument("--mode", default="data", choices=["data"], help="search mode")
    plan.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "momentum", "sgd"])
    plan.add_argument("--memory-limit", type=float, metavar="GIB",
                      help="device memory limit in GiB (default: the profile's capacity)")
    plan.add_argument("-o", "--output", help="write the strategy JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan JSON, not a summary")

    zoo = verbs.add_parser("zoo", help="write an ONNX graph of a standard model from a config")
    zoo.add_argument("family", help="gpt, bert, llama, resnet or moe, or a preset name")
    zoo.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    zoo.add_argument("--with-weights", action="store_true",
                     help="store random weights inline (small models only)")
    zoo.add_argument("--seed", type=int, default=0)

    profiles = verbs.add_parser("profiles", help="list or show the hardware profiles")
    profiles.add_argument("action", nargs="?", default="list", choices=["list", "show"])
    profiles.add_argument("name", nargs="?", help="profile to show")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.verb != "zoo":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.verb == "plan":
            return _plan(args)
        if args.verb == "zoo":
            return _zoo(args, extra)
        return _profiles(args)
    except ShardplanError as exc:
        print(f"shardplan: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("shardplan: interrupted", file=sys.stderr)
        return 130


def _plan(args: argparse.Namespace) -> int:
    from planner.api import plan
    from planner.report import memory_shortfall, summary

    dims = dict(args.dim)
    with tempfile.TemporaryDirectory(prefix="shardplan-demo-") as scratch:
        model = args.model
        batch = args.batch
        if model is None:
            model = _write_demo_model(Path(scratch))
            dims = {**DEMO_DIMS, **dims}
            batch = batch or DEMO_BATCH
            print(f"(no model given: planning the bundled {DEMO_PRESET} at batch {batch}, "
                  f"seq {dims['seq']})", file=sys.stderr)
        result = plan(model, profile=args.profile, devices=args.devices, batch=batch,
                      dims=dims, mode=args.mode, optimizer=args.optimizer,
                      memory_limit_gib=args.memory_limit)
    if args.output:
        result.save(args.output)
    print(result.dumps() if args.json else summary(result))
    if not result.predicted.fits:
        raise NoPlanFits(memory_shortfall(result))
    return 0


def _write_demo_model(folder: Path) -> Path:
    from planner import zoo

    family, config = zoo.preset(DEMO_PRESET)
    return zoo.save(zoo.build(family, config), folder / f"{DEMO_PRESET}.onnx")


def _zoo(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from planner import zoo

    if args.family in zoo.FAMILIES:
        family, config = args.family, zoo.FAMILIES[args.family]()
    else:
        try:
            family, config = zoo.preset(args.family)
        except (KeyError, ShardplanError):
            raise ShardplanError(
                f"unknown model family or preset {args.family!r}; families: "
                f"{', '.join(zoo.FAMILIES)}; presets: {', '.join(zoo.PRESETS)}"
            ) from None
    overrides = _config_overrides(family, config, extra)
    config = dataclasses.replace(config, **overrides)
    model = zoo.build(family, config, with_weights=args.with_weights, seed=args.seed)
    path = zoo.save(model, args.output)
    count = zoo.parameter_count(family, config)
    print(f"wrote {path} ({family}, {count / 1e6:,.1f} M parameters, "
          f"{path.stat().st_size / 1e6:.1f} MB)")
    return 0


def _config_overrides(family: str, config: object, extra: Sequence[str]) -> dict[str, object]:
    """Map `--layers 96 --hidden 12288` onto the family's config fields."""
    fields = {f.name: f for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    overrides: dict[str, object] = {}
    items = list(extra)
    while items:
        flag = items.pop(0)
        key, sep, value = flag.partition("=")
        name = key.removeprefix("--").replace("-", "_")
        if not key.startswith("--") or name not in fields:
            options = ", ".join("--" + f.replace("_", "-") for f in fields)
            raise ShardplanError(f"zoo {family}: unknown option {key!r}; options: {options}")
        if not sep:
            if not items:
                raise ShardplanError(f"zoo {family}: {key} needs a value")
            value = items.pop(0)
        overrides[name] = _convert(getattr(config, name), value, family, key)
    return overrides


def _convert(current: object, text: str, family: str, flag: str) -> object:
    try:
        if isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, tuple):
            return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ShardplanError(
            f"zoo {family}: {flag} {text!r} is not a valid {type(current).__name__}"
        ) from None
    return text


def _profiles(args: argparse.Namespace) -> int:
    from costmodels.profile import list_profiles, load_profile

    if args.action == "list":
        for name in list_profiles():
            profile = load_profile(name)
            print(f"{name:<14} {profile.description}")
        return 0
    if not args.name:
        raise ShardplanError("profiles show: give a profile name, e.g. `profiles show a100-80g`")
    profile = load_profile(args.name)
    print(json.dumps(json.loads(Path(profile.path).read_text()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
