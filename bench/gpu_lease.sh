#!/usr/bin/env bash
# One lease of the `device` tool's GPU machine (nothing else in fedseq needs it), in one call:
#   1. the --workers-per-gpu curve on the FedSeq MNIST workload (10 clients a round, so up to
#      10 workers a GPU can be busy), on a quiet GPU;
#   2. the FedSeq paper's MNIST setting at T = 100 (examples/mnist-fedseq.toml), seed 0, for
#      FedAvg, FedBABU, FedSeq-Vanilla and FedSeq-Anti on the GPU, one process each sharing it,
#      to set beside the committed CPU runs (docs/results/mnist-t100-3seeds);
#   3. the GPU tests, beside the runs of 2 (their correctness does not depend on timing).
# Run from the repository root there, with the wheels the machine lacks in .whl/ and MNIST and
# Fashion-MNIST in .gpudata/ (both ignored, carried):
#
#     device run --carry .whl .gpudata --command 'bash bench/gpu_lease.sh'
#
# Results land in $OUT: the test and curve logs, and the run directories (weights left out).
set -u
export PYTHONUNBUFFERED=1 FEDSEQ_DATA=$PWD/.gpudata
OUT=${OUT:-/tmp/out}
END=${END:-540}  # seconds from the start by which everything has stopped
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
    --target /tmp/site . || exit 1  # --upgrade: without it pip leaves /tmp/site/bin (fedseq-sim) out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
python3 -c "import torch, os; print('torch', torch.__version__, torch.cuda.get_device_name(0), os.cpu_count(), 'cores')" | tee -a "$OUT/card.txt"
lscpu | grep -m1 "Model name" | tee -a "$OUT/card.txt"
uptime | tee -a "$OUT/card.txt"

echo "== --workers-per-gpu curve ($SECONDS s)"
timeout 170 python3 bench/workers.py --rounds 4 --workloads fedseq-mnist --gpu-per 1 2 5 10 \
    --data-root "$FEDSEQ_DATA" > "$OUT/workers-curve.log" 2>&1
echo "exit $?"; cat "$OUT/workers-curve.log"

left=$((END - SECONDS))
echo "== MNIST T=100 seed 0 on the GPU, with the GPU tests beside ($SECONDS s; stopped after $left s)"
run() {  # algorithm
    local alg=$1
    timeout "$left" fedseq-sim --config examples/mnist-fedseq.toml --set "algorithm.name=$alg" \
        --set seed=0 --set rounds=100 --set train.threads=1 --set 'train.device="cuda"' \
        --out "/tmp/mnist-gpu/$alg/seed-0" > "/tmp/mnist-$alg.log" 2>&1
    echo "$alg seed 0: exit $? after $SECONDS s; $(tail -1 /tmp/mnist-$alg.log)"
}
for a in fedavg fedbabu fedseq-vanilla fedseq-anti; do run $a & done
timeout "$((left - 10))" python3 -m pytest -q -p no:cacheprovider tests/server/test_cuda.py \
    tests/server/test_distributed.py::test_gpu_workers_give_bitwise_the_in_process_gpu_run \
    > "$OUT/gpu-tests.log" 2>&1
echo "tests exit $?"; tail -8 "$OUT/gpu-tests.log"
wait
tar czf "$OUT/mnist-t100-gpu.tar.gz" --exclude='*.safetensors' --exclude=.lock -C /tmp mnist-gpu
tail -n 12 /tmp/mnist-*.log > "$OUT/mnist-logs.txt"
echo "== done ($SECONDS s)"
