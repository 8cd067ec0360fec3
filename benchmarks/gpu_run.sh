#!/usr/bin/env bash
# One call on the GPU host: install the carried wheels, then run the named stages, logs under $OUT.
#   run(command="bash benchmarks/gpu_run.sh tests decode-small", carry=[".whl"])
# Stages: tests (GPU tests), kernel-tests, inductor-pdl (Inductor's kernels with PDL; at 5055e01 serving compiled two of them, so not adopted), gemm (bf16 decode GEMMs: cuBLAS vs the skinny kernel, with a sweep), fp8 (FP8 GEMMs and decode), fp8-offline (bf16 vs FP8 offline throughput), kernels (kernel benchmark; KERNELS_ONLY=decode, KERNELS_SWEEP=1, KERNELS_FP8_KV=1), ncu (Nsight Compute on profile_kernels.py's cases), layer (bench_layer.py: whole decoder layers and their parts in CUDA graphs; LAYER_PRESET, LAYER_QUANT=fp8), decode-small (Qwen3-0.6B), decode-8b (Llama-3-8B),
#         offline-8b (Llama-3-8B, 1000 x 1024/1024; OFFLINE_BUDGET: max_num_batched_tokens, OFFLINE_MODE: cudagraph mode, OFFLINE_KINDS=1: time by kind of step), profile-8b (profile_steps.py on Llama-3-8B), offline-small, serving (benchmark_serving.py against atom-run serve), export (export time 2 vs 28 layers),
#         train-demo (the demo model, to $OUT/demo.tar.part-*; needs carry demo_corpus/{train,valid,chat}.txt,
#         corpus.json, LICENSE-PSF.txt).
set -o pipefail
OUT=${OUT:-/tmp/atom-out}
mkdir -p "$OUT"
# The carried wheels, unless this machine has them already (a second install rewrites files a process beside may be
# importing).
wheels=$(cd .whl 2>/dev/null && ls *.whl | md5sum)
if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null \
    && echo "$wheels" > /tmp/site/.wheels
