#!/usr/bin/env bash
# gpu-check.sh: the one prepared check of ampd's GPU path. On a GPU machine it
# runs every CUDA test, compute-sanitizer memcheck and racecheck on the
# kernels, the engine, optimizer and service benchmarks, and their PyTorch
# peers of the same shapes, each part under `timeout` and the whole inside
# --budget seconds, and writes one report (a table: workload, ampd, PyTorch,
# ratio) with every part's full log beside it.
#
# The parts run in order of what a short loan of a GPU is for: first the
# correctness of CUDA code that has never run (the CUDA suites, the sampler's
# ops, SampleInvariance on cuda:0), the sanitizers on the newest kernels and
# the end-to-end bitwise sampler/trainer check (examples/rl_fp16.py --check);
# then GPT-2 beside PyTorch eager and torch.compile, attention beside SDPA's
# flash backend, the decoder and its LoRA; then sampling; then the rest. A
# part that the budget ends (or never starts) is recorded as "cut", which is
# not a failure: nothing was found broken, the loan was spent. --device=cpu --quick runs the same parts end to end on
# tiny shapes, so CI keeps the script from rotting; parts that need a GPU say
# why they are skipped there.
#
# On a GPU machine, from a tree packed with scripts/gpu-pack.sh build/ci
# (../shared/tools/gpu-bundle, told the executables this check runs):
#   bash .gpu/run scripts/gpu-check.sh --out="$OUT" --pack
# (the Python parts' client, the ampd package with its generated stubs,
# travels in the bundle; without it grpc_tools makes the stubs there, and
# without either those parts are skipped, saying so). --parts=REGEX runs
# only the parts whose names match
# (e.g. --parts='sample' for the sampling parts alone).
# In CI (tests/CMakeLists.txt registers it):
#   scripts/gpu-check.sh --device=cpu --quick --build=build/ci --out=/tmp/x
#
# --pack leaves report.md and one gpu-check-logs.tar.gz in --out; without it
# the part logs stay in --out/logs.
#
# Exit status: 0 when every part that ran succeeded (a cut part did not
# fail), 1 otherwise. The
# benchmarks print figures; nothing here compares a figure with a threshold.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

device="cuda:0"
quick=0
pack=0
build="build/ci"
out="${OUT:-}"
budget=480  # seconds for the whole check: a lent GPU has minutes, not hours
only=""     # --parts=REGEX: the parts to run (bash =~ on the name); empty: all
for arg in "$@"; do
  case "$arg" in
    --device=*) device="${arg#--device=}" ;;
    --quick) quick=1 ;;
    --pack) pack=1 ;;
    --build=*) build="${arg#--build=}" ;;
    --out=*) out="${arg#--out=}" ;;
    --budget=*) budget="${arg#--budget=}" ;;
    --parts=*) only="${arg#--parts=}" ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $arg" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || out="$(mktemp -d)"
logs="$out/logs"
mkdir -p "$logs"
case "$device" in cpu|cuda|cuda:*) ;; *) echo "gpu-check: --device must be cpu or cuda:N" >&2; exit 2 ;; esac
on_gpu=0
[ "$device" != cpu ] && on_gpu=1

start=$(date +%s)
status_file="$logs/parts.tsv"
: >"$status_file"
failed=0

# Python scripts that import torch must not see the bundle's LD_LIBRARY_PATH
# (its libstdc++/protobuf can shadow the ones torch was built against).
# The first python3 that imports torch (on Debian the system one holds
# python3-torch while a pyenv python3 may come first on PATH).
python=python3
for candidate in python3 /usr/bin/python3; do
  if env -u LD_LIBRARY_PATH "$candidate" -c 'import torch' >/dev/null 2>&1; then
    python="$candidate"
    break
  fi
done
py=(env -u LD_LIBRARY_PATH PYTHONUNBUFFERED=1 "$python")

