#!/usr/bin/env bash
# One lease of the `device` tool's GPU machine (nothing else in fedseq needs it): the GPU tests,
# a short --workers-per-gpu curve, and the FedSeq paper's MNIST setting at T = 100
# (examples/mnist-fedseq.toml) for seeds 0-2, each run on the machine's CPU cores (one thread a
# process, --workers 2 for the runs that fine-tune), so that every run of the column shares one
# device kind. Run from the repository root there, with the wheels the machine lacks in .whl/
# and MNIST and Fashion-MNIST in .gpudata/ (both ignored, carried):
#
#     device run --carry .whl .gpudata --command 'bash bench/gpu_lease.sh'
#
# Results land in $OUT: the test and curve logs, and the run directories (weights left out).
set -u
export PYTHONUNBUFFERED=1 FEDSEQ_DATA=$PWD/.gpudata
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --target /tmp/site . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, os; print('torch', torch.__version__, torch.cuda.get_device_name(0), os.cpu_count(), 'cores')"
lscpu | grep -m1 "Model name"

echo "== GPU tests ($SECONDS s)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/server/test_cuda.py \
    tests/server/test_distributed.py::test_gpu_workers_give_bitwise_the_in_process_gpu_run \
    > "$OUT/gpu-tests.log" 2>&1
tail -5 "$OUT/gpu-tests.log"

echo "== --workers-per-gpu curve ($SECONDS s)"
timeout 120 python3 bench/workers.py --rounds 4 --workloads peers --gpu-per 1 4 \
    --data-root "$FEDSEQ_DATA" > "$OUT/workers-curve.log" 2>&1
cat "$OUT/workers-curve.log"

left=$((560 - SECONDS))
echo "== MNIST T=100, seeds 0-2 ($SECONDS s; runs stopped after $left s)"
run() {  # algorithm seed [fedseq-sim options]
    local alg=$1 seed=$2
    shift 2
    timeout "$left" fedseq-sim --config examples/mnist-fedseq.toml --set "algorithm.name=$alg" \
        --set "seed=$seed" --set rounds=100 --set train.threads=1 "$@" \
        --out "/tmp/mnist/$alg/seed-$seed" > "/tmp/mnist-$alg-$seed.log" 2>&1
    echo "$alg seed $seed: exit $? after $SECONDS s; $(tail -1 /tmp/mnist-$alg-$seed.log)"
}
for s in 0 1 2; do
    for a in fedbabu fedseq-vanilla fedseq-anti; do run $a $s --workers 2 & done
    run fedavg $s &
done
wait
tar czf "$OUT/mnist-t100.tar.gz" --exclude='*.safetensors' --exclude=.lock -C /tmp mnist
tail -n 12 /tmp/mnist-*.log > "$OUT/mnist-logs.txt"
echo "== done ($SECONDS s)"
