#!/usr/bin/env bash
# The step protocol's measurements on the GPU machine, in one call (run from the repo root, with
# the wheels of ../shared/tools/gpu-wheels.sh and this project's own wheel in .whl/, and the
# tokenizer of `bench/random_model.py --export-tokenizer .bench-assets/tokenizer`):
#   [INSTANCES=1,2] [MODES=mailboxes] [AHEAD="0 1"] bash bench/gpu_step_round.sh [splittests] [steptests] [exchange|exchange-120k] [model] [daemon-32k] [daemon-120k] [tests]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Two processes share the GPU through MPS (each instance is a process of its own).
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS started"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for what in "$@"; do
  case $what in
    exchange)
      timeout 240 python3 bench/step_exchange.py --device cuda --keys 61440 --steps 200
      timeout 120 python3 bench/step_exchange.py --device cuda --keys 16384 --steps 200 --tag=-32k
      timeout 120 python3 bench/step_exchange.py --device cuda --keys 61440 --rows 8 --steps 100 --tag=-8rows
      cp bench/results/step_exchange-*.json "$OUT"/ ;;
    exchange-120k)
      timeout 120 python3 bench/step_exchange.py --device cuda --keys 61440 --steps 200
      cp bench/results/step_exchange-*.json "$OUT"/ ;;
    model)
      [ -d /tmp/llama1b ] || timeout 150 python3 bench/random_model.py --shape llama3.2-1b \
        --tokenizer .bench-assets/tokenizer --out /tmp/llama1b ;;
    daemon-32k)
      for mode in ${MODES:-mailboxes messages}; do
        for ahead in ${AHEAD:-1}; do
          timeout ${DAEMON_TIMEOUT:-280} python3 bench/daemon.py --device cuda --model /tmp/llama1b --mps --no-moves --context-items 1700 \
            --new-tokens 96 --instances ${INSTANCES:-1,2,3} --max-num-batched-tokens 8192 --remote-attention $mode --steps-ahead $ahead
          for f in bench/results/daemon-*-$mode-ahead$ahead.json; do cp "$f" "$OUT/$(basename "$f" .json)-32k.json"; done
        done
      done ;;
    daemon-120k)
      for mode in ${MODES:-mailboxes messages}; do
        for ahead in ${AHEAD:-1}; do
          timeout ${DAEMON_TIMEOUT:-290} python3 bench/daemon.py --device cuda --model /tmp/llama1b --mps --no-moves --context-items 6500 \
            --new-tokens 96 --instances ${INSTANCES:-1,2} --max-num-batched-tokens 8192 --remote-attention $mode --steps-ahead $ahead
          for f in bench/results/daemon-*-$mode-ahead$ahead.json; do cp "$f" "$OUT/$(basename "$f" .json)-120k.json"; done
        done
      done ;;
    splittests)
      # Split decode steps as one graph, through device mailboxes, against one instance (fp32).
      [ -d /tmp/smol ] || timeout 100 python3 bench/random_model.py --shape smollm2-135m --dtype float32 \
        --tokenizer .bench-assets/tokenizer --out /tmp/smol
      INFLLM_GPU_TEST_MODEL=/tmp/smol timeout ${SPLIT_TESTS_TIMEOUT:-300} python3 -P -m pytest -q -x -p no:cacheprovider \
        tests/daemon/test_cluster_mailboxes.py -k gpu 2>&1 | tail -40 ;;
    steptests)
      timeout 100 python3 -P -m pytest -q -x -p no:cacheprovider tests/daemon/test_step_mailbox_gpu.py 2>&1 | tail -30 ;;
    tests)
      timeout 400 python3 -P -m pytest -q -m gpu -p no:cacheprovider tests/daemon tests/engine tests/transport/test_device_pools.py ;;
  esac
done
cp bench/results/step_exchange-*.json "$OUT"/ 2>/dev/null
ls "$OUT"
