"""Hardware profiles: the bundled files, their citations, the topology rules, and the loader's
refusal of every kind of malformed file with a message that names the file and the field."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from costmodels.profile import (
    COLLECTIVES,
    DTYPES,
    FABRICS,
    Cited,
    HardwareProfile,
    LinkLevel,
    list_profiles,
    load_profile,
)
from hardware_profiles import PROFILE_DIR
from planner.errors import ProfileError, ShardplanError

REPO = Path(__file__).resolve().parents[1]
BUNDLED = ["a100-40g", "a100-80g", "ascend-910a", "ascend-910b", "cpu", "h100-sxm", "h200-sxm"]
GIB = 2**30


def cited_values(profile: HardwareProfile) -> Iterator[tuple[str, Cited]]:
    """Every cited number of a profile with its field path."""
    for field in ("memory_bytes", "memory_bandwidth_Bps", "matmul_efficiency",
                  "memory_efficiency", "kernel_launch_s", "devices_per_node"):
        yield field, getattr(profile, field)
    for dtype, cited in profile.peak_flops.items():
        yield f"peak_flops.{dtype}", cited
    if profile.allowed_devices_within_node is not None:
        yield "allowed_devices_within_node", profile.allowed_devices_within_node
    ramp = profile.matmul_overhead_s
    if isinstance(ramp, Cited):
        yield "matmul_overhead_s", ramp
    for dtype, cited in (ramp.items() if isinstance(ramp, dict) else ()):
        yield f"matmul_overhead_s.{dtype}", cited
    for field in ("compute_units", "gemm_tile", "attention_kernel", "fusion", "compute_overlap"):
        if getattr(profile, field) is not None:
            yield field, getattr(profile, field)
    for level in profile.levels:
        for field in ("bandwidth_Bps", "efficiency", "latency_s"):
            yield f"{level.name}.{field}", getattr(level, field)
        if level.fabric is not None:
            yield f"{level.name}.fabric", level.fabric
        for kind, cited in level.collective_factors.items():
            yield f"{level.name}.collective_factors.{kind}", cited


# -- the bundled profiles ------------------------------------------------------------------


def test_list_profiles_names_every_bundled_file_sorted() -> None:
    assert list_profiles() == BUNDLED


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_profile_loads_and_matches_its_file(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name
    assert Path(profile.path) == PROFILE_DIR / f"{name}.json"
    assert profile.description.strip()
    assert set(profile.peak_flops) <= set(DTYPES)


@pytest.mark.parametrize("name", BUNDLED)
def test_every_number_cites_a_real_source(name: str) -> None:
    profile = load_profile(name)
    used, notes = set(), []
    for field, cited in cited_values(profile):
        assert cited.source in profile.sources, field
        assert profile.sources[cited.source].strip(), field
        if cited.source == "derived":
            assert cited.note.strip(), f"{field}: a derived value must explain its arithmetic"
        used.add(cited.source)
        notes.append(cited.note)
    # a citation backs a number directly, or is named in the note of a derived one
    unused = {key for key in profile.sources if key not in used
              and not any(key in note for note in notes)}
    assert not unused, f"citations that back no number: {sorted(unused)}"


@pytest.mark.parametrize("name", BUNDLED)
def test_links_get_slower_and_no_faster_to_reach_going_outward(name: str) -> None:
    levels = load_profile(name).levels
    for inner, outer in pairwise(levels):
        assert inner.bus_bandwidth_Bps >= outer.bus_bandwidth_Bps
        assert float(inner.latency_s.value) <= float(outer.latency_s.value)


def test_a100_matches_the_datasheet() -> None:
    a100 = load_profile("a100-80g")
    assert a100.peak("bf16") == 312e12
    assert a100.peak("fp16") == 312e12
    assert a100.peak("tf32") == 156e12
    assert a100.peak("fp32") == 19.5e12
    assert a100.memory_bandwidth_Bps.value == 2.039e12
    assert a100.memory_bytes.value == 80 * GIB
    small = load_profile("a100-40g")
    assert small.memory_bandwidth_Bps.value == 1.555e12
    assert small.memory_bytes.value == 40 * GIB
    assert small.peak_flops == a100.peak_flops


def test_a100_has_no_fp8_and_says_what_it_has() -> None:
    with pytest.raises(ProfileError, match=r"a100-80g has no fp8 peak: .*fp32, tf32, bf16, fp16"):
        load_profile("a100-80g").peak("fp8")


def test_hopper_matches_the_datasheets_dense_figures() -> None:
    h100, h200 = load_profile("h100-sxm"), load_profile("h200-sxm")
    assert h100.memory_bandwidth_Bps.value == 3.35e12
    assert h200.memory_bandwidth_Bps.value == 4.8e12
    assert h200.memory_bytes.value == 141 * GIB
    for gpu in (h100, h200):
        assert gpu.peak("bf16") == pytest.approx(989.4e12)  # dense: the datasheet's 1979 / 2
        assert gpu.peak("fp8") == pytest.approx(1978.9e12)
        assert gpu.levels[0].bandwidth_Bps.value == 450e9  # 900 GB/s both ways


def test_ascend_910b_models_the_64_gb_24_core_part() -> None:
    npu = load_profile("ascend-910b")
    assert 60e9 < npu.memory_bytes.value <= 64 * GIB
    assert npu.peak("fp16") == pytest.approx(24 * 16**3 * 2 * 1.8e9, rel=1e-3)
    assert [level.group_size for level in npu.levels] == [8, None]
    assert [level.fabric_kind for level in npu.levels] == ["full_mesh", "switch"]
    assert npu.levels[0].fabric is not None
    assert npu.levels[0].fabric.source == "arthurchiao-910b"


def test_ascend_910b_fp32_peak_gives_the_measured_rate_back() -> None:
    npu = load_profile("ascend-910b")
    fp32 = npu.peak_flops["fp32"]
    assert fp32.source == "derived" and "zzc0721-910b2" in fp32.note
    assert npu.peak("fp32") * float(npu.matmul_efficiency.value) == pytest.approx(
        84.53e12, rel=1e-3)


def test_ascend_910a_is_two_hccs_rings_joined_by_pcie() -> None:
    npu = load_profile("ascend-910a")
    assert [(lv.name, lv.group_size) for lv in npu.levels] == [
        ("hccs", 4), ("pcie", 8), ("roce", None)]
    assert npu.allowed_devices_within_node is not None
    assert npu.allowed_devices_within_node.value == (1, 2, 4, 8)
    assert npu.peak("fp16") == 256e12
    with pytest.raises(ProfileError, match="ascend-910a has no fp32 peak: it supports fp16"):
        npu.peak("fp32")
    assert [lv.fabric_kind for lv in npu.levels] == ["full_mesh", "switch", "switch"]
    assert npu.levels[0].fabric is not None
    assert npu.levels[0].fabric.source == "hiascend-affinity"


@pytest.mark.parametrize("name", BUNDLED)
def test_optional_fields_default_where_a_profile_leaves_them_out(name: str) -> None:
    profile = load_profile(name)
    assert profile.matmul_overhead_s is None  # no bundled accelerator has a measured ramp
    for level in profile.levels:
        assert level.fabric_kind in FABRICS
        assert level.collective_factors == {}
        assert level.collective_factor("all_gather") == 1.0
        if not name.startswith("ascend"):
            assert level.fabric is None and level.fabric_kind == "switch"


def test_cpu_profile_is_this_two_core_machine() -> None:
    cpu = load_profile("cpu")
    assert cpu.devices_per_node.value == 2
    assert [lv.group_size for lv in cpu.levels] == [2, None]
    assert cpu.levels[0].bus_bandwidth_Bps < 2e9  # gloo loopback, not a real fabric
    assert "measured-2026-11-29" in cpu.sources


def test_unknown_dtype_lists_the_known_ones() -> None:
    with pytest.raises(ProfileError, match=r"unknown dtype 'fp64': use one of fp32, tf32"):
        load_profile("h100-sxm").peak("fp64")


# -- topology questions --------------------------------------------------------------------


@pytest.mark.parametrize(("name", "devices", "nodes"), [
    ("ascend-910a", 1, 1), ("ascend-910a", 2, 1), ("ascend-910a", 4, 1), ("ascend-910a", 8, 1),
    ("ascend-910a", 16, 2), ("a100-80g", 6, 1), ("a100-80g", 7, 1), ("a100-80g", 8, 1),
    ("a100-80g", 16, 2), ("a100-80g", 64, 8), ("cpu", 2, 1), ("cpu", 4, 2),
])
def test_check_device_count_accepts_formable_counts(name: str, devices: int, nodes: int) -> None:
    assert load_profile(name).check_device_count(devices) == nodes


@pytest.mark.parametrize(("name", "devices"), [
    ("ascend-910a", 3), ("ascend-910a", 5), ("ascend-910a", 12), ("ascend-910a", 0),
    ("a100-80g", 12), ("a100-80g", 0), ("a100-80g", -8), ("cpu", 3),
])
def test_check_device_count_refuses_other_counts(name: str, devices: int) -> None:
    with pytest.raises(ProfileError, match=f"{name} cannot form {devices} devices"):
        load_profile(name).check_device_count(devices)


def test_check_device_count_message_says_what_to_use() -> None:
    with pytest.raises(ProfileError) as err:
        load_profile("ascend-910a").check_device_count(3)
    assert str(err.value) == ("ascend-910a cannot form 3 devices: use 1, 2, 4 or 8 devices "
                              "inside a node, or a multiple of 8 (whole nodes)")
    with pytest.raises(ProfileError) as err:
        load_profile("a100-80g").check_device_count(12)
    assert str(err.value) == ("a100-80g cannot form 12 devices: use 1 to 8 devices inside a "
                              "node, or a multiple of 8 (whole nodes)")


def test_check_device_count_refuses_non_integers() -> None:
    for bad in (True, 2.0, "8"):
        with pytest.raises(ProfileError):
            load_profile("a100-80g").check_device_count(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "span", "level"), [
    ("ascend-910a", 1, "hccs"), ("ascend-910a", 2, "hccs"), ("ascend-910a", 4, "hccs"),
    ("ascend-910a", 5, "pcie"), ("ascend-910a", 8, "pcie"), ("ascend-910a", 9, "roce"),
    ("ascend-910a", 64, "roce"), ("a100-80g", 2, "nvswitch"), ("a100-80g", 8, "nvswitch"),
    ("a100-80g", 16, "infiniband-hdr"), ("ascend-910b", 8, "hccs"), ("ascend-910b", 16, "roce"),
    ("cpu", 2, "gloo-loopback"), ("cpu", 4, "ethernet-10g"),
])
def test_level_for_group_picks_the_innermost_level_that_holds_the_span(
        name: str, span: int, level: str) -> None:
    assert load_profile(name).level_for_group(span).name == level


def test_level_for_group_refuses_empty_groups() -> None:
    with pytest.raises(ProfileError, match="at least 1 device"):
        load_profile("a100-80g").level_for_group(0)


def test_bus_bandwidth_is_line_rate_times_efficiency() -> None:
    level = load_profile("a100-80g").levels[0]
    assert level.bus_bandwidth_Bps == pytest.approx(300e9 * 0.78)
    assert load_profile("h100-sxm").inter_node_level.group_size is None


def test_profile_objects_are_frozen_and_hashable() -> None:
    profile = load_profile("h100-sxm")
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.levels[0].name = "other"  # type: ignore[misc]
    assert isinstance(profile.levels[0], LinkLevel)
    assert len({profile, load_profile("h100-sxm")}) == 1
    meshed = load_profile("ascend-910b").levels[0]
    factored = dataclasses.replace(meshed, collective_factors={"all_gather": Cited(0.5, "x")})
    assert len({meshed, factored, load_profile("ascend-910b").levels[0]}) == 2


def test_profile_module_imports_nothing_heavy() -> None:
    code = ("import sys, costmodels.profile; "
            "print(sorted(m for m in ('torch', 'numpy', 'onnx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- loading by name or path ---------------------------------------------------------------


def test_load_by_path_str_and_pathlike(tmp_path: Path) -> None:
    copy = tmp_path / "mine.json"
    copy.write_text((PROFILE_DIR / "a100-80g.json").read_text(encoding="utf-8"),
                    encoding="utf-8")
    for ref in (copy, str(copy)):
        profile = load_profile(ref)
        assert profile.path == str(copy)
        assert profile.peak_flops == load_profile("a100-80g").peak_flops


def test_unknown_name_lists_the_bundled_profiles() -> None:
    with pytest.raises(ProfileError, match=r"unknown hardware profile 'tpu-v9': bundled "
                                           r"profiles are a100-40g, a100-80g, .*h200-sxm"):
        load_profile("tpu-v9")


def test_profile_error_is_a_user_error_with_exit_code_2() -> None:
    assert issubclass(ProfileError, ShardplanError)
    assert ProfileError.exit_code == 2


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ProfileError, match=f"{path}: no such profile file"):
        load_profile(path)


def test_unreadable_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=f"{tmp_path}: cannot read the profile file"):
        load_profile(str(tmp_path) + "/")


def test_invalid_json_gives_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "schema": "shardplan.hardware-profile/1",\n  "name": }\n')
    with pytest.raises(ProfileError,
                       match=re.escape(f"{path}: not valid JSON (line 3, column 11: ")):
        load_profile(path)


def test_non_utf8_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(ProfileError, match=f"{path}: not UTF-8"):
        load_profile(path)


# -- the optional fields --------------------------------------------------------------------


def _load_changed(tmp_path: Path, base: str, *changes: Mutation) -> HardwareProfile:
    data = json.loads((PROFILE_DIR / f"{base}.json").read_text(encoding="utf-8"))
    for change in changes:
        change(data)
    path = tmp_path / f"{base}-changed.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return load_profile(path)


def test_matmul_overhead_loads_as_one_value_or_per_dtype(tmp_path: Path) -> None:
    single = _load_changed(tmp_path, "a100-80g", _set(
        "device", "matmul_overhead_s", value={"value": 6e-6, "source": "dgx-a100"}))
    assert single.matmul_overhead_s == Cited(6e-6, "dgx-a100", "")
    assert single.matmul_overhead("bf16") == single.matmul_overhead("fp32") == 6e-6
    per_dtype = _load_changed(tmp_path, "cpu", _set("device", "matmul_overhead_s", value={
        "fp32": {"value": 1.8e-6, "source": "measured-2026-11-29", "note": "fit"},
        "bf16": {"value": 0, "source": "measured-2026-11-29"}}))
    assert isinstance(per_dtype.matmul_overhead_s, dict)
    assert per_dtype.matmul_overhead("fp32") == 1.8e-6
    assert per_dtype.matmul_overhead("bf16") == 0.0  # zero is allowed: no ramp
    assert per_dtype.matmul_overhead("fp16") is None


def test_fabric_and_collective_factors_load(tmp_path: Path) -> None:
    profile = _load_changed(
        tmp_path, "cpu",
        _set("topology", "levels", 0, "fabric",
             value={"value": "switch", "source": "measured-2026-11-29"}),
        _set("topology", "levels", 0, "collective_factors", value={
            "reduce_scatter": {"value": 0.34, "source": "measured-2026-11-29"},
            "broadcast": {"value": 3.45, "source": "measured-2026-11-29"}}))
    level = profile.levels[0]
    assert level.fabric == Cited("switch", "measured-2026-11-29", "")
    assert level.fabric_kind == "switch"
    assert level.collective_factor("reduce_scatter") == 0.34
    assert level.collective_factor("broadcast") == 3.45  # factors above 1 are allowed
    assert level.collective_factor("all_reduce") == 1.0
    assert set(level.collective_factors) <= set(COLLECTIVES)


def test_measured_collective_times_price_inside_their_range(tmp_path: Path) -> None:
    """A level's measured points price a collective of a measured group size and kind:
    exactly at a point, linearly between two, the first's time below them; above the last
    point, for another kind or group size, the model prices it as before."""
    from planner.cost.pricing import collective_seconds
    from planner.sharding.mesh import DeviceMesh

    points = [[2, 4, 2e-4], [2, 1 << 20, 1e-3], [2, 1 << 24, 20e-3]]
    profile = _load_changed(tmp_path, "cpu", _times(points))
    plain = load_profile("cpu")
    mesh = DeviceMesh.build({"dp": 2}, 2)

    def seconds(chosen: HardwareProfile, kind: str, nbytes: float) -> float:
        return collective_seconds(chosen, kind, nbytes, ("dp",), mesh)

    assert seconds(profile, "all_reduce", 1 << 20) == pytest.approx(1e-3)
    middle = (1 << 20) + ((1 << 24) - (1 << 20)) / 2
    assert seconds(profile, "all_reduce", middle) == pytest.approx(10.5e-3)
    assert seconds(profile, "all_reduce", 2) == pytest.approx(2e-4)
    assert seconds(profile, "all_reduce", 1 << 26) == seconds(plain, "all_reduce", 1 << 26)
    assert seconds(profile, "all_gather", 1 << 20) == seconds(plain, "all_gather", 1 << 20)
    level = profile.levels[0]
    assert level.measured_seconds("all_reduce", 4, 1 << 20) is None  # not measured at 4


# -- malformed contents --------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def _times(points: list[list[float]], kind: str = "all_reduce") -> Mutation:
    """The cpu profile's loopback level given measured `collective_times` of `kind`."""
    return _set("topology", "levels", 0, "collective_times",
                value={kind: {"value": points, "source": "measured-2026-11-29"}})


