"""`shardplan zoo`: write a standard model's ONNX graph; unknown flags set its config fields."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from planner.cli.args import Parser, Verbs, seed
from planner.errors import ShardplanError


class _ZooParser(Parser):
    """Writes its epilog when help is asked for: listing the presets imports the zoo (and
    onnx), which every other verb would otherwise pay for at start-up."""

    def format_help(self) -> str:
        self.epilog = _epilog()
        return super().format_help()


def add_parser(verbs: Verbs) -> None:
    zoo = verbs.add_parser("zoo", help="write an ONNX graph of a standard model from a config",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.__class__ = _ZooParser
    zoo.add_argument("family", help="gpt, bert, llama, resnet or moe, or a preset name")
    zoo.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    zoo.add_argument("--with-weights", action="store_true",
                     help="store random weights inline (small models only)")
    zoo.add_argument("--seed", type=seed, default=0)


def _epilog() -> str:
    """The presets and each family's config flags, for `shardplan zoo --help`."""
    from planner import zoo

    lines = ["presets: " + ", ".join(sorted(zoo.PRESETS)), "",
             "config flags (override a preset or the family's defaults):"]
    for family, cls in sorted(zoo.FAMILIES.items()):
        flags = " ".join(f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(cls))
        lines.append(f"  {family}: {flags}")
    lines += ["", "e.g. shardplan zoo gpt3-175b --dtype bfloat16 -o gpt3.onnx;",
              "     shardplan zoo llama --layers 4 --kv-heads 2 -o llama.onnx"]
    return "\n".join(lines)


def run(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """Build and save the model; `extra` holds the config flags argparse did not know."""
    from planner import zoo
    from planner.humanize import human_bytes, human_count

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
    print(f"wrote {path} ({family}, {human_count(count)} parameters, "
          f"{human_bytes(path.stat().st_size)})")
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
    """`text` as the type of the field's current value (None: a number, else the text)."""
    if current is None:  # an optional field (None = derived): a number, else the text
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                continue
        return text
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
