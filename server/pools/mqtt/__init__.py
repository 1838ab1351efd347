"""The coordinator's side of the wire, one job per module:

- broker_session.py  the broker connection: retained cache re-published on every reconnect, presence
               (which devices are online, which said they cannot run a step), the event queue
- blocks.py    versioned, chunked, retained weight blocks: a block is encoded and published again
               only when its tensors changed
- inbox.py     topics and payloads from devices turned into typed events (network thread)
- collect.py   collecting a step's answers: updates in client order until all came, the deadline
               passed or their devices went away; evaluation results; the deadline policy
- secure_relay.py  a secure round's stages: the coordinator relays the devices' shares
- mqtt_pool.py  MqttPool, the ClientPool over all of the above
- arrivals.py  MqttArrivals, train.mode = "async" on the fleet (the devices' pace orders arrivals)
"""

from fedseq.server.pools.mqtt.mqtt_pool import MqttPool, assign_clients

__all__ = ["MqttPool", "assign_clients"]
