"""The topic tree under one root (default 'fedseq/'). docs/protocol.md documents each topic."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topics:
    root: str = "fedseq"

    @property
    def server_status(self) -> str:  # retained, last will
        return f"{self.root}/server/status"

    def device_status(self, device: str = "+") -> str:  # retained, last will
        return f"{self.root}/device/{device}/status"

    @property
    def run_config(self) -> str:  # retained
        return f"{self.root}/run/config"

    def assignment(self, device: str = "+") -> str:  # retained
        return f"{self.root}/device/{device}/assign"

    @property
    def step(self) -> str:  # retained: the current round schedule / evaluate / finetune / stop
        return f"{self.root}/step"

    def weights(self, block: str = "+", chunk: int | str = "+") -> str:  # retained, versioned
        return f"{self.root}/weights/{block}/{chunk}"

    def update(self, device: str = "+", client: int | str = "+", chunk: int | str = "+") -> str:
        return f"{self.root}/update/{device}/{client}/{chunk}"

    def evaluation(self, device: str = "+") -> str:
        return f"{self.root}/eval/{device}"

    @property
    def control(self) -> str:
        return f"{self.root}/control"

    def device_of(self, topic: str) -> str:
        """The device name in a device/<name>/... , update/<name>/... or eval/<name> topic."""
        parts = topic[len(self.root) + 1 :].split("/")
        return parts[1]
