#!/usr/bin/env bash
# The simulated mixed fleet of docs/results.md ("Mixed fleets"): the testbed config on 5 Nano-
# and 5 Orin-Nano-paced devices (wifi-good links), synchronous rounds, over-selection (1.5x) and
# buffered asynchronous aggregation (concurrency 6, buffer 3), 3 seeds each, one after another,
# each mode over about the same simulated time (an over-selected round lasts about half a
# synchronous one, an asynchronous step about a sixth); then bench/mixed_fleet.py prints the
# time and energy each mode takes to the synchronous run's final accuracy.
#   bash bench/mixed_fleet.sh OUT [SYNC_ROUNDS] [OVER_SELECT_ROUNDS] [ASYNC_STEPS] [ALGORITHM]
set -euo pipefail
out=${1:?usage: bench/mixed_fleet.sh OUT [SYNC_ROUNDS] [OVER_SELECT_ROUNDS] [ASYNC_STEPS] [ALGORITHM]}
rounds=${2:-12}
over=${3:-28}
steps=${4:-60}
alg=${5:-fedavg}
fleet="fleet.devices=[{profile='nano',count=5},{profile='orin-nano',count=5}]"
common=(--config examples/fmnist-testbed.toml --set "algorithm.name=$alg" --set "$fleet"
        --set train.threads=2 --seeds 0,1,2 -q)
fedseq-sim "${common[@]}" --set "rounds=$rounds" --out "$out/$alg/sync"
fedseq-sim "${common[@]}" --set "rounds=$over" --set train.over_select=1.5 \
    --out "$out/$alg/over-select"
fedseq-sim "${common[@]}" --set "rounds=$steps" --set train.mode=async --out "$out/$alg/async"
python bench/mixed_fleet.py "$out"
