#!/usr/bin/env bash
# Runs every algorithm on examples/fmnist-testbed.toml for ROUNDS rounds (default 10) and writes
# runs/table/<algorithm>/; bench/results_table.py then prints the markdown table of docs/results.md.
# Usage: bench/run_testbed_table.sh [ROUNDS] [DATA_ROOT]
set -euo pipefail
rounds=${1:-10}
root=${2:-../shared/data}
for alg in fedavg fedprox fedper fedrep lg-fedavg fedbabu fedrod fedreg fedseq-vanilla fedseq-anti; do
  fedseq-sim -q -c examples/fmnist-testbed.toml --set data.root="\"$root\"" --set rounds="$rounds" \
    --set algorithm.name="$alg" --out "runs/table/$alg"
done
