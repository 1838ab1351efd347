#!/usr/bin/env bash
# The FedSeq paper's MNIST setting (examples/mnist-fedseq.toml) for ROUNDS rounds (default 100,
# the paper's T=100 row: with t = 0/100/200 only the first scheduled block trains before
# fine-tuning). Writes runs/mnist/<algorithm>/.
# Usage: bench/run_mnist_fedseq.sh [ROUNDS] [DATA_ROOT] [ALGORITHMS...]
set -euo pipefail
rounds=${1:-100}
root=${2:-../shared/data}
shift $(( $# > 2 ? 2 : $# ))
algs=${*:-fedavg fedseq-vanilla fedseq-anti}
for alg in $algs; do
  fedseq-sim -q -c examples/mnist-fedseq.toml --set data.root="\"$root\"" --set rounds="$rounds" \
    --set algorithm.name="$alg" --out "runs/mnist/$alg"
done
