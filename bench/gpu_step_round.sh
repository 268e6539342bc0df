#!/usr/bin/env bash
# The step protocol's measurements on the GPU machine, in one call (run from the repo root, with
# the wheels of ../shared/tools/gpu-wheels.sh and this project's own wheel in .whl/, and the
# tokenizer of `bench/random_model.py --export-tokenizer .bench-assets/tokenizer`):
#   [INSTANCES=1,2] [MODES=mailboxes] [AHEAD="0 1"] bash bench/gpu_step_round.sh [splittests] [steptests] [exchange|exchange-120k] [model] [daemon-32k] [daemon-120k] [batch] [cluster] [links] [exchange-links] [daemon-120k-links] [tests]
# `batch` and `cluster` need `model` before them (issue #35's goals 3 and 4, about 200 s each at most):
#   batch: [BATCH=8] [BATCH_MODE=mailboxes] [BATCH_TIMEOUT=200]: BATCH short requests on the home,
#     decoding alone and beside one 32K request split over two daemons (bench/daemon.py --batch-beside-split)
#   cluster: [CLUSTER_RATES=64] [CLUSTER_REQUESTS=32] [CLUSTER_TIMEOUT=200] [CLUSTER_REPLAY_TIMEOUT=90]: the mixed trace on two instances
#     sharing the GPU (bench/cluster_multigpu.py --mps), shared KV against static instances
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Two processes share the GPU through MPS (each instance is a process of its own). NO_MPS=1:
# without it (a killed MPS client takes the GPU's other clients down: the kill test needs this).
if [ "${NO_MPS:-0}" = 1 ]; then
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo quit | nvidia-cuda-mps-control 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; sleep 1; echo "without MPS"
else
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS started"
fi
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
    batch)
      timeout ${BATCH_TIMEOUT:-200} python3 bench/daemon.py --device cuda --model /tmp/llama1b --mps --context-items 1700 \
        --new-tokens 512 --max-num-batched-tokens 8192 --remote-attention ${BATCH_MODE:-mailboxes} \
        --batch-beside-split ${BATCH:-8} --batch-prompt-tokens 256 --batch-new-tokens 128 --batch-repeats 2
      cp bench/results/daemon-*-llama1b-mps-*-batch*.json "$OUT"/ ;;
    cluster)
      timeout ${CLUSTER_TIMEOUT:-200} python3 bench/cluster_multigpu.py --device cuda --mps --instances 2 \
        --model /tmp/llama1b --pool-blocks 1024 --requests ${CLUSTER_REQUESTS:-32} --rates ${CLUSTER_RATES:-64} \
        --warm-up --timeout-s ${CLUSTER_REPLAY_TIMEOUT:-90}
      cp bench/results/cluster_multigpu-*-mps-x2.json "$OUT"/ ;;
    links)
      # Creditors as of other hosts: NCCL links between processes naming hosts of their own.
      NCCL_DEBUG=WARN timeout 120 python3 -P -m pytest -q -x -p no:cacheprovider tests/transport/test_nccl_link_gpu.py 2>&1 | tail -20
      [ -d /tmp/smol ] || timeout 100 python3 bench/random_model.py --shape smollm2-135m --dtype float32 \
        --tokenizer .bench-assets/tokenizer --out /tmp/smol
      INFLLM_GPU_TEST_MODEL=/tmp/smol timeout ${LINK_TESTS_TIMEOUT:-300} python3 -P -m pytest -q -x -p no:cacheprovider \
        tests/daemon/test_cluster_mailboxes.py -k "gpu and (nccl or link)" 2>&1 | tail -40 ;;
    exchange-links)
      timeout 150 python3 bench/step_exchange.py --device cuda --link nccl --keys 61440 --steps 200
      timeout 150 python3 bench/step_exchange.py --device cuda --keys 61440 --steps 200
      cp bench/results/step_exchange-*.json "$OUT"/ ;;
    daemon-120k-links)
      timeout ${DAEMON_TIMEOUT:-290} python3 bench/daemon.py --device cuda --model /tmp/llama1b --mps --no-moves --context-items 6500 \
        --new-tokens 96 --instances ${INSTANCES:-1,2} --max-num-batched-tokens 8192 --remote-attention mailboxes --nccl-links always
      cp bench/results/daemon-*-links-always.json "$OUT"/ ;;
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
# (each step copies its own results into $OUT)
ls "$OUT"