# part NAME LIMIT_S COMMAND...: run COMMAND with its output in NAME.log, under
# `timeout` of LIMIT_S or what is left of the budget (minus a reserve for the
# report), and record NAME, outcome and seconds in parts.tsv. Outcomes: ok,
# "exit N" and "timed out" (past its own limit: failures), and "cut" (ended
# by the budget, or not started because the budget was spent: not a failure).
part() {
  local name="$1" limit="$2"
  shift 2
  if [ -n "$only" ] && ! [[ "$name" =~ $only ]]; then
    printf '%s\tskipped\t0\tnot in --parts=%s\n' "$name" "$only" >>"$status_file"
    return 0
  fi
  local now left
  now=$(date +%s)
  left=$((budget - (now - start) - 10))
  if [ "$left" -lt 15 ]; then
    printf '%s\tcut\t0\tnot started: the budget was spent\n' "$name" >>"$status_file"
    echo "== $name: cut (the budget was spent)"
    return 0
  fi
  local by_budget=0
  if [ "$limit" -gt "$left" ]; then limit=$left; by_budget=1; fi
  echo "== $name (limit ${limit}s): $*"
  local t0=$(date +%s) rc=0
  timeout --kill-after=5 "$limit" "$@" >"$logs/$name.log" 2>&1 || rc=$?
  local secs=$(($(date +%s) - t0))
  local what=ok
  if { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && [ "$by_budget" -eq 1 ]; then what="cut"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then what="timed out"; failed=1
  elif [ "$rc" -ne 0 ]; then what="exit $rc"; failed=1; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$what" "$secs" "$*" >>"$status_file"
  echo "   $what after ${secs}s"
  tail -n 4 "$logs/$name.log" | sed 's/^/   | /'
}

skip() {  # skip NAME REASON
  printf '%s\tskipped\t0\t%s\n' "$1" "$2" >>"$status_file"
  echo "== $1: skipped ($2)"
}

bin="$build"
for exe in server/ampd bench/engine/ampd_bench_engine bench/service/ampd_bench_service; do
  [ -x "$bin/$exe" ] || { echo "gpu-check: $bin/$exe is missing; build first" >&2; exit 2; }
done

# ---- the machine ---------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -srm), $(nproc) CPUs"
  if [ "$on_gpu" -eq 1 ]; then
    nvidia-smi -L 2>&1 || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit \
      --format=csv 2>&1 || true
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
  fi
  "${py[@]}" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 || true
} >"$logs/machine.log" 2>&1
cat "$logs/machine.log"

# ---- shapes --------------------------------------------------------------------
if [ "$quick" -eq 1 ]; then
  steps=3; warmup=1
  gpt_shape=(--vocab=512 --context=64 --d-model=64 --n-layer=2 --n-head=4 --batch=2)
  gpt_py_shape=(--vocab 512 --context 64 --d-model 64 --n-layer 2 --n-head 4 --batch 2)
  gpt_svc_shape=(--gpt_vocab=512 --gpt_context=64 --gpt_d_model=64 --gpt_n_layer=2
                 --gpt_n_head=4 --gpt_batch=2)
  token_shape=(--vocab=512 --width=128 --depth=2 --tokens=64)
  decoder_svc_shape=(--decoder_vocab=512 --decoder_hidden=64 --decoder_intermediate=128
                     --decoder_layers=2 --decoder_heads=4 --decoder_kv_heads=2 --decoder_batch=2
                     --decoder_seq_len=64)
  decoder_shape=(--vocab=512 --hidden=64 --intermediate=128 --layers=2 --heads=4 --kv-heads=2
                 --batch=2 --seq-len=64)
  decoder_py_shape=(--vocab 512 --hidden 64 --intermediate 128 --layers 2 --heads 4
                    --kv-heads 2 --batch 2 --seq-len 64)
  token_py_shape=(--vocab 512 --width 128 --depth 2 --tokens 64)
  attention_py_shape=(--batch 1 --seq 64 --heads 2 --head-dim 16 --runs 3)
  concurrent=(--concurrent=1,2 --concurrent_steps=5)
  opt_millions=4
