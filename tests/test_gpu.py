"""On a CUDA device: artifacts export with Triton kernels inside, serve compiling nothing, and match eager."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import atom_compile as ac
from atom_runtime import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["Hello there", "The quick brown fox", "x", "a b c d e f g h i j k l m n o p q r s t u v w x y z"]

CHILD = """
import inspect, json, sys
import triton.compiler.compiler as compiler

compiles, keys = [], {{}}
make_ir = compiler.ASTSource.make_ir
def counting_make_ir(self, *args, **kwargs):
    compiles.append(f"{{self.fn.__name__}} {{self.signature}} {{self.constants}} {{self.attrs}}")
    return make_ir(self, *args, **kwargs)
compiler.ASTSource.make_ir = counting_make_ir
get_cache_key = compiler.get_cache_key
def recording_get_cache_key(*args, **kwargs):
    src, backend, options, env_vars = inspect.signature(get_cache_key).bind(*args, **kwargs).arguments.values()
    keys[f"{{src.fn.__name__}} {{src.signature}} {{src.constants}} {{src.attrs}}"] = dict(
        src=src.hash(), backend=backend.hash(), env=str(sorted(env_vars.items())),
        **{{f"option {{k}}": str(v) for k, v in vars(options).items()}})
    return get_cache_key(*args, **kwargs)
compiler.get_cache_key = recording_get_cache_key

from atom_runtime import LLM, SamplingParams, cuda_graphs
# A short batch-1 graph for contexts below 58 tokens (4 blocks of 16): the long prompt alone (51 tokens) decodes through
# it, then through the full batch-1 graph.
cuda_graphs.SHORT_CONTEXT = 58
replayed = set()
replay = cuda_graphs.FullGraphs.replay
def recording_replay(self, key):
    replayed.add((key.size, key.table_blocks or 0))
    return replay(self, key)
cuda_graphs.FullGraphs.replay = recording_replay
# 8-token steps: the long prompt prefills in chunks, beside the others' decodes (piecewise graphs)
llm = LLM(sys.argv[1], cudagraph_capture_sizes=[1, 2, 4, 8], max_num_batched_tokens=8, kv_cache_dtype=sys.argv[2])
runner = llm.engine.core.runner
outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
replayed.clear()  # the lone prompt's replays alone
lone = llm.generate({prompts!r}[-1:], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
import os, pathlib
cache = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
groups = sorted(str(g.relative_to(cache)) for g in cache.glob("*/__grp__*"))
print(json.dumps({{"tokens": [o.outputs[0].token_ids for o in outs], "compiled": compiles, "cache_groups": groups,
                  "lone": lone[0].outputs[0].token_ids, "keys": {{c: keys.get(c) for c in compiles}},
                  "graphs": sorted((k.size, k.table_blocks or 0) for k in runner.graphs.graphs),
                  "replayed": sorted(replayed), "piecewise": runner.piecewise.num_graphed}}))
"""


@pytest.mark.parametrize(
    "checkpoint_name,quantization,kv_cache_dtype,block_size",
    [
        ("llama-gqa2-tied", None, "auto", 16),
        ("llama-gqa2-tied", None, "auto", 32),  # exported for another block size, which serving then takes
        ("qwen3", None, "auto", 16),
        ("llama-gqa2-tied", "fp8", "auto", 16),
        ("qwen3-headdim64", "fp8", "fp8_per_token_head", 16),  # a head wide enough for a block's scales in one slot
    ],
)
def test_cuda_artifact_serves_without_compiling(
    checkpoint_name, quantization, kv_cache_dtype, block_size, make_checkpoint, tmp_path, monkeypatch
):
    import triton.compiler.compiler as compiler

    exported, export_keys = [], {}  # what the export compiled, and its cache-key parts, to compare with serving's
    make_ir, get_cache_key = compiler.ASTSource.make_ir, compiler.get_cache_key

    def recording_make_ir(self, *args, **kwargs):
        exported.append(f"{self.fn.__name__} {self.signature} {self.constants} {self.attrs}")
        return make_ir(self, *args, **kwargs)

    def recording_get_cache_key(*args, **kwargs):
        src, backend, options, env_vars = inspect.signature(get_cache_key).bind(*args, **kwargs).arguments.values()
        export_keys[f"{src.fn.__name__} {src.signature} {src.constants} {src.attrs}"] = dict(
            src=src.hash(),
            backend=backend.hash(),
            env=str(sorted(env_vars.items())),
            **{f"option {k}": str(v) for k, v in vars(options).items()},
        )
        return get_cache_key(*args, **kwargs)

    monkeypatch.setattr(compiler.ASTSource, "make_ir", recording_make_ir)
    monkeypatch.setattr(compiler, "get_cache_key", recording_get_cache_key)
    checkpoint = make_checkpoint(checkpoint_name)
    artifact = tmp_path / "artifact"
    ac.export(checkpoint, artifact, device="cuda", level=3, quantization=quantization, block_size=block_size)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["ops_backend"] == "triton" and manifest["device_capability"].startswith("sm_")
    assert (artifact / "triton_cache").is_dir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD.format(prompts=PROMPTS)))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ic"), TRITON_CACHE_DIR=str(tmp_path / "tc"))
    run = subprocess.run(
        [sys.executable, str(script), str(artifact), kv_cache_dtype], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    short = -(-58 // block_size)  # the child's SHORT_CONTEXT in blocks
    assert result["graphs"] == [[1, 0], [1, short], [2, 0], [4, 0], [8, 0]] and result["piecewise"] > 0
    assert result["replayed"] == [[1, 0], [1, short]]  # the lone prompt took the short batch-1 graph, then the full
    shipped = sorted(
        str(g.relative_to(artifact / "triton_cache")) for g in (artifact / "triton_cache").glob("*/__grp__*")
    )
    key_differences = {
        kernel.split(" ")[0]: {
            part: (export_keys.get(kernel, {}).get(part), value)
            for part, value in (serving or {}).items()
            if export_keys.get(kernel, {}).get(part) != value
        }
        for kernel, serving in result["keys"].items()
    }
    assert result["compiled"] == [], (
        f"Triton compiled kernels while serving: {len(result['compiled'])}; cache-key parts that differ from the "
        f"export's (export, serving): {key_differences}\nshipped kernel groups: {shipped}\n"
        f"serving cache groups: {result['cache_groups']}"
    )
    # The same 8-token steps as the child: FP8 rounds each token's activations, so a token whose inputs differ
    # in the last bit (other kernels at other batch compositions) can land on the other side of an e4m3
    # boundary, and greedy tokens of this random model then part ways (bf16 ones agree at any composition;
    # FP8 ones of one prompt parted at its fifth token between 8-token and whole-prompt steps, H100).
    eager = LLM(
        checkpoint,
        device="cuda",
        enforce_eager=True,
        num_kvcache_blocks=256,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=8,
        block_size=block_size,
    )
    try:
        expected = eager.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    finally:
        eager.shutdown()
    expected = [o.outputs[0].token_ids for o in expected]
    if quantization is None:
        assert result["tokens"] == expected and result["lone"] == expected[-1]
    else:  # graphs pad batches (presumably other split-K/split-KV partitions): last bits that e4m3 can amplify
        pairs = zip([*result["tokens"], result["lone"]], [*expected, expected[-1]], strict=True)
        agree = [a == b for served, reference in pairs for a, b in zip(served, reference, strict=True)]
        assert [t[:8] for t in result["tokens"]] == [t[:8] for t in expected] and sum(agree) >= 0.9 * len(agree)
