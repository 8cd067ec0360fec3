"""First contact with a GPU host: export a tiny model on CUDA, load it in a fresh process, generate.

    python benchmarks/gpu_probe.py OUT_DIR

Prints whether the artifact loads and matches the eager model, and how long each part took.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, sys, time
t = time.perf_counter()
from atom_runtime import LLM, SamplingParams
llm = LLM(sys.argv[1])
load = time.perf_counter() - t
outs = llm.generate(["Hello there", "x", "The quick brown fox"], SamplingParams(temperature=0, max_tokens=16,
                    ignore_eos=True))
print(json.dumps({"load_s": load, "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for the tiny checkpoint and its artifact")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    import atom_compile
    from atom_models.checkpoints import make_random_checkpoint
    from atom_runtime import LLM, SamplingParams

    model = make_random_checkpoint(out / "tiny-llama", "tiny-llama", initializer_range=0.2)
    started = time.perf_counter()
    atom_compile.export(model, out / "artifact", device="cuda", level=3)
    export_s = time.perf_counter() - started
    eager = LLM(model, device="cuda", enforce_eager=True)
    expected = [
        o.outputs[0].token_ids
        for o in eager.generate(
            ["Hello there", "x", "The quick brown fox"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        )
    ]
    eager.shutdown()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(out / "ic"), TRITON_CACHE_DIR=str(out / "tc"))
    (out / "child.py").write_text(CHILD)
    run = subprocess.run(
        [sys.executable, str(out / "child.py"), str(out / "artifact")], env=env, capture_output=True, text=True
    )
    result = {"export_s": export_s, "child_rc": run.returncode, "child_stderr_tail": run.stderr[-2000:]}
    if run.returncode == 0:
        child = json.loads(run.stdout.strip().splitlines()[-1])
        result |= {"load_s": child["load_s"], "tokens_match": child["tokens"] == expected}
    triton_cache = out / "tc"
    result["triton_cache_entries_after_load"] = len(list(triton_cache.iterdir())) if triton_cache.exists() else 0
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