fi
# A crash leaves every thread's Python stack in the stage's log (three runs have died by SIGSEGV without one).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for stage in "$@"; do
  echo "=== $stage (at ${SECONDS}s)"
  case $stage in
    tests) python3 -m pytest -q tests/test_gpu.py tests/test_runner.py 2>&1 \
             | grep -v Warning | tee "$OUT/tests.log" | tail -25 ;;
    kernel-tests) python3 -m pytest -q tests/test_triton_kernels.py tests/test_fp8_kernels.py 2>&1 | tail -5 ;;
    fp8) python3 benchmarks/bench_fp8.py --stages gemm decode --out "$OUT/fp8.json" 2>&1 | grep -v Warning | tail -30 ;;
    fp8-offline) python3 benchmarks/bench_fp8.py --stages offline --offline-prompts ${OFFLINE_PROMPTS:-400} --out "$OUT/fp8-offline.json" 2>&1 | grep -v Warning | tail -12 ;;
    gemm) python3 -m pytest -q tests/test_triton_kernels.py -k linear 2>&1 | tail -2
      python3 benchmarks/bench_gemm.py --presets ${GEMM_PRESETS:-llama-3-8b qwen3-0.6b} --ms ${GEMM_MS:-1 8 16} \
        --sweep --sweep-ms ${SWEEP_MS:-1 8} --out "$OUT/gemm.json" 2>&1 \
        | grep -v -e Warning -e "M=" | tee "$OUT/gemm.log" | tail -80 ;;
    kernels) python3 benchmarks/bench_kernels.py ${KERNELS_SWEEP:+--sweep} ${KERNELS_FP8_KV:+--fp8-kv} ${KERNELS_ONLY:+--only $KERNELS_ONLY} --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -30 ;;
    ncu)  # Nsight Compute on one warm launch of each case of profile_kernels.py (NCU_CASES: some of them)
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | tail -1)
      for case in ${NCU_CASES:-$(python3 benchmarks/profile_kernels.py --list)}; do
        echo "##### $case"
        "$ncu" --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
          --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
          -k regex:"_attention_kernel|_skinny_mm_kernel" --launch-skip 1 --launch-count 1 \
          python3 benchmarks/profile_kernels.py "$case" 2>&1 | grep -v -e "^==PROF==" -e Warning
      done > "$OUT/ncu.txt"; grep -e "#####" -e "Duration" -e "Achieved Occupancy" -e "Registers Per" "$OUT/ncu.txt" ;;
    layer) python3 benchmarks/bench_layer.py --preset ${LAYER_PRESET:-qwen3-0.6b} ${LAYER_QUANT:+--quantization $LAYER_QUANT} \
             --out "$OUT/layer.json" 2>&1 | grep -v Warning | tail -8 ;;
    decode-small) python3 benchmarks/bench_decode.py --preset qwen3-0.6b --batch-sizes ${DECODE_BATCHES:-1 8 64 256} --context 400 --profile \
             ${DECODE_MAX_MODEL_LEN:+--max-model-len $DECODE_MAX_MODEL_LEN} --out "$OUT/decode-qwen3-0.6b.json" 2>&1 | grep -v -e Warning -e "it/s" | tail -15 ;;
    decode-8b) python3 benchmarks/bench_decode.py --preset llama-3-8b --batch-sizes ${DECODE_BATCHES:-1 8 64 256} --context 400 --profile \
             --out "$OUT/decode-llama-3-8b.json" 2>&1 | grep -v -e Warning -e "it/s" | tail -15 ;;
    offline-8b) python3 benchmarks/bench_offline.py --preset llama-3-8b --num-prompts 1000 --input-len 1024 \
             --output-len 1024 ${OFFLINE_BUDGET:+--max-num-batched-tokens $OFFLINE_BUDGET} \
             ${OFFLINE_MODE:+--cudagraph-mode $OFFLINE_MODE} ${OFFLINE_KINDS:+--step-kinds} --out "$OUT/offline-llama-3-8b.json" 2>&1 \
             | tr '\r' '\n' | grep -v -e Warning -e "it/s" -e "req/s" -e Capturing | tail -16 ;;
    profile-8b)  # the offline run's steady state, step by step (PROFILE_BUDGET, PROFILE_MODE, PROFILE_HOST=1)
      art=$(cd benchmarks && python3 -c "from pathlib import Path; from bench_common import dummy_artifact
print(dummy_artifact('llama-3-8b', Path('/tmp/profile'), 'cuda'))" | tail -1)
      python3 benchmarks/profile_steps.py --artifact "$art" --max-num-batched-tokens ${PROFILE_BUDGET:-512} \
        --num-prompts 400 --warm-steps 350 ${PROFILE_MODE:+--cudagraph-mode $PROFILE_MODE} ${PROFILE_HOST:+--host-profile} \
        --out "$OUT/profile-8b.json" 2>&1 | grep -v -e Warning -e Capturing | tail -60 ;;
    offline-small) python3 benchmarks/bench_offline.py --preset qwen3-0.6b --num-prompts 1000 --input-len 1024 \
             --output-len 1024 --out "$OUT/offline-qwen3-0.6b.json" 2>&1 | grep -v Warning | tail -8 ;;
    inductor-pdl)  # Inductor's own kernels with PDL too: does the artifact still serve without compiling, and the gain
      export TORCHINDUCTOR_ENABLE_PDL=1 TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0
      python3 -m pytest -q tests/test_gpu.py -k serves_without_compiling 2>&1 | tee "$OUT/inductor-pdl-tests.log" | tail -3
      python3 benchmarks/bench_decode.py --preset qwen3-0.6b --batch-sizes 1 8 --context 400 \
        --out "$OUT/decode-inductor-pdl.json" 2>&1 | grep -A4 "^decode,"
      unset TORCHINDUCTOR_ENABLE_PDL TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER ;;
    passes) python3 benchmarks/bench_passes.py --preset qwen3-0.6b --out "$OUT/passes.json" 2>&1 | grep -v Warning | tail -12 ;;
    isolation) art=$(cd benchmarks && python3 -c "from pathlib import Path; from bench_common import dummy_artifact
print(dummy_artifact('qwen3-0.6b', Path('/tmp/iso'), 'cuda'))" | tail -1)
      python3 benchmarks/bench_engine_isolation.py --model "$art" --out "$OUT/isolation.json" 2>&1 | tail -8 ;;
    serving) art=$(cd benchmarks && python3 -c "from pathlib import Path; from bench_common import dummy_artifact
print(dummy_artifact('${SERVING_PRESET:-llama-3-8b}', Path('/tmp/serving'), 'cuda'))" | tail -1)
      python3 -m atom_runtime serve "$art" --port 8011 --served-model-name m --disable-uvicorn-access-log \
        --uvicorn-log-level warning > "$OUT/serve.log" 2>&1 & server=$!
      for _ in $(seq 600); do  # until healthy, or the server has exited (then the benchmark's errors say so)
        [ "$(awk '{print $3}' /proc/$server/stat 2>/dev/null)" = Z ] || ! kill -0 $server 2>/dev/null \
          && { echo "the server exited; see serve.log"; break; }
        python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:8011/health').status_code != 200)" \
          2>/dev/null && break
        sleep 0.5
      done
      python3 benchmarks/benchmark_serving.py --backend openai --base-url http://127.0.0.1:8011 --model m \
        --tokenizer "$art" --dataset-name random --random-input-len 1024 --random-output-len 256 --num-prompts 500 \
        --ignore-eos --save-result --result-dir "$OUT" --result-filename serving.json 2>&1 | tail -25
      kill $server; wait $server ;;
    startup) python3 benchmarks/bench_startup.py --preset llama-3-8b --out "$OUT/startup.json" 2>&1 | grep -v -e Warning -e "it/s" | tail -6 ;;
    export) python3 benchmarks/bench_export.py --preset qwen3-0.6b --layers 2 28 --device cuda \
             --out "$OUT/export.json" 2>&1 | tail -6 ;;
    train-demo)  # the variant that won a side-by-side run of three (see atom_models/demo/README.md)
      python3 benchmarks/train_demo_model.py --corpus demo_corpus --out /tmp/demo --epochs 10 --num-hidden-layers 4 \
        --batch-size 32 --warmup-steps 100 --eval-every 50 --max-position-embeddings 512 2>&1 | tee "$OUT/train.log" | tail -3
      tar -C /tmp/demo -cf - . | split -b 15M - "$OUT/demo.tar.part-" ;;  # files come back at most 16 MiB each
    *) echo "unknown stage $stage" ;;
  esac
done
echo "=== done (at ${SECONDS}s)"
