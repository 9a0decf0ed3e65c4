"""Issue 18, item 4 and 5: repeated, non-finite or absurd flag values and outputs that
would overwrite an input are refused with one line and exit 2, before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from planner import zoo
from planner.cli import main


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, config = zoo.preset("seed-mlp")
    return zoo.save(zoo.build(family, config), tmp_path_factory.mktemp("m") / "seed.onnx")


@pytest.mark.parametrize(("flags", "message"), [
    (["--dim", "seq=8", "--dim", "seq=16"], "--dim seq is given twice (8 and 16)"),
    (["--parallel", "dp=8,dp=2"], "dp is given twice"),
    (["--time-limit", "nan"], "--time-limit nan: a finite number above 0"),
    (["--time-limit", "inf"], "--time-limit inf: a finite number above 0"),
    (["--memory-limit", "nan"], "--memory-limit nan: a finite number above 0"),
    (["--memory-limit", "inf"], "--memory-limit inf: a finite number above 0"),
    (["--memory-limit", "1e300"], "between 1 KiB"),
    (["--memory-limit", "1e-300"], "between 1 KiB"),
    (["--devices", str(10 ** 9)], "more than any cluster shardplan plans for"),
    (["--devices", str(10 ** 30)], "more than any cluster shardplan plans for"),
    (["--parallel", "dp=2", "--parallel", "tp=2"],
     "argument --parallel: given twice; give it once (one flag pins several"),
    (["--devices", "2", "--devices", "4"], "argument --devices: given twice; give it once"),
    (["--time-limit", "5", "--time-limit=9"], "argument --time-limit: given twice"),
    (["--mesh", "2x2", "--max-mesh-axes", "1"],
     "--mesh 2x2 has 2 axes, more than --max-mesh-axes 1"),
    (["--inference", "--optimizer", "sgd"], "--optimizer sgd with --inference"),
])
def test_absurd_plan_flags_are_refused(seed: Path, flags: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(seed), "--batch", "32", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_outputs_never_overwrite_inputs_or_land_nowhere(seed: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    before = seed.read_bytes()
    assert main(["plan", str(seed), "--batch", "32", "-o", str(seed)]) == 2
    assert "is an input of this command" in capsys.readouterr().err
    assert seed.read_bytes() == before
    assert main(["plan", str(seed), "--batch", "32", "-o", str(tmp_path / "no" / "p.json")]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err
    assert main(["plan", str(seed), "--batch", "32", "-o", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    planned = tmp_path / "plan.json"
    assert main(["plan", str(seed), "--batch", "32", "--devices", "2", "-o", str(planned)]) == 0
    text = planned.read_text()
    assert main(["export", str(planned), "--format", "dtensor", "-o", str(planned)]) == 2
    assert planned.read_text() == text
    capsys.readouterr()
    data = tmp_path / "data"
    data.mkdir()
    (data / "targets.npy").write_bytes(b"the user's")
    for flags, message in ((["--lr", "nan"], "--lr nan"), (["--lr", "inf"], "--lr inf"),
                           (["--log-json", str(tmp_path / "no" / "log.json")],
                            "does not exist"),
                           (["--log-json", str(data / "targets.npy"), "--data", str(data)],
                            "inside --data"),
                           (["--log-json", str(tmp_path / "ck"), "--checkpoint",
                             str(tmp_path / "ck")], "inside --checkpoint"),
                           (["--log-json", str(tmp_path / ("x" * 300))], "too long"),
                           (["--seed", str(2 ** 64)], "is not in 0..2**63-1")):
        assert main(["run", str(seed), "--plan", str(planned), "--nproc", "2", *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert (data / "targets.npy").read_bytes() == b"the user's"


def test_messages_stay_one_line(seed: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """A newline in an op name cannot forge a second error line; YAML errors are one."""
    model = onnx.load(seed, load_external_data=False)
    model.graph.node[0].name = "mat\nshardplan: error: forged"
    forged = tmp_path / "forged.onnx"
    onnx.save(model, forged)
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps({"mat\nshardplan: error: forged": [[1, 1], [1, 9]]}))
    assert main(["plan", str(forged), "--batch", "32", "--devices", "2", "--mode", "semi",
                 "--strategies", str(pins)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "mat\\nshardplan" in err
    pytest.importorskip("yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\nb: c\n")
    assert main(["plan", str(seed), "--batch", "32", "--mode", "semi", "--strategies",
                 str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "line 2, column 2" in err


def test_data_that_is_not_the_steps_arrays_is_refused(seed: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """`--data` is read or refused before any rank starts: never silently synthetic."""
    pytest.importorskip("torch")
    planned = tmp_path / "plan.json"
    assert main(["plan", str(seed), "--batch", "32", "--devices", "2", "--mode", "data",
                 "--profile", "cpu", "-o", str(planned)]) == 0
    folder = tmp_path / "data"
    run = ["run", str(seed), "--plan", str(planned), "--nproc", "2", "--data", str(folder)]
    capsys.readouterr()
    assert main(run) == 2
    assert "not a folder" in capsys.readouterr().err
    folder.mkdir()
    assert main(run) == 2
    assert "x.npy: missing" in capsys.readouterr().err
    np.save(folder / "x.npy", np.zeros((16, 128), np.float32))
    assert main(run) == 2
    assert "shape [16, 128], but input x is [32, 128]" in capsys.readouterr().err
    np.save(folder / "x.npy", np.zeros((32, 128), np.float32))
    np.save(folder / "targets.npy", np.full(32, 64))
    assert main(run) == 2
    assert "class targets must be integers in 0..63" in capsys.readouterr().err
    (folder / "targets.npy").write_bytes(b"not numpy")
    assert main(run) == 2
    assert "not a numpy array file" in capsys.readouterr().err
    np.save(folder / "targets.npy", np.zeros(32, np.int64))
    for written, message in (
            (lambda f: np.savez(f, x=np.zeros((32, 128), np.float32)), "an archive of arrays"),
            (lambda f: np.save(f, np.zeros((32, 128), ">f4")), "in the other byte order"),
            (lambda f: np.save(f, np.full((32, 128), np.nan, np.float32)), "holds NaN")):
        with open(folder / "x.npy", "wb") as out:
            written(out)
        assert main(run) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_a_plan_whose_ranges_leave_its_ops_is_refused_on_load(
        seed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Readers index the op list by the plan's unit, stage and segment ranges and by its
    stage ranks (explain crashed on a plan with an op removed): loading refuses them."""
    planned = tmp_path / "plan.json"
    assert main(["plan", str(seed), "--batch", "32", "--devices", "2",
                 "--parallel", "pp=2,micro_batches=2", "-o", str(planned)]) == 0
    data = json.loads(planned.read_text())
    edits = {
        "op removed": lambda d: d["ops"].pop(),
        "stage rank": lambda d: d["pipeline"]["stages"][0].update(ranks=[5]),
        "unit range": lambda d: d["pipeline"]["units"][0].update(ops=[0, 99]),
        "unknown dtype": lambda d: next(iter(d["tensors"].values())).update(dtype="x"),
    }
    for what, edit in edits.items():
        edited = json.loads(json.dumps(data))
        edit(edited)
        (tmp_path / "edited.json").write_text(json.dumps(edited))
        capsys.readouterr()
        assert main(["explain", str(tmp_path / "edited.json")]) == 2, what
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "edited.json" in err, (what, err)


