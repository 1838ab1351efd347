"""fedseq-server, SIGKILLed at a named point: the resume tests' harness (not a test module).

    python tests/crash_server.py POINT [fedseq-server arguments...]

POINT is where the coordinator dies, as `kill -9` or a power cut would leave it:
  after-aggregate      right after the first block of round 1's aggregate is published (the
                       devices may hold some blocks of it; round 1's checkpoint is not written)
  mid-checkpoint       while round 1's checkpoint is written (half its temporary file on disk)
  mid-finetune         once the first device result of the fine-tuning step has arrived
  first-resumed-round  2 s after a resumed run published its first training step
  mid-secure-unmask    in round 1 of a run with [secagg], once the devices have answered the
                       unmasking stage (the round's shares revealed, its aggregate not applied)
  none                 nowhere (the plain command)
"""

from __future__ import annotations

import os
import signal
import sys
import time


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    if point == "after-aggregate":
        from fedseq.server.pools.mqtt.blocks import BlockPublisher

        publish = BlockPublisher._publish

        def publish_then_die(self, block, version, frame, digest):
            publish(self, block, version, frame, digest)
            if version % 1000 == 2:  # round 1's aggregate (a resume adds 1000 per restart)
                time.sleep(0.5)  # let the broker take it
                die()

        BlockPublisher._publish = publish_then_die
    elif point == "mid-checkpoint":
        from fedseq.server.rounds import checkpoint

        calls = []

        def half_then_die(path, data, durable=True):
            calls.append(path)
            if len(calls) < 2:  # round 0's checkpoint is written whole
                return atomic_write(path, data, durable)
            tmp = path.with_name(path.name + ".tmp")
            with tmp.open("wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            die()

        atomic_write = checkpoint.atomic_write
        checkpoint.atomic_write = half_then_die
    elif point == "mid-finetune":
        from fedseq.server.pools.mqtt.mqtt_pool import MqttPool

        finetune = MqttPool.finetune

        def finetune_then_die(self, plan, weights, heads, check, progress):
            def first_result(done, total):
                progress(done, total)
                if done:
                    die()

            return finetune(self, plan, weights, heads, check, first_result)

        MqttPool.finetune = finetune_then_die
    elif point == "first-resumed-round":
        from fedseq.server.pools.mqtt.mqtt_pool import MqttPool

        publish_step = MqttPool._publish_step

        def publish_step_then_die(self, **fields):
            step = publish_step(self, **fields)
            if fields.get("kind") == "train" and self.seq > 1000:
                time.sleep(2.0)  # the devices are training it
                die()
            return step

        MqttPool._publish_step = publish_step_then_die
    elif point == "mid-secure-unmask":
        from fedseq.server.pools.mqtt.secure_relay import SecureStages

        unmask = SecureStages.unmask

        def unmask_then_die(self, requests):
            answers = unmask(self, requests)
            if self.secure.setup.round == 1:
                die()
            return answers

        SecureStages.unmask = unmask_then_die
    elif point != "none":
        raise SystemExit(f"unknown crash point {point!r}")


if __name__ == "__main__":
    arm(sys.argv.pop(1))
    from fedseq.server.cli.commands import server_main

    sys.argv[0] = "fedseq-server"
    server_main()