else
  steps=20; warmup=5
  gpt_shape=()
  gpt_py_shape=()
  gpt_svc_shape=()
  token_shape=()  # vocab 32768, width 4096, depth 4: 335M parameters, 8192 tokens
  decoder_shape=()  # Qwen2.5-0.5B's shape, 8 x 1024 tokens
  decoder_svc_shape=()
  decoder_py_shape=()
  token_py_shape=()
  attention_py_shape=()  # GPT-2 small's layer: B 8, T 1024, 12 heads of 64
  concurrent=(--concurrent=1,4,16 --concurrent_steps=50)
  opt_millions=256
fi
# The decoder's LoRA parts: rank 16, PEFT's common choice (it fits the
# --quick shape too: no projection there is narrower than 32).
lora_rank=16
peak=()
[ "$on_gpu" -eq 0 ] && peak=(--peak-tflops=0)
torch_device="cpu"
[ "$on_gpu" -eq 1 ] && torch_device="cuda"
threads=()
[ "$on_gpu" -eq 0 ] && threads=(--threads 1)

# ---- 1. correctness of the CUDA code ---------------------------------------------
# The CUDA suites run on the GPU and skip (saying why) without one; the
# backend_ops cases for cuda:0 compare every op with the CPU oracle; the
# sampler's ops token for token and byte for byte; the engine's CUDA step,
# sampling and LoRA against the CPU backend; and SampleInvariance on cuda:0:
# a batch_invariant job's sampled log-probs equal its training forward's,
# bit for bit, for GPT, decoder and LoRA decoder in fp32, fp16 and bf16.
# gtest NAME EXE ARGS...: a test executable, skipped when this build has none
# (CUDA suites are built only where nvcc is).
gtest() {
  local name="$1" exe="$2"
  shift 2
  if [ -x "$exe" ]; then part "$name" 120 "$exe" --gtest_brief=1 "$@"
  else skip "$name" "$exe not built (no nvcc at configure time)"; fi
}
gtest cuda_backend_test "$bin/tests/cuda/cuda_backend_test"
gtest sample_ops_cuda "$bin/tests/kernels/sample_ops_test" --gtest_filter='*cuda0*'
gtest backend_ops_cuda "$bin/tests/kernels/backend_ops_test" --gtest_filter='*cuda_0*'
gtest cuda_training_test "$bin/tests/engine/engine_cuda_training_test"
gtest sample_invariance_cuda "$bin/tests/engine/engine_sample_test" \
  --gtest_filter='Backends/SampleInvariance.*/cuda0'

# ---- 2. the sanitizers, on the kernels that never ran ---------------------------------
# memcheck slows kernels 10-100x: the cases of the kernels added since the
# last GPU run (decode attention, the batch-invariant GEMMs, the chunked
# cross-entropy with token losses, the sampler's draw and K/V writes), not
# the whole suite. racecheck instruments every shared-memory access: the
# tiled attention kernels, forward, backward and decode.
if [ "$on_gpu" -eq 1 ]; then
  sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n1)"
  if [ -n "$sanitizer" ]; then
    part memcheck 60 "$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 \
      "$bin/tests/cuda/cuda_backend_test" --gtest_brief=1 \
      --gtest_filter='*AttentionDecode*:GemmInvariant*:*CrossEntropyChunk*'
    part memcheck_sampler 40 "$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 \
      "$bin/tests/kernels/sample_ops_test" --gtest_brief=1 --gtest_filter='*cuda0*'
    part racecheck 60 "$sanitizer" --tool racecheck --error-exitcode 3 --print-limit 20 \
      "$bin/tests/cuda/cuda_backend_test" --gtest_brief=1 \
      --gtest_filter='*AttentionDecodeRowsAreTheForwardsBits*:*AttentionPrefixRowsAreTheLongerSequencesBits*:*AttentionAtGpt2HeadSizeMatchesCpu/BF16'
  else
    skip memcheck "compute-sanitizer not found"
  fi
else
  skip memcheck "no GPU (--device=cpu)"
  skip memcheck_sampler "no GPU (--device=cpu)"
  skip racecheck "no GPU (--device=cpu)"
fi

