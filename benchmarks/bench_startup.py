"""`atom-run serve` start to first token, for an artifact already on disk (warm page cache).

    python benchmarks/bench_startup.py --preset llama-3-8b

Exports the preset with random weights copied into the artifact (so loading reads real files),
reads the artifact once to warm the page cache, then starts `atom-run serve` and times: process
start → /health answers → first streamed token of a request. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx
from bench_common import device_name, print_table, served, write_json

import atom_compile
from atom_models.checkpoints import make_config_only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--out", type=Path, default=Path("bench_startup.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_config_only(Path(tmp) / "config", args.preset)
        artifact = Path(tmp) / "artifact"
        started = time.perf_counter()
        atom_compile.export(model_dir, artifact, device="cuda", dtype="bfloat16", load_dummy=True, weights="copy")
        export_s = time.perf_counter() - started
        for file in artifact.rglob("*"):  # warm disk: the page cache holds the artifact
            if file.is_file():
                with open(file, "rb") as f:
                    while f.read(1 << 26):
                        pass
        with served(artifact, timeout_s=600) as server:
            healthy_s = server.healthy_s
            body = {"model": "m", "prompt": "Hello", "max_tokens": 4, "stream": True, "temperature": 0}
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        break
            first_token_s = time.perf_counter() - server.started
        weight_bytes = sum(f.stat().st_size for f in (artifact / "weights").glob("*"))
    row = {
        "export_s": export_s,
        "healthy_s": healthy_s,
        "first_token_s": first_token_s,
        "weights_gb": weight_bytes / 1e9,
    }
    print_table(
        f"serve start to first token, {args.preset}, {device_name()}",
        [row],
        [
            ("weights_gb", "weights GB", ".1f"),
            ("export_s", "export s", ".1f"),
            ("healthy_s", "healthy s", ".1f"),
            ("first_token_s", "first token s", ".1f"),
        ],
    )
    write_json(args.out, {"preset": args.preset, **row})


if __name__ == "__main__":
    main()
