"""Fuzzing of the user entry points: a fixed corpus, the harness's own failure detection, and
hypothesis properties of the profile and plan readers.

The corpus (cases from tests/fuzz_cases.py, run by tests/fuzz_runner.py) runs every case
through `planner.cli.main` in a worker process under a timeout; any traceback, hang,
crash, exit code outside {0, 2, 3}, exit 2 without a one-line message naming the input, or
accepted bad input fails the test with the command that replays the case.
`python bench/fuzz.py --cases 2000` is the longer run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzz_cases
import fuzz_runner
from fuzz_cases import Case, generate
from fuzz_runner import Result, run_corpus

CORPUS_SEED = 20240611
CORPUS_SIZE = 10 * len(fuzz_cases.CLASSES)  # ten cases of every class


@pytest.fixture(scope="module")
def corpus() -> list[Result]:
    started = time.perf_counter()
    results = run_corpus(CORPUS_SEED, range(CORPUS_SIZE), timeout_s=30.0)
    elapsed = time.perf_counter() - started
    print(f"\n{fuzz_runner.format_table(results)}\n{len(results)} cases in {elapsed:.1f} s")
    return results


def test_corpus_has_no_tracebacks_hangs_or_wrong_answers(corpus: list[Result]) -> None:
    for known in fuzz_runner.failures(corpus):
        if fuzz_runner.known_issue(known):
            warnings.warn(fuzz_runner.describe(known, CORPUS_SEED), stacklevel=1)
    bad = fuzz_runner.new_failures(corpus)
    assert not bad, "\n".join(fuzz_runner.describe(r, CORPUS_SEED) for r in bad)


def test_corpus_covers_every_class_with_real_outcomes(corpus: list[Result]) -> None:
    """Each class ran; valid inputs plan; the bad-input classes are refused, not skipped."""
    table = fuzz_runner.summarize([r for r in corpus if not fuzz_runner.known_issue(r)])
    assert len(corpus) >= 200
    assert set(table) == set(fuzz_cases.CLASSES)
    for cls in ("onnx/valid", "profile/valid", "plan/valid"):
        assert table[cls]["ok"] == sum(table[cls].values()), cls
    for cls in ("onnx/cycle", "onnx/control-flow", "profile/nan", "profile/not-json",
                "plan/sha256", "plan/model-swap", "plan/not-json",
                # issue 18's held-out classes
                "cli/flags", "strategies/bounds", "onnx/contradiction", "names/escape",
                "run/inputs"):
        assert table[cls]["rejected"] == sum(table[cls].values()), cls
    assert table["onnx/external-data"]["rejected"] > 0
    assert table["onnx/external-data"]["ok"] > 0  # paths inside the folder still plan
    assert table["plan/tampered"]["rejected"] > 0 and table["plan/json-bounds"]["rejected"] > 0


def test_cases_are_deterministic_per_seed_and_index() -> None:
    for index in (0, 17, 35, 101):
        first, again = generate(7, index), generate(7, index)
        assert (first.files, first.argv, first.note) == (again.files, again.argv, again.note)
    notes = {generate(seed, 2).note for seed in range(8)}  # onnx/bitflip: seed-dependent
    assert len(notes) > 1


# --------------------------------------------------------------------------- the harness


def _fake_case(seed: int, index: int) -> Case:
    """A valid model case whose command the fake entry points below replace."""
    case = fuzz_cases.onnx_case(fuzz_cases.base_bytes("helper-mlp"), f"fake {index}")
    case.index, case.cls = index, "fake"
    return case


def _raises(argv: list[str]) -> int:
    raise RuntimeError("boom")


def _sleeps(argv: list[str]) -> int:
    time.sleep(60)
    return 0


def _sleeps_deaf(argv: list[str]) -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # like a hang inside C code
    time.sleep(60)
    return 0


def _dies(argv: list[str]) -> int:
    os._exit(9)


def _exits_1(argv: list[str]) -> int:
    return 1


def _two_lines(argv: list[str]) -> int:
    print("shardplan: error: model.onnx is bad\nshardplan: error: twice", file=sys.stderr)
    return 2


def _unnamed(argv: list[str]) -> int:
    print("shardplan: error: something is wrong", file=sys.stderr)
    return 2


def _prints_traceback(argv: list[str]) -> int:
    print("Traceback (most recent call last):\n  File x\nValueError", file=sys.stderr)
    return 0


@pytest.mark.parametrize(("entry", "outcome"), [
    (_raises, "traceback"), (_sleeps, "hang"), (_sleeps_deaf, "hang"), (_dies, "crash"),
    (_exits_1, "bad-exit"), (_two_lines, "bad-message"), (_unnamed, "bad-message"),
    (_prints_traceback, "traceback"),
])
def test_harness_reports_each_kind_of_failure(entry: Any, outcome: str) -> None:
    results = run_corpus(0, [0, 1], timeout_s=0.5, entry=entry, make=_fake_case, grace_s=1.0)
    assert [r.outcome for r in results] == [outcome, outcome]  # and the worker came back


def test_harness_flags_accepted_bad_input_and_refused_good_input(tmp_path: Path) -> None:
    bad = fuzz_cases.onnx_case(fuzz_cases.base_bytes("helper-mlp"), "bad", expect="reject")
    good = fuzz_cases.onnx_case(fuzz_cases.base_bytes("helper-mlp"), "good", expect="accept")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    from planner.cli import main

    assert fuzz_runner.execute(bad, tmp_path / "a", 30.0, main).outcome == "wrong"
    assert fuzz_runner.execute(good, tmp_path / "b", 30.0, _unnamed).outcome == "bad-message"
    assert fuzz_runner.execute(good, tmp_path / "b", 30.0, main).outcome == "ok"


# --------------------------------------------------------------------------- hypothesis

JSON_LEAVES = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=6)
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.too_slow])


def _replace_somewhere(data: Any, pick: int, value: Any) -> str:
    """Replace the `pick`-th (mod count) path of `data` by `value`; return the path."""
    paths = list(fuzz_cases.json_paths(data))
    path = paths[pick % len(paths)]
    fuzz_cases.set_path(data, path, value)
    return fuzz_cases.show_path(path)


@PROPERTY_SETTINGS
@given(pick=st.integers(0, 10_000), value=JSON_VALUES)
def test_profile_reader_refuses_or_returns_finite_figures(pick: int, value: Any) -> None:
    from costmodels.profile import load_profile
    from planner.errors import ProfileError

    data = json.loads((fuzz_cases.PROFILE_DIR / "a100-80g.json").read_text())
    path = _replace_somewhere(data, pick, value)
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / "profile.json"
        file.write_text(json.dumps(data, allow_nan=True))
        try:
            profile = load_profile(file)
        except ProfileError as exc:
            assert str(exc).startswith(str(file)), (path, exc)
            return
    figures = [profile.memory_bandwidth_Bps.value, profile.kernel_launch_s.value,
               *(c.value for c in profile.peak_flops.values()),
               *(level.bus_bandwidth_Bps for level in profile.levels),
               *(level.latency_s.value for level in profile.levels)]
    assert all(math.isfinite(float(f)) and float(f) > 0 for f in figures), path


@PROPERTY_SETTINGS
@given(pick=st.integers(0, 10_000), value=JSON_VALUES)
def test_plan_reader_refuses_or_exports(pick: int, value: Any) -> None:
    from planner.errors import PlanFileError, ShardplanError
    from planner.exports.dtensor import to_dtensor_placements
    from planner.exports.mindspore import to_mindspore_checkpoint
    from planner.plans.model import Plan

    data = json.loads(fuzz_cases.base_plan("seed-mlp", 2))
    path = _replace_somewhere(data, pick, value)
    try:
        plan = Plan.from_json(data, source="plan.json")
    except PlanFileError as exc:
        assert str(exc).startswith("plan.json: "), (path, exc)
        return
    try:
        to_dtensor_placements(plan)
        to_mindspore_checkpoint(plan)
    except ShardplanError:
        pass  # a refusal with exit 2 is an answer; any other exception fails the test
