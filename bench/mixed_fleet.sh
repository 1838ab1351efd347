#!/usr/bin/env bash
# The simulated mixed fleet of docs/results.md ("Mixed fleets"): the testbed config with FedAvg on
# 5 Nano- and 5 Orin-Nano-paced devices (wifi-good links), synchronous rounds, over-selection
# (1.5x) and buffered asynchronous aggregation (concurrency 6, buffer 3), 3 seeds each, one
# after another; then bench/mixed_fleet.py prints time and energy to the synchronous accuracy.
#   bash bench/mixed_fleet.sh OUT [SYNC_ROUNDS] [ASYNC_STEPS] [ALGORITHM]
set -euo pipefail
out=${1:?usage: bench/mixed_fleet.sh OUT [SYNC_ROUNDS] [ASYNC_STEPS] [ALGORITHM]}
rounds=${2:-12}
steps=${3:-60}
alg=${4:-fedavg}
fleet="fleet.devices=[{profile='nano',count=5},{profile='orin-nano',count=5}]"
common=(--config examples/fmnist-testbed.toml --set "algorithm.name=$alg" --set "$fleet"
        --set train.threads=2 --seeds 0,1,2 -q)
fedseq-sim "${common[@]}" --set "rounds=$rounds" --out "$out/$alg/sync"
fedseq-sim "${common[@]}" --set "rounds=$rounds" --set train.over_select=1.5 \
    --out "$out/$alg/over-select"
fedseq-sim "${common[@]}" --set "rounds=$steps" --set train.mode=async --out "$out/$alg/async"
python bench/mixed_fleet.py "$out"
