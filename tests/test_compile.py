"""Exported artifacts: same outputs as eager, load without compiling, and refuse what does not fit."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import atom_compile as ac
from atom_compile.artifact import ArtifactError
from atom_compile.cli import main as compile_cli
from atom_runtime import LLM, SamplingParams
from tests.helpers import run_fresh_python

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["Hello there", "The quick brown fox", "x"]


def tokens(llm_source, **kwargs) -> list[list[int]]:
    llm = LLM(llm_source, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_artifact_matches_eager(which, request):
    artifact = request.getfixturevalue(f"{which}_artifact")
    checkpoint = request.getfixturevalue(f"tiny_{which}")
    result = ac.compare(artifact)
    assert result["max_rel_diff"] < 1e-4 and result["argmax_equal"], result
    assert tokens(artifact) == tokens(checkpoint, device="cpu")


def test_manifest_records_the_build(llama_artifact):
    manifest = json.loads((llama_artifact / "manifest.json").read_text())
    for field in (
        "format_version",
        "architecture",
        "model_config",
        "weights",
        "dtype",
        "device",
        "device_capability",
        "torch_version",
        "triton_version",
        "atom_version",
        "ops_backend",
        "passes",
        "max_model_len",
        "block_size",
        "files",
    ):
        assert field in manifest, field
    assert {p["name"]: p["matches"] for p in manifest["passes"]}["rope_cache"] == 2
    compiled = [p for p in manifest["pieces"].values() if p["compiled"]]
    # first, middle and last pieces compile; the middle one would be shared by any number of layers
    assert len({p["key"] for p in compiled}) == 3
    assert (llama_artifact / "graphs" / "model.py").is_file()
    assert (llama_artifact / "tokenizer.json").is_file()


# Logs every compiler call except version queries and Inductor's CPU ISA probe: one-function files
# (__avx_chk_kernel, __avx512_vnni_chk_kernel_1, ...) that test which vector instructions build here.
SHIM = """#!/bin/sh
case "$*" in -v|--version|-dumpversion|-dumpfullversion) exec {real} "$@";; esac  # probes, not compiles
for arg in "$@"; do
  case "$arg" in *.cpp|*.c)
    if grep -Eq '__(avx|amx)[a-z0-9_]*_chk_kernel' "$arg" 2>/dev/null; then exec {real} "$@"; fi;;
  esac
done
echo "$0 $*" >> {log}
exec {real} "$@"
"""

CHILD = """
import json, sys
import torch
import torch._dynamo, torch._inductor, torch._inductor.compile_fx, torch.export

def forbidden(*args, **kwargs):
    raise AssertionError("a tracing or compile entry point was called while loading an artifact")

