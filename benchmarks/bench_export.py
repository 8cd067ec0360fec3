"""Export time against depth: identical layer pieces compile once, so 28 layers cost about what 2 do.

    python benchmarks/bench_export.py --preset qwen3-0.6b --layers 2 28 --device cuda
    python benchmarks/bench_export.py --preset tiny-llama --layers 2 28 --device cpu

Each export runs in a fresh process with empty Inductor and Triton caches, on random
(--load-dummy) weights of the preset's width. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import write_json

from atom_models.checkpoints import PRESETS, make_config_only


def export_once(preset: str, layers: int, device: str, level: int, work: Path) -> dict:
    model_dir = make_config_only(work / f"{preset}-{layers}", preset, num_hidden_layers=layers)
    artifact = work / f"artifact-{layers}"
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(work / f"inductor-{layers}"),
        TRITON_CACHE_DIR=str(work / f"triton-{layers}"),
    )
    command = [
        sys.executable,
        "-m",
        "atom_compile.cli",
        "export",
        str(model_dir),
        "-o",
        str(artifact),
        "--device",
        device,
        "--level",
        str(level),
        "--load-dummy",
    ]
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    manifest = json.loads((artifact / "manifest.json").read_text())
    compiled = {p["key"] for p in manifest["pieces"].values() if p["compiled"]}
    return {
        "layers": layers,
        "seconds": round(seconds, 2),
        "export_seconds_in_manifest": manifest["export_seconds"],
        "pieces": len(manifest["pieces"]),
        "compiled_pieces": len(compiled),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-llama", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 28])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--level", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_export.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [export_once(args.preset, n, args.device, args.level, Path(tmp)) for n in args.layers]
    base = rows[0]["seconds"]
    print(f"\nexport time, {args.preset} width, {args.device}, level {args.level}")
    print(f"{'layers':>7} {'seconds':>9} {'ratio':>7} {'pieces':>7} {'compiled':>9}")
    for row in rows:
        row["ratio_to_first"] = round(row["seconds"] / base, 3)
        print(
            f"{row['layers']:>7} {row['seconds']:>9.1f} {row['ratio_to_first']:>7.2f} {row['pieces']:>7} "
            f"{row['compiled_pieces']:>9}"
        )
    write_json(args.out, {"preset": args.preset, "export_device": args.device, "level": args.level, "rows": rows})


if __name__ == "__main__":
    main()
