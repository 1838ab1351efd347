#!/usr/bin/env bash
# (b) of docs/results.md "Mixed fleets": the mixed fleet rehearsed on this machine (root: network
# namespaces, tc, cgroups). FedAvg on the testbed config with a quarter of its data (rounds of
# tens of seconds on 2 cores), 6 local devices of 5 clients each: two under a quarter of the
# others' CPU (0.1 core against 0.4), two behind wifi-poor (2 Mbit/s), the rest wifi-good, on a
# Mosquitto started for each run (deploy.embedded_broker: amqtt drops what a 2 Mbit/s link does
# not acknowledge within 5 s, docs/rehearsal.md). Synchronous rounds, over-selection (1.5x) and
# asynchronous aggregation (concurrency 6, buffer 3: about the same number of client-rounds), then the same three simulated with the fleet the synchronous
# rehearsal measured (fedseq fleet, with each device's link), and bench/mixed_rehearsal.py
# compares the rehearsal's wall seconds with the simulation's virtual ones.
#   bash bench/mixed_rehearsal.sh OUT [ROUNDS] [ASYNC_STEPS]
set -euo pipefail
out=${1:?usage: bench/mixed_rehearsal.sh OUT [ROUNDS] [ASYNC_STEPS]}
rounds=${2:-8}
steps=${3:-16}
slow=${SLOW_LINK:-wifi-poor}
common=(--config examples/fmnist-testbed.toml --set algorithm.name=fedavg
        --set data.fraction=0.25 --set train.eval_every=4 -q)
# deadlines long enough that a synchronous round waits for its slowest device, as the
# simulation's model of a round does (it has no deadlines)
rehearse=(--set deploy.round_timeout_s=900 --set deploy.embedded_broker='"mosquitto"'
          --local-clients 6 --client-threads 1 --cpu-quota 0.4 --cpu-quota local05=0.1
          --cpu-quota local06=0.1 --link wifi-good --link local03="$slow"
          --link local04="$slow")
async=(--set train.mode='"async"' --set train.concurrency=6 --set train.buffer=3)
fedseq-server start "${common[@]}" "${rehearse[@]}" --set "rounds=$rounds" \
    --out "$out/rehearsed/sync"
fedseq-server start "${common[@]}" "${rehearse[@]}" --set "rounds=$rounds" \
    --set train.over_select=1.5 --out "$out/rehearsed/over-select"
fedseq-server start "${common[@]}" "${rehearse[@]}" --set "rounds=$steps" "${async[@]}" \
    --out "$out/rehearsed/async"
fleet=$(python bench/mixed_rehearsal.py --fleet "$out/rehearsed/sync" \
        --link local03="$slow" --link local04="$slow")
sim=("${common[@]}" --set "$fleet" --set train.threads=2)
fedseq-sim "${sim[@]}" --set "rounds=$rounds" --out "$out/simulated/sync"
fedseq-sim "${sim[@]}" --set "rounds=$rounds" --set train.over_select=1.5 \
    --out "$out/simulated/over-select"
fedseq-sim "${sim[@]}" --set "rounds=$steps" "${async[@]}" --out "$out/simulated/async"
python bench/mixed_rehearsal.py "$out"