def _set(*keys: str | int, value: Any) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        node: Any = data
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return mutate


def _delete(*keys: str | int) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        node: Any = data
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]
    return mutate


def _swap_first_levels(data: dict[str, Any]) -> None:
    levels = data["topology"]["levels"]
    levels[0], levels[1] = levels[1], levels[0]


def _duplicate_level_name(data: dict[str, Any]) -> None:
    data["topology"]["levels"][1]["name"] = data["topology"]["levels"][0]["name"]


MALFORMED: list[tuple[str, str, Mutation, str, str]] = [
    # (id, base profile, change, field named, problem stated)
    ("wrong-schema", "a100-80g", _set("schema", value="shardplan.hardware-profile/2"),
     "schema", "must be 'shardplan.hardware-profile/1'"),
    ("missing-memory", "a100-80g", _delete("device", "memory_bytes"),
     "device.memory_bytes", "is missing"),
    ("missing-levels", "a100-80g", _delete("topology", "levels"),
     "topology.levels", "is missing"),
    ("missing-name", "a100-80g", _delete("name"), "name", "is missing"),
    ("unknown-field", "a100-80g", _set("device", "memory_bandwith_Bps", value=1),
     "device.memory_bandwith_Bps", "is not a known field"),
    ("negative-peak", "a100-80g", _set("device", "peak_flops", "bf16", "value", value=-1),
     "device.peak_flops.bf16.value", "must be a finite positive number, got -1"),
    ("nan-bandwidth", "a100-80g", _set("device", "memory_bandwidth_Bps", "value",
                                       value=math.nan),
     "device.memory_bandwidth_Bps.value", "got nan"),
    ("inf-launch", "a100-80g", _set("device", "kernel_launch_s", "value", value=math.inf),
     "device.kernel_launch_s.value", "got inf"),
    ("zero-latency", "a100-80g", _set("topology", "levels", 0, "latency_s", "value", value=0),
     "topology.levels[0].latency_s.value", "must be a finite positive number, got 0"),
    ("efficiency-above-1", "a100-80g",
     _set("topology", "levels", 1, "efficiency", "value", value=1.2),
     "topology.levels[1].efficiency.value", "must be a fraction in (0, 1], got 1.2"),
    ("efficiency-zero", "a100-80g", _set("device", "matmul_efficiency", "value", value=0.0),
     "device.matmul_efficiency.value", "got 0.0"),
    ("number-as-string", "a100-80g",
     _set("device", "peak_flops", "fp16", "value", value="312e12"),
     "device.peak_flops.fp16.value", "must be a positive number"),
    ("bool-count", "a100-80g", _set("topology", "devices_per_node", "value", value=True),
     "topology.devices_per_node.value", "must be a positive integer"),
    ("fractional-bytes", "a100-80g", _set("device", "memory_bytes", "value", value=8.5e10),
     "device.memory_bytes.value", "must be a positive integer"),
    ("unknown-source", "a100-80g", _set("device", "memory_bytes", "source", value="nowhere"),
     "device.memory_bytes.source", "'nowhere' is not a key of sources"),
    ("empty-citation", "a100-80g", _set("sources", "dgx-a100", value=" "),
     "sources.dgx-a100", "must be a non-empty string"),
    ("note-not-text", "a100-80g", _set("device", "memory_bytes", "note", value=5),
     "device.memory_bytes.note", "must be a string"),
    ("derived-without-note", "ascend-910a",
     _delete("device", "memory_bandwidth_Bps", "note"),
     "device.memory_bandwidth_Bps.note", "must explain the arithmetic"),
    ("unknown-dtype", "a100-80g",
     _set("device", "peak_flops", "fp64", value={"value": 1e12, "source": "dgx-a100"}),
     "device.peak_flops.fp64", "is not a known dtype"),
    ("no-peaks", "a100-80g", _set("device", "peak_flops", value={}),
     "device.peak_flops", "must be a non-empty object"),
    ("levels-out-of-order", "ascend-910a", _swap_first_levels,
     "topology.levels[1].group_size", "must be larger than and a multiple of"),
    ("levels-not-dividing", "ascend-910a", _set("topology", "levels", 0, "group_size", value=3),
     "topology.levels[1].group_size", "must be larger than and a multiple of the level before"),
    ("last-intra-not-node", "ascend-910b", _set("topology", "levels", 0, "group_size", value=4),
     "topology.levels[0].group_size", "must equal topology.devices_per_node (8)"),
    ("no-inter-node-level", "ascend-910a",
     _set("topology", "levels", 2, "group_size", value=16),
     "topology.levels[2].group_size", "must be null"),
    ("null-inside", "ascend-910a", _set("topology", "levels", 0, "group_size", value=None),
     "topology.levels[0].group_size", "is null but only the last level may be"),
    ("group-of-one", "cpu", _set("topology", "levels", 0, "group_size", value=1),
     "topology.levels[0].group_size", "must be at least 2"),
    ("duplicate-level-name", "ascend-910a", _duplicate_level_name,
     "topology.levels[0].name", "is used by two levels"),
    ("empty-levels", "a100-80g", _set("topology", "levels", value=[]),
     "topology.levels", "must be a non-empty list"),
    ("allowed-without-whole-node", "ascend-910a",
     _set("topology", "allowed_devices_within_node", "value", value=[1, 2, 4]),
     "topology.allowed_devices_within_node.value", "must end with devices_per_node (8)"),
    ("allowed-unsorted", "ascend-910a",
     _set("topology", "allowed_devices_within_node", "value", value=[1, 4, 2, 8]),
     "topology.allowed_devices_within_node.value", "must be strictly increasing"),
    ("device-not-object", "a100-80g", _set("device", value=[]),
     "device", "must be a JSON object, got a list"),
    # device.matmul_overhead_s
    ("overhead-negative", "a100-80g",
     _set("device", "matmul_overhead_s", value={"value": -1e-6, "source": "dgx-a100"}),
     "device.matmul_overhead_s.value", "must be a finite number >= 0, got -1e-06"),
    ("overhead-nan", "a100-80g",
     _set("device", "matmul_overhead_s", value={"value": math.nan, "source": "dgx-a100"}),
     "device.matmul_overhead_s.value", "got nan"),
    ("overhead-inf-per-dtype", "a100-80g",
     _set("device", "matmul_overhead_s",
          value={"bf16": {"value": math.inf, "source": "dgx-a100"}}),
     "device.matmul_overhead_s.bf16.value", "got inf"),
    ("overhead-string", "a100-80g",
     _set("device", "matmul_overhead_s", value={"value": "7us", "source": "dgx-a100"}),
     "device.matmul_overhead_s.value", "must be a number of seconds"),
    ("overhead-bare-number", "a100-80g", _set("device", "matmul_overhead_s", value=7e-6),
     "device.matmul_overhead_s", "must be a cited time"),
    ("overhead-empty", "a100-80g", _set("device", "matmul_overhead_s", value={}),
     "device.matmul_overhead_s", "must be a cited time"),
    ("overhead-unknown-dtype", "a100-80g",
     _set("device", "matmul_overhead_s", value={"fp64": {"value": 1e-6, "source": "dgx-a100"}}),
     "device.matmul_overhead_s.fp64", "is not a known dtype"),
    ("overhead-dtype-without-peak", "a100-80g",
     _set("device", "matmul_overhead_s", value={"fp8": {"value": 1e-6, "source": "dgx-a100"}}),
     "device.matmul_overhead_s.fp8", "has no device.peak_flops.fp8"),
    ("overhead-unknown-source", "a100-80g",
     _set("device", "matmul_overhead_s", value={"value": 1e-6, "source": "nowhere"}),
     "device.matmul_overhead_s.source", "'nowhere' is not a key of sources"),
    ("overhead-derived-without-note", "ascend-910a",
     _set("device", "matmul_overhead_s", value={"value": 1e-6, "source": "derived"}),
     "device.matmul_overhead_s.note", "must explain the arithmetic"),
    # topology.levels[].fabric
    ("fabric-unknown-word", "ascend-910b",
     _set("topology", "levels", 0, "fabric", "value", value="torus"),
     "topology.levels[0].fabric.value", "must be one of 'switch', 'full_mesh', got \"torus\""),
    ("fabric-number", "ascend-910b", _set("topology", "levels", 0, "fabric", "value", value=1),
     "topology.levels[0].fabric.value", "must be one of"),
    ("fabric-uncited", "ascend-910b",
     _set("topology", "levels", 0, "fabric", value="full_mesh"),
     "topology.levels[0].fabric", "must be a JSON object, got a string"),
    ("fabric-without-source", "ascend-910b",
     _delete("topology", "levels", 0, "fabric", "source"),
     "topology.levels[0].fabric.source", "is missing"),
    ("fabric-mesh-between-nodes", "ascend-910b",
     _set("topology", "levels", 1, "fabric",
          value={"value": "full_mesh", "source": "arthurchiao-910b"}),
     "topology.levels[1].fabric.value", "cannot be 'full_mesh' on the inter-node level"),
    ("fabric-misspelt-field", "ascend-910b",
     _set("topology", "levels", 0, "fabrik",
          value={"value": "full_mesh", "source": "arthurchiao-910b"}),
     "topology.levels[0].fabrik", "is not a known field"),
    # topology.levels[].collective_factors
    ("factors-not-object", "cpu",
     _set("topology", "levels", 0, "collective_factors", value=[0.5]),
     "topology.levels[0].collective_factors", "must be an object of collective kind"),
    ("factors-unknown-kind", "cpu",
     _set("topology", "levels", 0, "collective_factors",
          value={"gather": {"value": 0.5, "source": "measured-2026-11-29"}}),
     "topology.levels[0].collective_factors.gather", "is not a known collective"),
    ("factors-zero", "cpu",
     _set("topology", "levels", 0, "collective_factors",
          value={"all_gather": {"value": 0, "source": "measured-2026-11-29"}}),
     "topology.levels[0].collective_factors.all_gather.value",
     "must be a finite positive number, got 0"),
    ("factors-negative", "cpu",
     _set("topology", "levels", 0, "collective_factors",
          value={"reduce_scatter": {"value": -0.3, "source": "measured-2026-11-29"}}),
     "topology.levels[0].collective_factors.reduce_scatter.value", "got -0.3"),
    ("factors-bare-number", "cpu",
     _set("topology", "levels", 0, "collective_factors", value={"all_gather": 0.5}),
     "topology.levels[0].collective_factors.all_gather", "must be a JSON object, got a number"),
    ("factors-unknown-source", "cpu",
     _set("topology", "levels", 1, "collective_factors",
          value={"broadcast": {"value": 2.0, "source": "nowhere"}}),
     "topology.levels[1].collective_factors.broadcast.source", "'nowhere' is not a key"),
    # topology.levels[].collective_times
    ("times-unknown-kind", "cpu", _times([[2, 4, 1e-4]], kind="gather"),
     "topology.levels[0].collective_times.gather", "is not a known collective"),
    ("times-not-points", "cpu", _times([[2, 4]]),
     "topology.levels[0].collective_times.all_reduce.value[0]",
     "must be [group size, bytes, seconds]"),
    ("times-group-of-one", "cpu", _times([[1, 4, 1e-4]]),
     "topology.levels[0].collective_times.all_reduce.value[0][0]", "a group of 2 or more"),
    ("times-negative", "cpu", _times([[2, 4, -1]]),
     "topology.levels[0].collective_times.all_reduce.value[0][2]", "got -1"),
    ("times-twice", "cpu", _times([[2, 4, 1e-4], [2, 4, 2e-4]]),
     "topology.levels[0].collective_times.all_reduce.value", "twice"),
]