# ---- the service, through gRPC: one ampd for the service parts below ---------------
svc_dir="$(mktemp -d)"
ampd_pid=""
stop_ampd() {
  if [ -n "$ampd_pid" ] && kill -0 "$ampd_pid" 2>/dev/null; then
    kill -TERM "$ampd_pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$ampd_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$ampd_pid" 2>/dev/null || true
  fi
  ampd_pid=""
}
trap 'stop_ampd; rm -rf "$svc_dir"' EXIT
# With a state directory, as a service runs: CreateJob writes its creation
# checkpoint there.
: >"$svc_dir/ampd.out"  # exists before the forked child opens it
mkdir -p "$svc_dir/models"  # the shared base of service_remote_rl is written there
"$bin/server/ampd" --listen=127.0.0.1:0 --metrics-listen= --device="$device" \
  --state-dir="$svc_dir/state" --models-dir="$svc_dir/models" \
  >"$svc_dir/ampd.out" 2>"$logs/ampd_server.log" &
ampd_pid=$!
port=""
for _ in $(seq 600); do
  port="$(sed -n 's/^ampd: listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$svc_dir/ampd.out")"
  [ -n "$port" ] && break
  kill -0 "$ampd_pid" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$port" ]; then
  echo "gpu-check: ampd did not start" >&2
  printf 'service\tampd did not start\t0\t\n' >>"$status_file"
  failed=1
fi
svc=("$bin/bench/service/ampd_bench_service" --server="127.0.0.1:$port" --steps="$steps"
     --warmup="$warmup")
[ "$on_gpu" -eq 0 ] && svc+=(--peak_tflops=0)
# service_part NAME LIMIT ARGS...: a part of ampd_bench_service against that ampd.
service_part() {
  local name="$1" limit="$2"
  shift 2
  if [ -n "$port" ]; then part "$name" "$limit" "${svc[@]}" "$@"
  else skip "$name" "ampd did not start"; fi
}

# The Python parts' client is the ampd Python package with its generated
# stubs: the build's staged copy, or (a bundle carries executables only)
# stubs made here by grpc_tools from the checkout's proto.
client_pkg="$bin/client/python/package"
client_import() {  # client_import DIR: why `import ampd` fails from DIR; nothing if it works
  local err
  err="$(env -u LD_LIBRARY_PATH PYTHONPATH="$1" "$python" -c 'import ampd' 2>&1)" && return 0
  echo "${err##*$'\n'}"
}
client_why="$(client_import "$client_pkg")"
if [ -n "$client_why" ] && env -u LD_LIBRARY_PATH "$python" -c 'import grpc_tools' 2>/dev/null; then
  client_pkg="$svc_dir/python"
  mkdir -p "$client_pkg" && cp -r client/python/ampd "$client_pkg/" &&
    env -u LD_LIBRARY_PATH "$python" -m grpc_tools.protoc --proto_path=proto \
      --python_out="$client_pkg" --grpc_python_out="$client_pkg" ampd/v1/trainer.proto \
      >"$logs/client_stubs.log" 2>&1
  client_why="$(client_import "$client_pkg")"
fi
py_client=(env -u LD_LIBRARY_PATH PYTHONUNBUFFERED=1 PYTHONPATH="$client_pkg" "$python")
# client_part NAME LIMIT ARGS...: a Python script of the ampd client against that ampd.
client_part() {
  local name="$1" limit="$2"
  shift 2
  if [ -z "$port" ]; then skip "$name" "ampd did not start"
  elif [ -n "$client_why" ]; then skip "$name" "the ampd Python package does not import: $client_why"
  else part "$name" "$limit" "${py_client[@]}" "$@" --server="127.0.0.1:$port"; fi
}

# ---- 3. the bitwise promise end to end ---------------------------------------------
# An RL loop in fp16 with dynamic loss scaling on a batch_invariant job:
# Sample, reward, an importance_sampling Step on the samples; --check fails
# unless every step's sampler-trainer mismatch is 0 and the reward rises.
# (Its model is tiny: 60 iterations take about 1.5 s on the CPU, so the CPU
# mode runs it whole too.)
client_part rl_fp16 120 examples/rl_fp16.py --check

