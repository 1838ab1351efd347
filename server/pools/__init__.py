"""The pools: who trains a round's selected clients, behind the `ClientPool` protocol of
server/rounds/pool_api.py. A pool transports: it dispatches a step and hands back typed outcomes;
every decision stays with the round.

- inprocess.py     every client in this process (fedseq-sim)
- distributed.py   clients on worker processes over torch.distributed (fedseq-sim --workers N),
                   with membership.py's proof that every rank belongs to the run
- mqtt/            a fleet of devices over MQTT (fedseq-server start)
- processes.py     the child processes these start (local device daemons, workers)

Imports fedseq.common, server/privacy and server/rounds: never an operation, the report or a
command.
"""
