"""The `shardplan` command line.

Exit codes: 0 ok, 2 bad input (a one-line message naming the cause), 3 no plan fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

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


def _parallel(text: str) -> dict[str, int | str]:
    pins: dict[str, int | str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"--parallel {text!r}: expected KEY=VALUE,..., "
                                             "e.g. dp=4,tp=8")
        key = key.strip()
        if key in ("recompute", "schedule"):
            pins[key] = value.strip()
            continue
        try:
            pins[key] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--parallel {key}={value}: not an integer") from None
        if pins[key] < 0 or (pins[key] == 0 and key != "zero"):
            raise argparse.ArgumentTypeError(f"--parallel {key}={value}: must be positive")
    return pins


def _mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected sizes like 2x4") from None
    if not 1 <= len(shape) <= 3 or any(v < 1 for v in shape):
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: 1 to 3 positive sizes, like 2x4")
    return shape


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
    plan.add_argument("--mode", default="auto", choices=["data", "semi", "auto"],
                      help="data: data-parallel baseline; semi: ops in --strategies keep their "
                           "strategies, the rest is searched; auto: everything searched")
    plan.add_argument("--strategies", metavar="FILE",
                      help="JSON (or YAML) mapping op names or glob patterns to MindSpore-style "
                           "strategy tuples, e.g. {\"fc1\": [[1, 1], [1, 2]]}")
    plan.add_argument("--solver", default="auto",
                      choices=["auto", "cpsat", "highs", "dp", "propagation"],
                      help="auto: elimination DP when exact, else CP-SAT; cpsat/highs: exact ILP; "
                           "dp: graph elimination; propagation: heuristic")
    plan.add_argument("--time-limit", type=float, default=60.0, metavar="SECONDS",
                      help="per mesh shape; the best plan found so far is returned with its gap")
    plan.add_argument("--parallel", type=_parallel, default={}, metavar="dp=4,tp=8",
                      help="pin global choices and search the rest: dp, tp, pp, "
                           "micro_batches, zero (0-3), recompute (none|selective|full), "
                           "schedule (1f1b|gpipe|interleaved)")
    plan.add_argument("--mesh", type=_mesh, metavar="AxB", help="pin the mesh shape, e.g. 2x4")
    plan.add_argument("--max-mesh-axes", type=int, default=2, choices=[1, 2, 3],
                      help="largest number of mesh axes searched")
    plan.add_argument("--no-tie-layers", action="store_true",
                      help="let every repeated layer choose on its own (slower, rarely better)")
    plan.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "momentum", "sgd"])
    plan.add_argument("--memory-limit", type=float, metavar="GIB",
                      help="device memory limit in GiB (default: the profile's capacity)")
    plan.add_argument("--inference", action="store_true",
                      help="plan a forward pass only (no gradients, optimizer, saved activations)")
    plan.add_argument("--overlap", type=float, default=0.0, metavar="SHARE",
                      help="share (0..1) of gradient synchronisation hidden behind backward")
    plan.add_argument("-o", "--output", help="write the strategy JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan JSON, not a summary")

    zoo = verbs.add_parser("zoo", help="write an ONNX graph of a standard model from a config",
                           epilog=_zoo_epilog(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_argument("family", help="gpt, bert, llama, resnet or moe, or a preset name")
    zoo.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    zoo.add_argument("--with-weights", action="store_true",
                     help="store random weights inline (small models only)")
    zoo.add_argument("--seed", type=int, default=0)

    run = verbs.add_parser("run", help="train with a plan on local ranks (needs torch)")
    run.add_argument("model", help="the .onnx file the plan was made for")
    run.add_argument("--plan", required=True, help="a strategy JSON from `shardplan plan -o`")
    run.add_argument("--nproc", type=_positive_int, required=True,
                     help="ranks: the plan's device count, or 1 for the unsplit reference")
    run.add_argument("--steps", type=_positive_int, default=5)
    run.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--lr", type=float, default=0.1)
    run.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    run.add_argument("--log-json", metavar="FILE", help="write losses, times and collectives")
    run.add_argument("--checkpoint", metavar="DIR", default="",
                     help="save the sharded weights and optimizer state here at the end")
    run.add_argument("--checkpoint-every", metavar="N", type=_positive_int, default=None,
                     help="also save the checkpoint every N steps (atomically): a run killed "
                          "midway resumes from the last one with --resume")
    run.add_argument("--resume", metavar="DIR", default="",
                     help="start from a checkpoint saved by the same plan")
    run.add_argument("--loss", default="auto", choices=["auto", "graph", "ce", "mse"],
                     help="auto: the model's own scalar loss output if it has one, else "
                          "cross-entropy on the first output")
    run.add_argument("--data", metavar="DIR", default="",
                     help="<input>.npy arrays (and targets.npy) of the global batch; each "
                          "data-parallel rank reads its shard (default: synthetic)")

    export = verbs.add_parser("export", help="write a plan in another framework's format")
    export.add_argument("plan", help="a strategy JSON written by `shardplan plan -o`")
    export.add_argument("--format", required=True, choices=["mindspore", "dtensor"],
                        help="mindspore: strategy checkpoint JSON; dtensor: placements per "
                             "parameter")
    export.add_argument("-o", "--output", help="write here instead of standard output")

    calibrate = verbs.add_parser("calibrate", help="measure this machine and write a profile")
    from costmodels.calibrate import add_arguments

    add_arguments(calibrate)

    profiles = verbs.add_parser("profiles", help="list or show the hardware profiles")
    profiles.add_argument("action", nargs="?", default="list", choices=["list", "show"])
    profiles.add_argument("name", nargs="?", help="profile to show")
    profiles.add_argument("--json", action="store_true",
                          help="list as JSON: [{name, description, path}, ...]")

    explain = verbs.add_parser("explain", help="explain a plan: per layer, where the step "
                               "time goes, why it beat the others")
    explain.add_argument("plan", help="a strategy JSON written by `shardplan plan -o`")
    explain.add_argument("--json", action="store_true", help="print the explanation as JSON")
    explain.add_argument("--plot", metavar="DIR",
                         help="also draw PNG and SVG figures into DIR (needs matplotlib)")
    explain.add_argument("--top", type=_positive_int, default=5, metavar="N",
                         help="how many top ops and collectives to list (default 5)")

    compare = verbs.add_parser("compare", help="compare plans side by side")
    compare.add_argument("plans", nargs="+", metavar="PLAN",
                         help="two or more strategy JSON files")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")

    validate = verbs.add_parser("validate", help="check a plan: schema, mesh, pipeline, "
                                "collectives, and (given the model) ops, layouts, shapes")
    validate.add_argument("plan", metavar="PLAN", help="the strategy JSON")
    validate.add_argument("model", metavar="MODEL", nargs="?",
                          help="the ONNX model it was made for (imported at the plan's dims)")
    validate.add_argument("--json", action="store_true", help="print the findings as JSON")
    return parser


def _zoo_epilog() -> str:
    """The presets and each family's config flags, for `shardplan zoo --help`."""
    import dataclasses

    from planner import zoo

    lines = ["presets: " + ", ".join(sorted(zoo.PRESETS)), "",
             "config flags (override a preset or the family's defaults):"]
    for family, cls in sorted(zoo.FAMILIES.items()):
        flags = " ".join(f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(cls))
        lines.append(f"  {family}: {flags}")
    lines += ["", "e.g. shardplan zoo gpt3-175b --dtype bfloat16 -o gpt3.onnx;",
              "     shardplan zoo llama --layers 4 --kv-heads 2 -o llama.onnx"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:  # bad flags (and --help) end argparse with SystemExit: return its code instead
        args, extra = parser.parse_known_args(argv)
        if extra and args.verb != "zoo":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as done:
        return int(done.code or 0)
    try:
        if args.verb == "plan":
            return _plan(args)
        if args.verb == "zoo":
            return _zoo(args, extra)
        if args.verb == "export":
            return _export(args)
        if args.verb == "run":
            return _run(args)
        if args.verb == "calibrate":
            from costmodels.calibrate import run

            return run(args)
        if args.verb == "explain":
            return _explain(args)
        if args.verb == "compare":
            return _compare(args)
        if args.verb == "validate":
            return _validate(args)
        return _profiles(args)
    except ShardplanError as exc:
        print(f"shardplan: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("shardplan: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("shardplan: error: this machine ran out of memory planning the model; try "
              "fewer devices per search (--parallel pins, --mesh) or a smaller --max-mesh-axes",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # `shardplan ... | head`: the reader left; not an error
        _silence_stdout()
        return 0


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush
    does not raise again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


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
        strategies = _load_strategies(args.strategies) if args.strategies else None
        mode = args.mode
        progress = _Progress(sys.stderr) if not args.json else None
        try:
            result = plan(model, profile=args.profile, devices=args.devices, batch=batch,
                          dims=dims, mode=mode, strategies=strategies, solver=args.solver,
                          time_limit=args.time_limit, parallel=args.parallel, mesh=args.mesh,
                          max_mesh_axes=args.max_mesh_axes, tie_layers=not args.no_tie_layers,
                          optimizer=args.optimizer, memory_limit_gib=args.memory_limit,
                          inference=args.inference, overlap=args.overlap, progress=progress)
        finally:
            if progress is not None:
                progress.close()
    if args.output:
        result.save(args.output)
    print(result.dumps() if args.json else summary(result))
    if not result.predicted.fits:
        raise NoPlanFits(memory_shortfall(result))
    return 0


class _Progress:
    """Search progress on stderr, but only for a plan that takes more than a second.

    Messages of the first second are held back (a quick plan prints none); after that they
    are printed as they come, with the elapsed time. On a terminal a spinner line shows the
    time and the last message while the search is silent; it is erased at the end.
    """

    DELAY_S = 1.0
    FRAMES = "|/-\\"

    def __init__(self, stream: TextIO, delay_s: float = DELAY_S) -> None:
        self.stream, self.delay_s = stream, delay_s
        self.started = time.perf_counter()
        self.held: list[tuple[float, str]] = []
        self.last = "planning"
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.spinning = False
        self.thread: threading.Thread | None = None
        if _is_tty(stream):
            self.thread = threading.Thread(target=self._spin, daemon=True)
            self.thread.start()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.started
        with self.lock:
            self.last = message
            if elapsed < self.delay_s:
                self.held.append((elapsed, message))
                return
            self._flush()
            self._line(elapsed, message)

    def _flush(self) -> None:
        for elapsed, message in self.held:
            self._line(elapsed, message)
        self.held.clear()

    def _line(self, elapsed: float, message: str) -> None:
        prefix = "\r\033[K" if self.spinning else ""
        self.stream.write(f"{prefix}  [{elapsed:6.1f} s] {message}\n")
        self.stream.flush()

    def _spin(self) -> None:
        if self.done.wait(self.delay_s):
            return
        frame = 0
        while not self.done.is_set():
            with self.lock:
                self._flush()
                self.spinning = True
                elapsed = time.perf_counter() - self.started
                text = f"{self.FRAMES[frame % len(self.FRAMES)]} {elapsed:6.1f} s  {self.last}"
                self.stream.write("\r\033[K" + text[:100])
                self.stream.flush()
            frame += 1
            self.done.wait(0.2)

    def close(self) -> None:
        """Stop the spinner and erase its line; held messages of a quick plan are dropped."""
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        with self.lock:
            if self.spinning:
                self.stream.write("\r\033[K")
                self.stream.flush()
            self.held.clear()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _load_strategies(path: str) -> dict[str, list[list[int]]]:
    """`{"op name or glob": [[1, 1], [1, 2]], ...}` from JSON, or YAML when PyYAML is there."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ShardplanError(f"{file}: cannot read the strategies file ({exc.strerror})") from None
    if file.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ShardplanError(f"{file}: reading YAML needs PyYAML (pip install pyyaml); "
                                 "or write the strategies as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ShardplanError(f"{file}: not valid YAML ({exc})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ShardplanError(f"{file}: not valid JSON (line {exc.lineno}, column "
                                 f"{exc.colno}: {exc.msg})") from None
    if isinstance(data, dict) and "strategies" in data and isinstance(data["strategies"], dict):
        data = data["strategies"]
    if not isinstance(data, dict) or not data:
        raise ShardplanError(f"{file}: expected an object mapping op names to strategy tuples")
    for name, tuples in data.items():
        if not (isinstance(tuples, list) and all(isinstance(t, list) and t and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in t)
                for t in tuples)):
            raise ShardplanError(f"{file}: strategy of {name!r} must be a list of lists of "
                                 f"positive integers, like [[1, 1], [1, 2]]; got {tuples!r}")
    return data


def _write_demo_model(folder: Path) -> Path:
    from planner import zoo

    family, config = zoo.preset(DEMO_PRESET)
    return zoo.save(zoo.build(family, config), folder / f"{DEMO_PRESET}.onnx")


def _zoo(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from planner import zoo
    from planner.report import human_bytes, human_count

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


def _run(args: argparse.Namespace) -> int:
    from planner.plan.model import Plan

    try:
        from executor.train import planned_counts, train, train_reference
    except ImportError:
        raise ShardplanError("shardplan run needs torch: pip install 'shardplan[executor]'"
                             ) from None
    if args.backend == "nccl":
        raise ShardplanError("--backend nccl: this executor runs gloo ranks on CPU only so far")
    loaded = Plan.load(args.plan)
    if args.nproc not in (1, loaded.mesh.size):
        raise ShardplanError(f"--nproc {args.nproc}: the plan is for {loaded.mesh.size} "
                             "devices; use that many ranks, or 1 for the unsplit reference")
    if args.checkpoint_every and not args.checkpoint:
        raise ShardplanError("--checkpoint-every needs --checkpoint DIR: where to save")
    if args.nproc == 1 and (args.checkpoint or args.resume):
        raise ShardplanError("--checkpoint/--resume apply to runs of the plan (--nproc > 1)")
    if args.nproc > 1:
        log = train(args.model, loaded, steps=args.steps, lr=args.lr, seed=args.seed,
                    optimizer=args.optimizer, resume=args.resume, checkpoint=args.checkpoint,
                    loss=args.loss, data=args.data, checkpoint_every=args.checkpoint_every or 0)
    else:
        log = train_reference(args.model, loaded, steps=args.steps, lr=args.lr,
                              seed=args.seed, optimizer=args.optimizer, loss=args.loss,
                              data=args.data)
    issued = {k: v for k, v in log.collectives.get("issued", {}).items()
              if not k.endswith("|loss")}
    planned = planned_counts(loaded, args.steps) if args.nproc > 1 else {}
    log.collectives = {"planned": planned, "issued": issued}
    for step, (loss, seconds) in enumerate(zip(log.losses, log.step_time_s, strict=True)):
        print(f"step {step + 1}: loss {loss:.6f}  {seconds * 1e3:.1f} ms")
    print(f"predicted step time {log.predicted_step_time_s * 1e3:.3f} ms on "
          f"{loaded.cluster.profile}")
    if args.nproc > 1:
        diff = sorted(set(planned) | set(issued))
        mismatched = [k for k in diff if planned.get(k, 0) != issued.get(k, 0)]
        print("collectives: as planned" if not mismatched else
              "collectives differ from the plan: " + ", ".join(
                  f"{k} planned {planned.get(k, 0)} issued {issued.get(k, 0)}"
                  for k in mismatched))
    if args.log_json:
        Path(args.log_json).write_text(json.dumps(log.to_json(), indent=1) + "\n")
    return 0


def _export(args: argparse.Namespace) -> int:
    from planner.plan.model import Plan
    from planner.exports.dtensor import to_dtensor_placements
    from planner.exports.mindspore import to_mindspore_checkpoint

    loaded = Plan.load(args.plan)
    data = (to_mindspore_checkpoint(loaded) if args.format == "mindspore"
            else to_dtensor_placements(loaded))
    text = json.dumps(data, indent=1, sort_keys=True)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


def _profiles(args: argparse.Namespace) -> int:
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
    print(json.dumps(json.loads(Path(profile.path).read_text()), indent=2))
    return 0


def _explain(args: argparse.Namespace) -> int:
    from planner.explain import explain, render
    from planner.plan.model import Plan

    loaded = Plan.load(args.plan)
    result = explain(loaded, source=args.plan, top=args.top)
    written: list[Path] = []
    if args.plot:
        from planner.plots import write_plots

        written = write_plots(loaded, result, args.plot, Path(args.plan).stem)
    if args.json:
        data = result.to_json()
        data["plots"] = [str(path) for path in written]
        print(json.dumps(data, indent=1))
    else:
        print(render(result))
        if written:
            print("\nplots: " + ", ".join(str(p) for p in written if p.suffix == ".png")
                  + " (and .svg)")
    return 0


def _validate(args: argparse.Namespace) -> int:
    """Exit 0 when the plan is valid, 2 with every problem listed otherwise."""
    from planner.api import load_graph
    from planner.plan.model import Plan
    from planner.validate import validate

    loaded = Plan.load(args.plan)
    graph = None
    if args.model:
        graph = load_graph(args.model, batch=loaded.model.batch,
                           dims=loaded.model.bound_dims)
    report = validate(loaded, graph)
    if args.json:
        print(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        checked = ", ".join(f"{n} {what}" for what, n in report.checked.items())
        against = f" against {args.model}" if args.model else ""
        if report.ok:
            print(f"{args.plan}: valid{against} ({checked} checked)")
        for problem in report.problems:
            print(f"{args.plan}: {problem}", file=sys.stderr)
    return 0 if report.ok else 2


def _compare(args: argparse.Namespace) -> int:
    from planner.explain import compare_rows, render_compare
    from planner.plan.model import Plan

    if len(args.plans) < 2:
        raise ShardplanError("compare: give two or more plan files, e.g. "
                             "`shardplan compare a.json b.json`")
    data = compare_rows([(path, Plan.load(path)) for path in args.plans])
    print(json.dumps(data, indent=1) if args.json else render_compare(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