# ---- 4. GPT-2 small beside PyTorch eager and torch.compile -------------------------------
part engine_gpt 120 "$bin/bench/engine/ampd_bench_engine" --model=gpt --device="$device" \
  --precisions=bf16,fp16 --steps="$steps" --warmup="$warmup" "${peak[@]}" "${gpt_shape[@]}"
service_part service_gpt 150 --model=gpt --precisions=bf16,fp16 --concurrent= --state=false \
  "${gpt_svc_shape[@]}"
part torch_gpt 120 "${py[@]}" bench/pytorch/gpt.py --device "$torch_device" --precisions bf16,fp16 \
  --steps "$steps" --warmup "$warmup" "${gpt_py_shape[@]}" "${threads[@]}"
# torch.compile: its first compilation alone takes a minute or more.
if [ "$quick" -eq 0 ]; then
  part torch_gpt_compile 150 "${py[@]}" bench/pytorch/gpt.py --device "$torch_device" \
    --precisions bf16,fp16 --steps "$steps" --warmup "$warmup" --compile
else
  skip torch_gpt_compile "--quick (compilation dominates tiny shapes)"
fi
# Causal attention forward + backward at GPT-2 small's layer, beside
# PyTorch's SDPA on its flash backend (FlashAttention-2).
if [ -x "$bin/bench/cuda/ampd_bench_cuda_attention" ] && [ "$on_gpu" -eq 1 ]; then
  part attention 60 "$bin/bench/cuda/ampd_bench_cuda_attention" 10
else
  skip attention "needs a GPU and the CUDA benchmarks"
fi
part torch_attention 60 "${py[@]}" bench/pytorch/attention.py --device "$torch_device" \
  "${attention_py_shape[@]}" "${threads[@]}"

# ---- 5. the Qwen2.5-0.5B-shaped decoder, full and LoRA ----------------------------------
part engine_decoder 180 "$bin/bench/engine/ampd_bench_engine" --model=decoder --device="$device" \
  --precisions=bf16,fp16 --steps="$steps" --warmup="$warmup" "${peak[@]}" "${decoder_shape[@]}"
service_part service_decoder 240 --model=decoder --precisions=bf16,fp16 --concurrent= \
  --state=false "${decoder_svc_shape[@]}"
part torch_decoder 180 "${py[@]}" bench/pytorch/decoder.py --device "$torch_device" \
  --precisions bf16,fp16 --steps "$steps" --warmup "$warmup" "${decoder_py_shape[@]}" \
  "${threads[@]}"
if [ "$quick" -eq 0 ]; then
  part torch_decoder_compile 180 "${py[@]}" bench/pytorch/decoder.py --device "$torch_device" \
    --precisions bf16,fp16 --steps "$steps" --warmup "$warmup" --compile
else
  skip torch_decoder_compile "--quick (compilation dominates tiny shapes)"
fi
# The same decoder as a LoRA fine-tune (q/k/v/o_proj, alpha 2 x rank): the
# frozen 16-bit base's forward and input gradients, the adapters trained.
part engine_decoder_lora 150 "$bin/bench/engine/ampd_bench_engine" --model=decoder \
  --device="$device" --precisions=bf16,fp16 --steps="$steps" --warmup="$warmup" "${peak[@]}" \
  "${decoder_shape[@]}" --lora-rank="$lora_rank"
service_part service_decoder_lora 180 --model=decoder --precisions=bf16,fp16 \
  --concurrent= --state=false "${decoder_svc_shape[@]}" --decoder_lora_rank="$lora_rank"
part torch_decoder_lora 150 "${py[@]}" bench/pytorch/decoder.py --device "$torch_device" \
  --precisions bf16,fp16 --steps "$steps" --warmup "$warmup" "${decoder_py_shape[@]}" \
  --lora-rank "$lora_rank" "${threads[@]}"