torch.compile = torch._dynamo.optimize = torch.export.export = forbidden
torch._inductor.compile_fx.compile_fx = torch._inductor.aoti_compile_and_package = forbidden
from atom_runtime import LLM, SamplingParams
llm = LLM(sys.argv[1])
outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
from torch._dynamo.utils import counters
frames = sum(counters["frames"].values())
print(json.dumps({{"tokens": [o.outputs[0].token_ids for o in outs], "dynamo_frames": frames}}))
"""


def test_fresh_process_loads_without_compiling(llama_artifact, tmp_path):
    """Round trip: exported here, loaded in a new process with empty caches and a logging compiler shim."""
    moved = tmp_path / "moved-artifact"
    shutil.copytree(llama_artifact, moved)  # and the artifact still loads from elsewhere
    shim_dir, log = tmp_path / "shim", tmp_path / "compiler.log"
    shim_dir.mkdir()
    for name in ("gcc", "g++", "cc", "c++", "clang", "clang++"):
        real = shutil.which(name)
        if real:
            (shim_dir / name).write_text(SHIM.format(real=real, log=log))
            (shim_dir / name).chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{shim_dir}:{os.environ['PATH']}",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
        TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
    )
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD.format(prompts=PROMPTS)))
    run = subprocess.run([sys.executable, str(script), str(moved)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert not log.exists(), f"the C++ compiler ran while loading: {log.read_text()}"
    assert result["dynamo_frames"] == 0
    assert result["tokens"] == tokens(llama_artifact)


@pytest.fixture(scope="module")
def eager_artifact(tmp_path_factory, tiny_llama) -> tuple[Path, Path]:
    """A level-0 artifact (no Inductor: quick to export) over its own copy of the checkpoint."""
    root = tmp_path_factory.mktemp("eager")
    checkpoint = root / "checkpoint"
    shutil.copytree(tiny_llama, checkpoint)
    ac.export(checkpoint, root / "artifact", device="cpu", level=0)
    return root / "artifact", checkpoint


@pytest.fixture
def artifact_copy(eager_artifact, tmp_path) -> Path:
    target = tmp_path / "artifact"
    shutil.copytree(eager_artifact[0], target)
    return target


def edit_manifest(path: Path, **fields) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(fields)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_cpu_pieces_multiply_without_calling_back_into_python(llama_artifact):
    """On CPU the projections compile to Inductor's GEMMs, not to calls of the `atom.linear` op, which an
    AOTInductor package would make through Python (25-40 us a projection)."""
    import zipfile

    wrappers = []
    for package in (llama_artifact / "compiled").glob("*.pt2"):
        with zipfile.ZipFile(package) as archive:
            wrappers += [archive.read(n).decode() for n in archive.namelist() if n.endswith(".wrapper.cpp")]
    assert wrappers and any("mm_out(" in code for code in wrappers)
    assert not any("proxy_executor_call" in code for code in wrappers)


def test_level0_runs_eager_pieces(eager_artifact, tiny_llama):
    from atom_runtime.cuda_graphs import PiecewiseGraphs

    manifest = json.loads((eager_artifact[0] / "manifest.json").read_text())
    assert manifest["level"] == 0 and not any(p["compiled"] for p in manifest["pieces"].values())
    assert tokens(eager_artifact[0]) == tokens(tiny_llama, device="cpu")
    # Nothing compiled, nothing for piecewise graphs: not even the cache writes (their graphs would only add copies).
    model = ac.load_artifact(eager_artifact[0])
    assert PiecewiseGraphs(model, [4, 8], None, cache_writes=True).num_graphed == 0


def test_other_torch_version(artifact_copy):
    edit_manifest(artifact_copy, torch_version="2.0.0")
    here = re.escape(torch.__version__)
    with pytest.raises(ArtifactError, match=rf"torch_version is '2\.0\.0' in the artifact but '{here}'"):
        ac.load_artifact(artifact_copy)


def test_other_device_capability(artifact_copy):
    edit_manifest(artifact_copy, device_capability="x86_64-NEON")
    with pytest.raises(ArtifactError, match="device_capability is 'x86_64-NEON' in the artifact but"):
        ac.load_artifact(artifact_copy)


def test_other_format_version(artifact_copy):
    edit_manifest(artifact_copy, format_version=99)
    with pytest.raises(ArtifactError, match="format_version is 99 in the artifact"):
        ac.load_artifact(artifact_copy)


def test_missing_file(artifact_copy):
    (artifact_copy / "graphs" / "model.py").unlink()
    with pytest.raises(ArtifactError, match=r"artifact file graphs/model\.py is missing"):
        ac.load_artifact(artifact_copy)


def test_corrupted_file(artifact_copy):
    piece = next((artifact_copy / "graphs").glob("piece_*.py"))
    piece.write_text(piece.read_text() + "\n# edited\n")
    with pytest.raises(ArtifactError, match=rf"artifact file graphs/{piece.name} is corrupted"):
        ac.load_artifact(artifact_copy)


def test_not_an_artifact(tmp_path, eager_artifact):
    with pytest.raises(ArtifactError, match="is not an atom artifact"):
        ac.load_artifact(tmp_path)
    with pytest.raises(ArtifactError, match=f"{tmp_path / 'nothing'} does not exist"):
        ac.load_artifact(tmp_path / "nothing")
    with pytest.raises(ValueError, match="is an atom artifact, not a model directory"):
        ac.export(eager_artifact[0], tmp_path / "out", device="cpu", level=0)


def test_changed_weights_then_rebuild(eager_artifact, tmp_path):
    artifact, checkpoint = eager_artifact
    artifact = shutil.copytree(artifact, tmp_path / "artifact")
    changed = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, changed)
    edit_manifest(
        artifact, weights={**json.loads((artifact / "manifest.json").read_text())["weights"], "model_dir": str(changed)}
    )
    weights = load_file(changed / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match="the weights changed since export"):
        ac.load_artifact(artifact)
    rebuilt = ac.load_artifact(artifact, rebuild=True)
    assert torch.equal(rebuilt.weights["model.norm.weight"], weights["model.norm.weight"])
    ac.load_artifact(artifact)  # the rebuilt manifest now fits


def test_copied_weights_need_no_checkpoint(tiny_llama, tmp_path):
    checkpoint = shutil.copytree(tiny_llama, tmp_path / "checkpoint")
    ac.export(checkpoint, tmp_path / "artifact", device="cpu", level=0, weights="copy")
    shutil.rmtree(checkpoint)
    assert tokens(tmp_path / "artifact") == tokens(tiny_llama, device="cpu")
    edit_manifest(tmp_path / "artifact", torch_version="2.0.0")
    with pytest.raises(ArtifactError, match=f"cannot rebuild .*: its source {re.escape(str(checkpoint))} no longer"):
        ac.load_artifact(tmp_path / "artifact", rebuild=True)


def test_export_replaces_only_an_artifact(eager_artifact, tiny_llama, tmp_path):
    """An export never deletes what is not an artifact (the checkpoint itself, a user's files), and checks the output
    and max_model_len before it loads anything."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("x")
    checkpoint = shutil.copytree(tiny_llama, tmp_path / "checkpoint")
    for output in (mine, checkpoint, checkpoint / "config.json"):
        with pytest.raises(ValueError, match=f"output {re.escape(str(output))} (is a directory with files|exists and)"):
            ac.export(checkpoint, output, device="cpu", level=0)
    assert (mine / "thesis.txt").read_text() == "x" and (checkpoint / "model.safetensors").is_file()
    for bad, message in ((0, "max_model_len must be positive"), (10**6, "exceeds the model's max_position_embeddings")):
        with pytest.raises(ValueError, match=message):
            ac.export(checkpoint, tmp_path / "never", device="cpu", level=0, max_model_len=bad)
    assert not (tmp_path / "never").exists()
    again = shutil.copytree(eager_artifact[0], tmp_path / "again")  # an artifact is replaced
    ac.export(checkpoint, again, device="cpu", level=0)
    assert json.loads((again / "manifest.json").read_text())["weights"]["model_dir"] == str(checkpoint)


def test_export_leaves_no_model_behind(tiny_llama, tmp_path, monkeypatch):
    """An export's FX graphs are cyclic, so the model they hold (its weights on the export device: 13 GiB of a
    Llama-3-8B) would wait for the collector, and a caller's next allocation with it: export runs it first."""
    export_module = importlib.import_module("atom_compile.export")
    build_model, built = export_module.build_model, []

    def recording_build(*args, **kwargs):
        model = build_model(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(export_module, "build_model", recording_build)
    gc.disable()  # only export's own collection may free it
    try:
        ac.export(tiny_llama, tmp_path / "artifact", device="cpu", level=0)
    finally:
        gc.enable()
    assert len(built) == 1 and built[0]() is None


def test_dummy_weights_rebuild_from_their_config(tiny_llama, tmp_path):
    """Every weights mode records its source, so `--rebuild` can re-export any artifact (here one made by an older
    atom, with an export option since removed)."""
    artifact = tmp_path / "new" / "dir" / "artifact"  # export makes the parents
    ac.export(tiny_llama, artifact, device="cpu", level=0, load_dummy=True)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["weights"] == {"mode": "dummy", "model_dir": str(tiny_llama.resolve())}
    edit_manifest(artifact, torch_version="2.0.0", export_options={**manifest["export_options"], "max_num_seqs": 8})
    rebuilt = ac.load_artifact(artifact, rebuild=True)
    assert rebuilt.manifest["torch_version"] == torch.__version__


def test_cli_export_show_and_errors(tiny_llama, tmp_path, capsys, monkeypatch):
    assert (
        compile_cli(
            [
                "export",
                str(tiny_llama),
                "-o",
                str(tmp_path / "a"),
                "--device",
                "cpu",
                "--level",
                "0",
                "--passes=-rope_cache",
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == [
        "rms_norm_quant",
        "silu_mul_quant",
        "fp8_linear",
        "rms_norm_linear",
        "silu_mul_linear",
        "gated_mlp",
        "final_norm_rows",
        "qk_norm_rope_cache",
        "qkv_rope_cache",
        "cleanup",
    ]
    capsys.readouterr()
    assert compile_cli(["show", str(tmp_path / "a")]) == 0
    shown = capsys.readouterr().out
    assert "atom.unified_attention×1" in shown and "passes:" in shown and "def forward" in shown
    if importlib.util.find_spec("pydot") is None:  # graphviz's `dot` alone is not enough for --svg: one line too
        monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
        assert compile_cli(["show", str(tmp_path / "a"), "--svg", str(tmp_path / "piece.svg")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("atom-compile: error: --svg needs pydot and graphviz") and err.count("\n") == 1, err
        monkeypatch.undo()
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    for model_dir, flags, message in [
        (tmp_path / "missing", [], "model directory"),
        (tmp_path / "empty", [], "has no config.json"),
        (tmp_path / "broken", [], "config.json could not be read"),
        (tiny_llama, ["--device", "tpu"], "unknown device 'tpu'"),
        (tiny_llama, ["--device", "meta"], "unknown device 'meta'"),
    ]:
        assert compile_cli(["export", str(model_dir), "-o", str(tmp_path / "b"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("atom-compile: error: ") and message in err, err
    assert compile_cli(["export", str(tiny_llama), "-o", str(tmp_path / "b"), "--passes", "+nope"]) == 2
    assert "unknown pass 'nope'" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert compile_cli(["export", str(tiny_llama), "-o", str(tmp_path / "file" / "b"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err  # an OSError other than FileNotFoundError: one line too, not a traceback
    assert err.count("\n") == 1 and err.startswith("atom-compile: error: ") and "File exists" in err, err


def test_export_and_trace_stay_functions_after_their_submodules_load():
    """atom_compile loads its submodules lazily; importing `atom_compile.export` / `.trace` later must not replace the
    package's `export()` / `trace()` functions with those modules."""
    code = (
        "import inspect\n"
        "import atom_compile as ac\n"
        "import atom_compile.export, atom_compile.load, atom_compile.trace\n"
        "assert inspect.isfunction(ac.export) and inspect.isfunction(ac.trace), (ac.export, ac.trace)\n"
        "assert {'load_artifact', 'export', 'trace'} <= set(dir(ac))\n"
    )
    run_fresh_python(code)
