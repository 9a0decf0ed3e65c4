"""GEMM shape pricing (costmodels/gemm.py): tiles, waves, split-K, the epilogue, the roofline.

The second half holds measured public shape sweeps as rows with a tolerance, like
test_costmodels's published measurements; docs/cost-model.md "GEMM shape" has the same
table with predicted, measured and ratio per row.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from costmodels.compute import op_time
from costmodels.gemm import REFERENCE, GemmShape, gemm_seconds, has_shape_terms, tiling
from costmodels.profile import load_profile
from costmodels.rates import memory_seconds
from hardware_profiles import PROFILE_DIR
from planner import zoo
from planner.cost.kernels import KernelPolicy, kernel_plan
from planner.cost.pricing import local_gemm_shape, op_times
from planner.errors import ProfileError
from planner.graph import OpNode, TensorInfo
from planner.importer import import_model
from planner.kinds import AttentionKernel, Fusion
from planner.ops.work import gemm_dims
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.mesh import DeviceMesh
from planner.zoo.llama import LlamaConfig

A100 = load_profile("a100-80g")
H100 = load_profile("h100-sxm")
ASCEND_910B = load_profile("ascend-910b")
CPU = load_profile("cpu")
FLAT_A100 = replace(A100, compute_units=None, gemm_tile=None)


def _seconds(profile, shape: GemmShape, dtype: str = "bfloat16") -> float:  # type: ignore[no-untyped-def]
    return gemm_seconds(profile, shape, dtype)


def _tflops(profile, dtype: str, m: int, n: int, k: int, *, shape: bool = True) -> float:  # type: ignore[no-untyped-def]
    gemm = GemmShape(m, n, k)
    nbytes = gemm.nbytes(4 if dtype == "float32" else 2)
    seconds = op_time(profile, "MatMul", gemm.flops, nbytes, dtype,
                      shape=gemm if shape else None)
    return gemm.flops / seconds / 1e12


# -- the terms -------------------------------------------------------------------------------


def test_bundled_accelerators_have_shape_terms_and_the_cpu_has_none() -> None:
    for name in ("a100-40g", "a100-80g", "h100-sxm", "h200-sxm", "ascend-910a", "ascend-910b"):
        assert has_shape_terms(load_profile(name)), name
    assert not has_shape_terms(CPU)
    assert (A100.compute_units.value, A100.gemm_tile.value) == (108, (256, 128, 32))  # type: ignore[union-attr]
    assert H100.compute_units.value == 132  # type: ignore[union-attr]
    assert ASCEND_910B.compute_units.value == 24  # type: ignore[union-attr]


def test_one_tile_more_than_the_compute_units_costs_a_second_wave() -> None:
    """A100, 256 x 128 tiles on 108 SMs: 108 tiles are one wave, 109 are two."""
    assert tiling(A100, GemmShape(256 * 108, 128, 8192)).waves == 1
    assert tiling(A100, GemmShape(256 * 109, 128, 8192)).waves == 2
    full = GemmShape(256 * 9, 128 * 12, 16384)  # 108 tiles
    over = GemmShape(256 * 9, 128 * 13, 16384)  # 117 tiles: 9 on a second wave
    assert (tiling(A100, full).waves, tiling(A100, over).waves) == (1, 2)
    assert _seconds(A100, over) / _seconds(A100, full) > 1.8  # 8% more work, ~2x the time
    flat = _seconds(FLAT_A100, over) / _seconds(FLAT_A100, full)
    assert flat == pytest.approx(13 / 12, rel=0.01)  # the flat model sees only the FLOPs


def test_a_dimension_one_past_a_tile_pays_for_the_whole_next_tile() -> None:
    base = GemmShape(8192, 8192, 8192)
    past = GemmShape(8192, 8193, 8192)  # n tile 128: 65 column tiles instead of 64
    padded = GemmShape(8192, 8192 + 128, 8192)
    assert tiling(A100, past).tiles == tiling(A100, padded).tiles == 32 * 65
    assert _seconds(A100, past) == pytest.approx(_seconds(A100, padded), rel=1e-6)
    assert _seconds(A100, past) > _seconds(A100, base) * (1 + 1 / 64) * 0.99


def test_a_small_dimension_gets_a_smaller_tile_not_a_padded_one() -> None:
    """m = 16 uses a 16-row tile (MMA granule), not the 256-row large-GEMM tile."""
    plan = tiling(A100, GemmShape(16, 8192, 8192))
    assert plan.tile_m == 16 and plan.tile_n == 128
    assert tiling(A100, GemmShape(20, 8192, 8192)).tile_m == 32


def test_too_few_tiles_split_k_across_the_idle_units() -> None:
    plan = tiling(H100, GemmShape(128, 12288, 5376))  # 48 tiles of 128 x 256 on 132 SMs
    assert (plan.tiles, plan.split_k, plan.waves) == (48, 2, 1)
    assert plan.steps == 42  # 84 K steps of 64, half on each slice
    assert tiling(H100, GemmShape(8192, 8192, 8192)).split_k == 1


def test_a_skinny_gemm_is_memory_bound() -> None:
    """m = 16 against a 12288 x 5376 weight: the time is reading the weight."""
    shape = GemmShape(16, 12288, 5376)
    assert _seconds(H100, shape) == memory_seconds(H100, shape.nbytes(2))


def test_low_k_pays_the_epilogue_the_flat_roofline_hid() -> None:
    """8192 x 8192 x 256: writing C is not hidden behind a K loop this short."""
    shaped = _tflops(H100, "float16", 8192, 8192, 256)
    flat = _tflops(H100, "float16", 8192, 8192, 256, shape=False)
    assert shaped < 0.6 * flat


def test_large_squares_keep_the_flat_model_within_2_percent() -> None:
    for profile in (A100, ASCEND_910B):
        for n in (8192, 16384):
            ratio = _tflops(profile, "bfloat16", n, n, n) / _tflops(profile, "bfloat16", n, n, n,
                                                                   shape=False)
            assert abs(ratio - 1) < 0.02, (profile.name, n, ratio)
    # 8192^3 on 132 SMs is 15.5 waves: 3% below; deeper K hides the epilogue that E holds
    # at 8192^3, so 32768^3 runs up to 2.5% above (docs/cost-model.md "GEMM shape")
    for profile in (A100, H100, ASCEND_910B):
        for n in (8192, 16384, 32768):
            ratio = _tflops(profile, "bfloat16", n, n, n) / _tflops(profile, "bfloat16", n, n, n,
                                                                   shape=False)
            assert abs(ratio - 1) < 0.03, (profile.name, n, ratio)


def test_the_reference_shape_gives_the_flat_rate_back_when_its_waves_are_whole() -> None:
    whole = replace(A100, compute_units=replace(A100.compute_units, value=128))  # type: ignore[arg-type]
    assert tiling(whole, REFERENCE).waves * 128 == tiling(whole, REFERENCE).tiles
    assert _seconds(whole, REFERENCE) == pytest.approx(_seconds(FLAT_A100, REFERENCE), rel=1e-9)


def test_time_never_falls_as_k_grows() -> None:
    times = [_seconds(H100, GemmShape(4096, 4096, k)) for k in range(64, 8192, 64)]
    assert all(b >= a for a, b in itertools.pairwise(times))


def test_without_the_fields_op_time_is_the_flat_model_bit_for_bit() -> None:
    for profile in (CPU, FLAT_A100):
        for m, n, k in ((1, 4096, 4096), (257, 4096, 100), (8192, 8192, 256)):
            gemm = GemmShape(m, n, k, batch=3)
            for dtype in ("float32", "bfloat16"):
                old = op_time(profile, "MatMul", gemm.flops, gemm.nbytes(2), dtype)
                new = op_time(profile, "MatMul", gemm.flops, gemm.nbytes(2), dtype, shape=gemm)
                assert new == old
    # and a shape on a non-matrix op changes nothing
    assert op_time(A100, "Add", 1e6, 4e6, "float32", shape=GemmShape(1, 1, 1)) == \
        op_time(A100, "Add", 1e6, 4e6, "float32")


def test_a_flash_core_is_not_priced_as_a_gemm_writing_its_scores(tmp_path: Path) -> None:
    """A flash kernel's q kᵀ keeps its s × s scores in on-chip tiles: it is priced by its
    FLOPs at the GEMM rate and the HBM bytes of q, k, v and the output (Dao 2023,
    FlashAttention-2, §3.1), not by the shape model's tiles, whose epilogue and roofline
    write and read the s² scores (3× the time of the kernel's FLOPs at s = 4096, head 128).
    Under eager attention the same op is a GEMM that writes its scores, shape-priced."""
    config = LlamaConfig(layers=1, hidden=1024, heads=8, kv_heads=2, ffn=2048, vocab=256,
                         max_positions=4096, dtype="bfloat16")
    path = zoo.save(zoo.build("llama", config), tmp_path / "llama.onnx")
    analysis = GraphAnalysis.of(import_model(path, batch=1, dims={"seq": 4096}))
    graph, mesh = analysis.graph, DeviceMesh.build({"dp": 1}, 8)
    flash = kernel_plan(analysis, KernelPolicy(AttentionKernel.FLASH, Fusion.NONE))
    eager = kernel_plan(analysis, KernelPolicy(AttentionKernel.EAGER, Fusion.NONE))
    core = flash.cores[0]
    node, kernel = graph.op(core.first), flash.ops[core.first]
    whole = [None, None]
    shape = local_gemm_shape(node, eager.ops[core.first], graph.tensors, whole, mesh)
    assert shape is not None and (shape.m, shape.n, shape.k) == (4096, 4096, 128)
    assert local_gemm_shape(node, kernel, graph.tensors, whole, mesh) is None
    forward, backward = op_times(node, flash, graph.tensors, whole, 1.0, mesh, H100, None,
                                 True, True)
    flat = op_time(H100, "MatMul", kernel.flops, kernel.bytes, "bfloat16")
    assert forward == pytest.approx(flat) and backward == pytest.approx(3 * flat)
    assert op_time(H100, "MatMul", kernel.flops, kernel.bytes, "bfloat16",
                   shape=shape) > 2.5 * flat


def test_launch_floor_bounds_a_tiny_gemm() -> None:
    assert _seconds(A100, GemmShape(2, 2, 2)) >= float(A100.kernel_launch_s.value)


def test_shape_must_be_positive_integers() -> None:
    with pytest.raises(ValueError, match=r"GemmShape\.k must be a positive integer"):
        GemmShape(4, 4, 0)


# -- profile fields ----------------------------------------------------------------------


def _broken(tmp_path: Path, **device: object) -> Path:
    data = json.loads((PROFILE_DIR / "a100-80g.json").read_text())
    for key, value in device.items():
        if value is None:
            del data["device"][key]
        else:
            data["device"][key] = value
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("fields", "message"), [
    ({"gemm_tile": {"value": [256, 128], "source": "cublas-ampere-kernel"}},
     r"device\.gemm_tile\.value must be a list of 3 tile sizes"),
    ({"gemm_tile": {"value": [256, 0, 32], "source": "cublas-ampere-kernel"}},
     r"device\.gemm_tile\.value\[1\] must be a positive integer"),
    ({"compute_units": {"value": 1.5, "source": "nvidia-mm-background"}},
     r"device\.compute_units\.value must be a positive integer"),
    ({"compute_units": {"value": 108, "source": "nowhere"}},
     r"device\.compute_units\.source 'nowhere' is not a key of sources"),
    ({"gemm_tile": None}, r"device\.gemm_tile is missing; GEMM shape pricing needs it"),
])
def test_malformed_shape_fields_name_the_file_and_field(tmp_path: Path, fields: dict,
                                                        message: str) -> None:
    path = _broken(tmp_path, **fields)
    with pytest.raises(ProfileError, match=message) as caught:
        load_profile(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


# -- gemm_dims (the ops layer) --------------------------------------------------------------


def _node(op_type: str, *shapes: tuple[int, ...], **attrs: int) -> tuple[OpNode, dict]:
    names = [f"x{i}" for i in range(len(shapes))]
    tensors = {n: TensorInfo(n, s, "float32", "activation") for n, s in zip(names, shapes,
                                                                           strict=True)}
    return OpNode("op", op_type, "", tuple(names), ("y",), dict(attrs)), tensors


def test_gemm_dims_of_a_batched_matmul_broadcasts_the_leading_dims() -> None:
    assert gemm_dims(*_node("MatMul", (4, 1, 128, 64), (3, 64, 32))) == (12, 128, 32, 64)
    assert gemm_dims(*_node("MatMul", (2, 512, 4096), (4096, 11008))) == (2, 512, 11008, 4096)


def test_gemm_dims_of_vectors_and_gemm_transposes() -> None:
    assert gemm_dims(*_node("MatMul", (64,), (64, 32))) == (1, 1, 32, 64)
    assert gemm_dims(*_node("MatMul", (5, 64), (64,))) == (1, 5, 1, 64)
    assert gemm_dims(*_node("Gemm", (64, 5), (32, 64), transA=1, transB=1)) == (1, 5, 32, 64)
    assert gemm_dims(*_node("FusedMatMul", (2, 64, 5), (64, 7), transA=1)) == (2, 5, 7, 64)


def test_gemm_dims_is_none_for_other_ops_and_unknown_or_mismatched_shapes() -> None:
    assert gemm_dims(*_node("Add", (4, 4), (4, 4))) is None
    assert gemm_dims(*_node("MatMul", (), (4, 4))) is None
    assert gemm_dims(*_node("MatMul", (4, 5), (6, 4))) is None
    node, tensors = _node("MatMul", (4, 5), (5, 4))
    del tensors["x1"]
    assert gemm_dims(node, tensors) is None


# -- measured public shape sweeps ---------------------------------------------------------
# (label, predicted TFLOP/s, measured TFLOP/s, tolerance, source). Independent rows: +-10%.

TILELANG = "xwhzz/tilelang benchmark/matmul/README.md (H800 SXM, FP16, M = N = 8192)"
ZZC_H100 = "zzc0721/torch-performance-test-data#79 (H100 80GB HBM3, BF16 n^3)"
ZZC_910B = "zzc0721/torch-performance-test-data#109 (Ascend910B2, n^3)"
VLLM = "vllm-project/vllm#49363 (H100, torch BF16, N = 12288, K = 5376)"

SWEEP = [
    *[(f"H800 FP16 8192x8192x{k}", _tflops(H100, "float16", 8192, 8192, k), measured, 0.10,
       TILELANG)
      for k, measured in ((1024, 628), (2048, 705), (4096, 736), (8192, 758), (16384, 766))],
    *[(f"H100 BF16 {n}^3", _tflops(H100, "bfloat16", n, n, n), measured, 0.10, ZZC_H100)
      for n, measured in ((8192, 797.51), (10240, 719.72))],
    *[(f"H100 BF16 {m}x12288x5376", _tflops(H100, "bfloat16", m, 12288, 5376), measured, 0.10,
       VLLM)
      for m, measured in ((1, 2.870333), (16, 46.541434), (64, 182.588263), (128, 352.560566))],
    *[(f"910B2 BF16 {n}^3", _tflops(ASCEND_910B, "bfloat16", n, n, n), measured, 0.10, ZZC_910B)
      for n, measured in ((2048, 248.30), (4096, 315.36), (8192, 301.23), (10240, 300.94))],
    *[(f"910B2 FP32 {n}^3", _tflops(ASCEND_910B, "float32", n, n, n), measured, 0.10, ZZC_910B)
      for n, measured in ((1024, 46.30), (2048, 76.92), (4096, 84.53), (8192, 80.43),
                          (10240, 79.69))],
    ("A100 BF16 8192^3 (published row, with shape)", _tflops(A100, "bfloat16", 8192, 8192, 8192),
     271.32, 0.10, "HARDWARE-SOURCES.md s.4"),
    ("910B BF16 best shape (published row, 8192^3 with shape)",
     _tflops(ASCEND_910B, "bfloat16", 8192, 8192, 8192), 328.0, 0.10, "limulidae"),
]


@pytest.mark.parametrize(("label", "predicted", "measured", "tolerance", "source"), SWEEP,
                         ids=[row[0] for row in SWEEP])
def test_shape_sweep_matches_measurement(label: str, predicted: float, measured: float,
                                         tolerance: float, source: str) -> None:
    ratio = predicted / measured
    assert abs(ratio - 1) <= tolerance, f"{label}: {predicted:.1f} vs {measured} ({source})"


def test_shape_gaps_stay_documented() -> None:
    """Rows the shape model misses by more than 10% (docs/cost-model.md "GEMM shape")."""
    low_k = _tflops(H100, "float16", 8192, 8192, 256) / 386
    assert 0.85 < low_k < 0.92  # was 1.67 flat; the rest is the U memory_efficiency 0.80
    small = _tflops(H100, "bfloat16", 2048, 2048, 2048) / 676.59
    assert 0.75 < small < 0.85  # one wave of 128 tiles plus the 7 us default ramp
    tiny = _tflops(H100, "bfloat16", 1024, 1024, 1024) / 176.62
    assert 1.1 < tiny < 1.25  # split-K partials assumed free in L2
    ascend = _tflops(ASCEND_910B, "bfloat16", 1024, 1024, 1024) / 99.86
    assert 1.1 < ascend < 1.25  # was 1.56 flat
    # Short kernels (0.1-0.2 ms) timed alone run at the boost clock, above the sustained,
    # power-limited rate the Hopper profiles price (ml-engineering's MSMF): bursts.
    burst_low_k = _tflops(H100, "float16", 8192, 8192, 512) / 520
    assert 0.85 < burst_low_k < 0.92
    burst_square = _tflops(H100, "bfloat16", 4096, 4096, 4096) / 788.72
    assert 0.82 < burst_square < 0.90