# ---- 6. sampling: the Sample RPC beside PyTorch's generation loops --------------------
# Tokens/s of one Sample call (S prompts x P tokens, T new tokens each,
# temperature 1, no stop tokens: every sequence runs T) through the ampd
# above, on GPT-2 small and the Qwen2.5-0.5B-shaped decoder, fp16 and bf16;
# again on a batch_invariant job (a backend without batch-invariant kernels
# refuses it: the part reports "refused"); beside PyTorch's peers of the same
# shapes and counts on the same device: bench/pytorch/generate.py's
# hand-written KV-cache loop (16-bit weights) and transformers' generate
# (random weights from a GPT2Config / Qwen2Config; "skipped" where
# transformers is not installed). Each: one warm-up call, the median of
# --repeats; only generated tokens count.
if [ "$quick" -eq 1 ]; then
  sample_gpt_shape=(--vocab 512 --hidden 64 --layers 2 --heads 4)
  sample_decoder_shape=(--vocab 512 --hidden 64 --intermediate 128 --layers 2 --heads 4
                        --kv-heads 2)
  sample_run=(--prompts 2 --prompt-len 8 --max-tokens 8 --temperature 1 --repeats 2)
else
  sample_gpt_shape=()      # GPT-2 small: vocab 50304, 768 wide, 12 layers, 12 heads
  sample_decoder_shape=()  # Qwen2.5-0.5B: vocab 151936, hidden 896, 24 layers, 14 / 2 heads
  sample_run=(--prompts 16 --prompt-len 128 --max-tokens 128 --temperature 1 --repeats 3)
fi
sample=(bench/service/sample_bench.py --precisions=bf16,fp16 "${sample_run[@]}")
client_part service_sample_gpt 120 "${sample[@]}" --model=gpt "${sample_gpt_shape[@]}"
client_part service_sample_decoder 150 "${sample[@]}" --model=decoder "${sample_decoder_shape[@]}"
client_part service_sample_gpt_bi 150 "${sample[@]}" --model=gpt --batch-invariant \
  "${sample_gpt_shape[@]}"
client_part service_sample_decoder_bi 180 "${sample[@]}" --model=decoder --batch-invariant \
  "${sample_decoder_shape[@]}"
part torch_sample_gpt 120 "${py[@]}" bench/pytorch/generate.py --device "$torch_device" \
  --model gpt --precisions bf16,fp16 --weights-16 "${sample_run[@]}" "${sample_gpt_shape[@]}" \
  "${threads[@]}"
part torch_sample_decoder 150 "${py[@]}" bench/pytorch/generate.py --device "$torch_device" \
  --model decoder --precisions bf16,fp16 --weights-16 "${sample_run[@]}" \
  "${sample_decoder_shape[@]}" "${threads[@]}"
part hf_sample_gpt 150 "${py[@]}" bench/pytorch/hf_generate.py --device "$torch_device" \
  --model gpt --precisions bf16,fp16 "${sample_run[@]}" "${sample_gpt_shape[@]}" "${threads[@]}"
part hf_sample_decoder 180 "${py[@]}" bench/pytorch/hf_generate.py --device "$torch_device" \
  --model decoder --precisions bf16,fp16 "${sample_run[@]}" "${sample_decoder_shape[@]}" \
  "${threads[@]}"

# ---- 6b. remote RL: accumulated updates and LoRA jobs on one shared base ---------------
# The Qwen2.5-0.5B-shaped decoder: 4 ForwardBackward calls (2 x 512 tokens
# each) and an OptimStep beside one Step over the same micro-batches, full
# and LoRA rank 16, bf16 and fp16 (their losses must agree); then 16 LoRA
# jobs on one bf16 base of the server's --models-dir: the server's device
# memory against one base plus 16 adapter jobs, and a step of each.
if [ "$quick" -eq 1 ]; then
  remote_rl_shape=(--vocab 512 --hidden 64 --intermediate 128 --layers 2 --heads 4 --kv-heads 2
                   --seq 32 --updates 2)
else
  remote_rl_shape=()
fi
client_part service_remote_rl 150 bench/service/remote_rl_bench.py --device="$device" \
  --models-dir="$svc_dir/models" --server-pid="$ampd_pid" "${remote_rl_shape[@]}"

# ---- 7. the rest: the reference MLP, the token model, the service's own costs ------------
part engine_mlp 60 "$bin/bench/engine/ampd_bench_engine" --device="$device" \
  --steps=$((steps * 5)) --warmup=$((warmup * 2))
