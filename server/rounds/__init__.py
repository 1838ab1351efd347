"""The round: the run loop and its drivers, and what they keep.

A run (run.py) sets up the experiment (experiment.py), restores a checkpoint (checkpoint.py) and
hands the rounds to the `Coordinator` (coordinator.py), which drives them with a driver: `Rounds`
(coordinator.py, synchronous) or `BufferedAsync` (buffered.py). A driver's round reads top to
bottom: select, send, collect, aggregate, evaluate, record. Both keep their books in the `Ledger`
(ledger.py: model versions, bytes, the rule built once, the fold and the server step; privacy's
account is server/privacy's), admit every contribution (a client's update, a site's partial)
through the round's `RoundContract.admit` (contract.py), and write a `RoundRecord` (records.py) to
the run directory (rundir.py). Edge sites' rounds ([hierarchy]) are sites.py's. The clients are
reached through the `ClientPool` protocol (pool_api.py), which the pools implement; the simulated
fleet's clock (virtual_fleet.py, over the links of links.py) times a simulation's rounds. Seeds as
an axis: seeds.py.

Imports fedseq.common and server/privacy only: never a pool, an operation, the report or a command.
"""
