"""Operations: running experiments for people and machines.

- simulation.py   fedseq-sim: a run's pool and clock in one process (or on --workers)
- deployment.py   fedseq-server start: a run over a fleet, its broker and local devices
- broker.py       the embedded amqtt broker, or a Mosquitto started for the run
- campaign.py     many runs of one grid back to back, resumable
- rehearsal.py    a testbed on one machine: network namespaces, shaped links, CPU quotas
- status.py       fedseq-server status: what the broker knows of the run and every device
- metrics.py      Prometheus metrics of a coordinator
- track.py        run directories exported to TensorBoard or MLflow

Imports fedseq.common and the rooms below it (rounds, pools, privacy, report): never a command.
"""