part torch_mlp 90 "${py[@]}" bench/pytorch/amp_mlp.py --device "$torch_device" \
  --steps $((steps * 5)) --warmup $((warmup * 2)) "${threads[@]}"
part torch_mlp_host_batch 90 "${py[@]}" bench/pytorch/amp_mlp.py --device "$torch_device" \
  --steps $((steps * 5)) --warmup $((warmup * 2)) --host-batch "${threads[@]}"
part engine_token 90 "$bin/bench/engine/ampd_bench_engine" --model=token --device="$device" \
  --precisions=fp16,bf16 --steps="$steps" --warmup="$warmup" "${token_shape[@]}"
part torch_token 90 "${py[@]}" bench/pytorch/token_model.py --device "$torch_device" \
  --steps "$steps" --warmup "$warmup" "${token_py_shape[@]}"
# The 335M token model: CreateJob, steps, and its state dict out and back in.
service_part service_token 120 --model=token --precisions=fp16 --concurrent= "${token_shape[@]}"
service_part service_token_bf16_fp32 120 --model=token --precisions=bf16,fp32 \
  --concurrent= --state=false "${token_shape[@]}"
service_part service_mlp 90 --model=mlp --precisions=fp32,fp16,bf16 --state=false \
  "${concurrent[@]}"
# The same concurrency with next to no compute: the service's own per-step cost.
service_part service_io 60 --model=mlp --precisions= --state=false "${concurrent[@]}" \
  --concurrent_model=io
stop_ampd
if [ "$on_gpu" -eq 1 ]; then
  [ -x "$bin/bench/cuda/ampd_bench_cuda_optimizer" ] &&
    part optimizer 60 "$bin/bench/cuda/ampd_bench_cuda_optimizer" "$opt_millions" 20
  [ -x "$bin/bench/cuda/ampd_bench_cuda_cross_entropy" ] &&
    part cross_entropy 60 "$bin/bench/cuda/ampd_bench_cuda_cross_entropy" 10
  [ -x "$bin/bench/cuda/ampd_bench_cuda_gemm" ] && part gemm_invariant 120 "$bin/bench/cuda/ampd_bench_cuda_gemm" 5
else
  skip optimizer "needs a GPU; the engine_mlp log has the CPU's fused AdamUpdate GB/s"
fi

# ---- where a GPT step's GPU time goes ---------------------------------------------------
# Nsight Compute's per-launch duration of every kernel of Trainer::Create and
# two bf16 steps (one warm-up, one timed), at the card's own clocks; the
# report sums them per kernel. Last: it only explains figures above.
if [ "$on_gpu" -eq 1 ] && [ "$quick" -eq 0 ]; then
  ncu_bin="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n1)"
  if [ -n "$ncu_bin" ]; then
    part profile_gpt 120 "$ncu_bin" --clock-control none --metrics gpu__time_duration.sum --csv \
      --page raw "$bin/bench/engine/ampd_bench_engine" --model=gpt --device="$device" \
      --precisions=bf16 --steps=1 --warmup=1
    part profile_token 90 "$ncu_bin" --clock-control none --metrics gpu__time_duration.sum --csv \
      --page raw "$bin/bench/engine/ampd_bench_engine" --model=token --device="$device" \
      --precisions=fp16 --steps=1 --warmup=1
  else
    skip profile_gpt "ncu not found"
  fi
fi

# ---- the report ------------------------------------------------------------------------
"${py[@]}" "$root/scripts/gpu_check_report.py" "$logs" >"$out/report.md" 2>"$logs/report.err" || {
  echo "gpu-check: the report could not be made:" >&2; cat "$logs/report.err" >&2; failed=1; }
cat "$out/report.md"
if [ "$pack" -eq 1 ]; then
  # One archive instead of a file per part: what comes back from a lent GPU
  # machine is limited to a few files.
  tar -C "$out" -czf "$out/gpu-check-logs.tar.gz" logs && rm -rf "$logs"
fi
echo "gpu-check: $(($(date +%s) - start)) s; report and logs in $out"
exit "$failed"
