"""`atom-run`: generate equals the offline API, serve answers over HTTP, and bad input is one line with exit 2."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from atom_compile.options import DTYPE_NAMES
from atom_models.loader import DTYPES
from atom_runtime import LLM, EngineConfig, SamplingParams
from atom_runtime.cli import build_parser, check_listen_address, main
from atom_runtime.engine_args import create_engine_kwargs
from atom_runtime.loading import served_block_size
from tests.helpers import run_fresh_python


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["atom-run", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", block_size=4, seed=5)
    yield llm
    llm.shutdown()


def test_generate_json_equals_llm(tiny_llama, llm):
    run = run_cli(
        "generate", str(tiny_llama), "--prompt", "Hello, world", "--max-tokens", "12", "--temperature", "0.8",
        "--seed", "5", "--block-size", "4", "--device", "cpu", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert set(got) == {"text", "token_ids", "finish_reason"}
    expected = llm.generate("Hello, world", SamplingParams(temperature=0.8, max_tokens=12, seed=5))[0].outputs[0]
    assert got == {"text": expected.text, "token_ids": expected.token_ids, "finish_reason": expected.finish_reason}


def test_generate_token_ids_in_process(tiny_llama, llm, capsys):
    argv = ["generate", str(tiny_llama), "--prompt-token-ids", "72,101,108", "--max-tokens", "6", "--temperature", "0"]
    expected = llm.generate(
        prompt_token_ids=[72, 101, 108], sampling_params=SamplingParams(temperature=0, max_tokens=6)
    )
    main(argv + ["--json"])
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected[0].outputs[0].token_ids
    main(argv)
    assert capsys.readouterr().out == expected[0].outputs[0].text + "\n"


def test_a_refused_prompt_leaves_no_request_running(llm):
    """LLM.generate raises for a prompt the engine refuses, and the batch's other prompts stop with it (they kept
    generating in the engine, ahead of the next call's, and their tasks waited in the LLM's event loop)."""
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    with pytest.raises(ValueError, match="the prompt has 2000 tokens"):
        llm.generate(prompt_token_ids=[[5, 6, 7], [5] * 2000], sampling_params=params)
    assert not asyncio.all_tasks(llm._loop)
    assert llm._loop.run_until_complete(llm.engine.call_in_core(lambda core: len(core.sequences))) == 0


def test_an_interrupted_generate_leaves_no_request_running(llm):
    """Ctrl-C in LLM.generate (a notebook's interrupt) stops its requests too."""

    def interrupt() -> None:
        raise KeyboardInterrupt

    llm._loop.call_later(0.5, interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hello"] * 16, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    assert not asyncio.all_tasks(llm._loop)
    assert llm._loop.run_until_complete(llm.engine.call_in_core(lambda core: len(core.sequences))) == 0


def test_generate_stop_and_ignore_eos(tiny_llama, llm, capsys):
    argv = ["generate", str(tiny_llama), "--prompt", "Hello", "--max-tokens", "12", "--temperature", "0", "--json"]
    main([*argv, "--ignore-eos"])
    text = json.loads(capsys.readouterr().out)["text"]
    stop = text[4:6]  # a piece of what greedy decoding writes
    main([*argv, "--ignore-eos", "--stop", "no such text", "--stop", stop])
    got = json.loads(capsys.readouterr().out)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["no such text", stop])
    expected = llm.generate("Hello", params)[0].outputs[0]
    assert got["finish_reason"] == "stop" and got["text"] == expected.text == text[: text.index(stop)]


def test_generate_top_k_1_is_greedy(tiny_llama, capsys):
    argv = ["generate", str(tiny_llama), "--prompt", "Hello", "--max-tokens", "8", "--json"]
    main([*argv, "--temperature", "0"])
    greedy = json.loads(capsys.readouterr().out)["token_ids"]
    main([*argv, "--temperature", "1.5", "--top-k", "1", "--seed", "3"])
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy
    main([*argv, "--temperature", "1.5", "--top-p", "1e-6", "--seed", "3"])
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy


def test_generate_writes_profile(tiny_llama, tmp_path, capsys):
    main(["generate", str(tiny_llama), "--prompt", "hi", "--max-tokens", "2", "--torch-profiler-dir", str(tmp_path)])
    assert list(tmp_path.glob("*.pt.trace.json.gz"))
    assert "trace written to" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "/no/such/model", "--prompt", "x"], "does not exist"),
        (["generate", "{model}"], "one of the arguments --prompt --prompt-token-ids is required"),
        (["generate", "{model}", "--prompt", "x", "--prompt-token-ids", "1"], "not allowed with argument"),
        (["generate", "{model}", "--prompt-token-ids", "1,x"], "comma-separated integers"),
        (["generate", "{model}", "--prompt", "x", "--max-tokens", "0"], "max_tokens must be at least 1"),
        (["generate", "{model}", "--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
        (["generate", "{model}", "--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "{model}", "--prompt", "x", "--block-size", "0"], "block_size must be positive"),
        (["generate", "{model}", "--prompt", "x", "--kv-cache-dtype", "int3"], "invalid choice: 'int3'"),
        (["generate", "{model}", "--prompt", "x", "--max-model-len", "99999"], "exceeds the model's"),
        (["generate", "{model}", "--prompt", "x", "--max-model-len", "0"], "max_model_len must be positive"),
        (["serve", "{model}", "--max-logprobs", "-1"], "max_logprobs must be >= 0"),
        (["serve", "{model}", "--chat-template", "nope.jinja"], "chat template 'nope.jinja': no such file"),
        (["serve", "{model}", "--chat-template", "{{% for %}}"], "chat template: "),  # (format: {% for %})
        (["generate", "{model}", "--prompt", "x" * 20, "--max-model-len", "16"], "the prompt has 20 tokens"),
        (["generate", "{model}", "--prompt-token-ids", "5000"], "outside the vocabulary"),
        (["serve", "{model}", "--port", "http"], "invalid int value: 'http'"),
        (["serve", "{model}", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["serve", "{model}", "--tool-call-parser", "mistral"], "invalid choice: 'mistral'"),
        (["serve", "{model}", "--reasoning-parser", "o1"], "invalid choice: 'o1'"),
        (["serve", "{model}", "--port", "70000"], "a port is 0-65535, got 70000"),
        (["generate", "{model}", "--prompt", "x", "--cpu-kvcache-space-gib", "0"], "cpu_kvcache_space_gib must be"),
        (["generate", "{model}", "--prompt", "x", "--cpu-kvcache-space-gib", "inf"], "cpu_kvcache_space_gib must be"),
        (["generate", "{model}", "--prompt", "x", "--cpu-kvcache-space-gib", "nan"], "cpu_kvcache_space_gib must be"),
        (["generate", "{model}", "--prompt", "x", "--dtype", "half-ish"], "invalid choice: 'half-ish'"),
        (["generate", "{model}", "--prompt", "x", "--device", "tpu"], "unknown device 'tpu'"),
        (["launch", "{model}"], "invalid choice: 'launch'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_llama, capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main([a.format(model=tiny_llama) for a in args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    *before, last = err.strip().splitlines()  # before: progress bars of weight loading, if it got that far
    assert last.startswith("atom-run") and ": error: " in last and message in last
    assert "Traceback" not in err and not any("error" in line for line in before)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "--prompt", "x", "--max-num-seqs", "0"], "max_num_seqs and max_num_batched_tokens must be"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
        (["serve", "--gpu-memory-utilization", "2"], "gpu_memory_utilization must be in (0, 1]"),
    ],
)
def test_bad_flags_fail_before_the_demo_model_exports(monkeypatch, capsys, args, message):
    import atom_runtime.default_model

    def export(*args, **kwargs):
        raise AssertionError("the demo model was exported before the flags were checked")

    monkeypatch.setattr(atom_runtime.default_model, "default_artifact", export)
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and err.startswith("atom-run: error: ") and message in err


def test_an_artifact_for_another_machine_is_one_line(tiny_llama, tmp_path, capsys):
    import atom_compile

    atom_compile.export(tiny_llama, tmp_path / "artifact", device="cpu", level=0)
    manifest = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    (tmp_path / "artifact" / "manifest.json").write_text(json.dumps({**manifest, "torch_version": "2.0.0"}))
    with pytest.raises(SystemExit) as info:
        main(["generate", str(tmp_path / "artifact"), "--prompt", "x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("atom-run: error: artifact mismatch")
    assert "torch_version is '2.0.0' in the artifact" in err


def test_an_artifact_serves_its_own_block_size(tmp_path):
    cpu, gpu = {"device": "cpu", "block_size": 32}, {"device": "cuda:0", "block_size": 32}
    assert served_block_size(None, gpu, tmp_path) == 32 and served_block_size(32, gpu, tmp_path) == 32
    assert served_block_size(None, {"device": "cpu"}, tmp_path) == 16  # exported before the manifest said
    assert served_block_size(8, cpu, tmp_path) == 8  # no kernels compiled for it on CPU
    with pytest.raises(ValueError, match="its GPU kernels for block size 32; .* re-export it with --block-size 8"):
        served_block_size(8, gpu, tmp_path)


def test_serve_on_a_port_in_use_fails_before_loading(tiny_llama, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(SystemExit) as info:
            main(["serve", str(tiny_llama), "--host", "127.0.0.1", "--port", str(port)])
    assert info.value.code == 2 and time.monotonic() - started < 2  # the model never loaded
    expected = f"atom-run: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert capsys.readouterr().err.strip() == expected


def test_listen_address_check_binds_what_uvicorn_binds():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host in ("", "0.0.0.0"):  # "": every address, as asyncio's create_server takes it
            with pytest.raises(ValueError, match=f"cannot listen on {host}:{port}: Address already in use"):
                check_listen_address(host, port)
    check_listen_address("", port)  # free again
    with pytest.raises(ValueError, match="cannot listen on no-such-host.invalid:"):
        check_listen_address("no-such-host.invalid", port)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA device is there")
def test_cuda_without_a_gpu_is_one_line(tiny_llama, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", str(tiny_llama), "--prompt", "x", "--device", "cuda"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith("device 'cuda' was asked for, but torch sees no CUDA device")


def test_bad_input_from_the_console_script(tiny_llama):
    run = run_cli("generate", str(tiny_llama), "--prompt", "x", "--max-tokens", "-3")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == "atom-run: error: max_tokens must be at least 1, got -3"
    assert "Traceback" not in run.stderr


def test_flags_parse_without_torch():
    """--help and bad flags of both CLIs answer before torch imports (it takes seconds), with the loader's dtype
    names."""
    code = (
        "import sys\n"
        "from atom_compile import cli as compile_cli\n"
        "from atom_runtime import cli as run_cli\n"
        "run_cli.build_parser().parse_args(['serve', '--dtype', 'bfloat16', '--port', '8001'])\n"
        "compile_cli.build_parser().parse_args(['export', 'm', '-o', 'a', '--dtype', 'float16', '--level', '0'])\n"
        "assert 'torch' not in sys.modules, 'parsing imported torch'\n"
    )
    run_fresh_python(code)
    assert set(DTYPE_NAMES) == set(DTYPES)


def test_dtype_takes_vllms_spellings():
    from atom_compile import cli as compile_cli
    from atom_runtime import cli as run_cli

    assert run_cli.build_parser().parse_args(["serve", "--dtype", "half"]).dtype == "float16"
    assert compile_cli.build_parser().parse_args(["export", "m", "-o", "a", "--dtype", "float"]).dtype == "float32"


def test_engine_flags_cover_engine_config(tiny_llama):
    """Each EngineConfig field is a flag, and flags reach the config."""
    args = build_parser().parse_args(
        ["serve", str(tiny_llama), "--max-model-len", "256", "--max-num-seqs", "3", "--max-num-batched-tokens", "64"]
        + ["--block-size", "8", "--gpu-memory-utilization", "0.5", "--num-kvcache-blocks", "7"]
        + ["--cpu-kvcache-space-gib", "0.25", "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8"]
        + ["--max-logprobs", "5", "--enforce-eager", "--seed", "9", "--dtype", "float32", "--device", "cpu"]
        + ["--load-dummy", "--quantization", "fp8", "--rebuild", "--cudagraph-mode", "none"]
        + ["--cudagraph-capture-sizes", "[1,2,4]", "--quantization-exclude", "a.*", "--quantization-exclude", "re:b"]
        + ["--generation-config", "vllm"]
    )
    kwargs = create_engine_kwargs(args)
    assert kwargs["config"] == EngineConfig(
        max_model_len=256,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        block_size=8,
        gpu_memory_utilization=0.5,
        num_kvcache_blocks=7,
        cpu_kvcache_space_gib=0.25,
        enable_prefix_caching=False,
        kv_cache_dtype="fp8",
        max_logprobs=5,
        enforce_eager=True,
        cudagraph_mode="NONE",
        cudagraph_capture_sizes=[1, 2, 4],
        seed=9,
    )
    assert {k: v for k, v in kwargs.items() if k != "config"} == dict(
        dtype="float32",
        device="cpu",
        load_dummy=True,
        quantization="fp8",
        quantization_exclude=("a.*", "re:b"),
        rebuild=True,
        generation_config="vllm",
    )
    defaults = create_engine_kwargs(build_parser().parse_args(["serve", str(tiny_llama)]))["config"]
    assert defaults == EngineConfig()
    assert EngineConfig(seed=None) == EngineConfig()  # vLLM's LLM(..., seed=None)
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= set(vars(args))


def start_server(model: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """`atom-run serve` on a free port, once it answers /health."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        ["atom-run", "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert server.poll() is None, server.stdout.read()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)


def engine_process(server: subprocess.Popen) -> int:
    """The pid of the server's engine-core process (multiprocessing also starts a resource tracker)."""
    children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
    engines = [pid for pid in children if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(engines) == 1, engines
    return int(engines[0])


def assert_exits(pid: int, timeout: float = 15.0) -> None:
    def running() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + timeout
    while running():
        assert time.monotonic() < deadline, f"the engine process {pid} outlived its server"
        time.sleep(0.1)


def test_serve(tiny_llama, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    server, url = start_server(
        tiny_llama, "--api-key", "k", "--served-model-name", "tiny-served", "--max-num-seqs", "4",
        "--uvicorn-log-level", "warning", "--chat-template", str(template),
    )  # fmt: skip
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"] == "tiny-served"
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            headers=headers,
            json={"model": "tiny-served", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1
        rendered = {"model": "tiny-served", "prompt": "<hi>", "add_special_tokens": False}
        tokens = httpx.post(f"{url}/tokenize", headers=headers, json=rendered).json()["count"]
        assert chat.json()["usage"]["prompt_tokens"] == tokens  # --chat-template's rendering, not the model's
        engine = engine_process(server)
    finally:
        os.kill(server.pid, signal.SIGINT)
        server.wait(timeout=30)
    assert server.returncode == 0
    assert_exits(engine)


def test_server_exits_when_its_engine_dies(tiny_llama):
    """A server whose engine died could only answer 503: it exits (status 1), as vLLM's does, for a supervisor to
    restart it."""
    server, url = start_server(tiny_llama)
    try:
        os.kill(engine_process(server), signal.SIGKILL)
        server.wait(timeout=30)
    finally:
        server.kill()
    assert server.returncode == 1
    assert "the engine stopped after an error: the server shuts down" in server.stdout.read()


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)])
def test_stopped_server_leaves_no_engine_process(tiny_llama, sig, status):
    """SIGTERM shuts the engine down before the server exits; after SIGKILL the engine notices and stops."""
    server, _ = start_server(tiny_llama, "--uvicorn-log-level", "warning")
    try:
        engine = engine_process(server)
    finally:
        os.kill(server.pid, sig)
        server.wait(timeout=30)
    assert server.returncode == status
    assert_exits(engine)


def test_an_artifact_takes_the_export_settings_it_has(llama_artifact):
    """A vLLM user's --dtype (or --device) out of habit: what the artifact was exported with passes, anything else is
    refused naming both, as only a re-export changes it."""
    from atom_runtime.loading import _refuse_overrides

    manifest = json.loads((llama_artifact / "manifest.json").read_text())
    _refuse_overrides(llama_artifact, dtype=manifest["dtype"], device="cpu", quantization=None, load_dummy=False)
    _refuse_overrides(llama_artifact, dtype=getattr(torch, manifest["dtype"]), device="cpu:0")
    other = "float16" if manifest["dtype"] != "float16" else "bfloat16"
    with pytest.raises(ValueError, match=f"dtype '{other}' \\(exported with '{manifest['dtype']}'\\)"):
        _refuse_overrides(llama_artifact, dtype=other)
    with pytest.raises(ValueError, match="device 'cuda:0' \\(exported with 'cpu'\\)"):
        _refuse_overrides(llama_artifact, device="cuda:0")
    with pytest.raises(ValueError, match="device 'cpu:1'"):  # another index is another device
        _refuse_overrides(llama_artifact, device="cpu:1")
