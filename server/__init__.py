"""fedseq's coordinator side, in rooms by role. Each room's opening comment says what it owns and
what it may import; the rooms stand in floors, each importing only the ones below it (and
fedseq.common), never one above:

- cli/      the commands: fedseq-sim, fedseq-server, fedseq (parse, then call a room below)
- ops/      operations: the simulation's and the deployment's set-up, brokers, campaigns, the
            rehearsal, fedseq-server status, Prometheus metrics, experiment trackers
- report/   fedseq report: tables and figures from run directories
- pools/    who trains the selected clients: in this process, on torch.distributed workers, on a
            fleet over MQTT
- rounds/   the round: the run loop and its drivers, the ledger, the round contract, records,
            checkpoints and the run directory; the pool protocol the pools implement
- privacy/  client-level differential privacy and secure sums
"""