@pytest.mark.parametrize(("base", "mutate", "field", "problem"),
                         [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_profile_names_file_and_field(tmp_path: Path, base: str, mutate: Mutation,
                                                field: str, problem: str) -> None:
    data = json.loads((PROFILE_DIR / f"{base}.json").read_text(encoding="utf-8"))
    mutate(data)
    path = tmp_path / f"{base}-broken.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {field} "), message
    assert problem in message, message
    assert "\n" not in message


def test_top_level_must_be_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[]")
    with pytest.raises(ProfileError, match=f"{path}: the file's top level must be a JSON "
                                           f"object, got a list"):
        load_profile(path)


def test_kernels_load_and_default_to_one_kernel_per_op(tmp_path: Path) -> None:
    """`device.kernels` names how attention and elementwise chains run; a profile without
    it (a calibrated CPU) prices one kernel per op, as the executor runs them."""
    assert load_profile("cpu").default_attention == "eager"
    assert load_profile("cpu").default_fusion == "none"
    assert load_profile("a100-80g").default_attention == "flash"
    assert load_profile("ascend-910a").default_attention == "eager"  # no FlashAttentionScore
    changed = _load_changed(tmp_path, "cpu", _set("device", "kernels", value={
        "fusion": {"value": "elementwise", "source": "measured-2026-11-29"}}))
    assert changed.default_fusion == "elementwise" and changed.default_attention == "eager"
    with pytest.raises(ProfileError, match=r"device\.kernels\.attention\.value must be one of"):
        _load_changed(tmp_path, "cpu", _set("device", "kernels", value={
            "attention": {"value": "fast", "source": "measured-2026-11-29"}}))
    with pytest.raises(ProfileError, match=r"device\.kernels\.speed"):
        _load_changed(tmp_path, "cpu", _set("device", "kernels", value={"speed": 1}))