def test_the_plan_schema_knows_exactly_the_importers_dtypes() -> None:
    from planner.importer.tensors import ONNX_TO_NUMPY

    schema = json.loads((Path(__file__).parents[1] / "planner" / "plans"
                         / "strategy.schema.json").read_text())
    found = next(node["properties"]["dtype"]["enum"] for node in _objects(schema)
                 if "dtype" in node.get("properties", {}))
    assert sorted(found) == sorted(set(ONNX_TO_NUMPY.values()))


def _objects(node: object) -> list[dict]:
    if isinstance(node, dict):
        return [node, *(o for v in node.values() for o in _objects(v))]
    if isinstance(node, list):
        return [o for v in node for o in _objects(v)]
    return []


BUILDERS = """
import torch
from sibling import WIDTH

def model():
    return torch.nn.Linear(4, WIDTH)

def batch(step, rows):
    return {"input": torch.randn(rows, 4)}

def two():
    return model(), batch

def raises():
    raise RuntimeError("no config.json here")

def listed():
    return model(), lambda step, rows: [torch.randn(rows, 4)], lambda out, b: out.sum()

def not_a_module():
    return "model", batch, lambda out, b: out.sum()

def good():
    return model(), batch, lambda out, b: out.sum()
"""


@pytest.mark.parametrize(("function", "message"), [
    ("two", "the builder returned 2 items; return (module, make_batch, loss_fn)"),
    ("raises", "the builder raised RuntimeError: no config.json here"),
    ("listed", "the builder's batch is a list, not a dict of tensors"),
    ("not_a_module", "the builder returned 3 items; return (module, make_batch, loss_fn)"),
    ("good", ""),
])
def test_builder_mistakes_are_one_line(tmp_path: Path, function: str, message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A builder beside its own modules imports them (as `python FILE.py` would); what it
    gets wrong is one line naming the spec, not a traceback."""
    pytest.importorskip("torch")
    (tmp_path / "sibling.py").write_text("WIDTH = 3\n")
    (tmp_path / "builders.py").write_text(BUILDERS)
    spec = f"{tmp_path / 'builders.py'}:{function}"
    code = main(["plan", "--module", spec, "--batch", "4", "--devices", "2", "--profile",
                 "cpu", "-o", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err.strip()
    if not message:
        assert code == 0, err
        return
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
