"""The topic tree under one root (default 'fedseq/'). docs/protocol.md documents each topic."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

#: what a device may be called (fedseq-client --device): so a name from a topic is plain text
#: wherever it lands (logs, terminals, reports, paths)
DEVICE_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")


@dataclass(frozen=True)
class TopicRef:
    """A parsed topic: its kind and the names its levels carry (empty where it has none).

    kind: server_status, campaign, device_status, device_info, assignment, run_config, step,
    weights, update, eval, secagg, secagg_relay, control; site_status, site_run, site_task,
    site_result (an edge aggregator's topics, where `device` names its site). Levels are kept
    as text: a chunk level that is not a number is the message handler's to refuse, with its
    reason."""

    kind: str
    device: str = ""
    block: str = ""
    chunk: str = ""


@dataclass(frozen=True)
class Topics:
    """Builds every topic of one root and parses them back (`parse`): the only place on either
    side that knows the topic layout."""

    root: str = "fedseq"

    @property
    def server_status(self) -> str:  # retained, last will
        """The coordinator's status: retained, and its last will says offline."""
        return f"{self.root}/server/status"

    @property
    def campaign(self) -> str:  # retained: a campaign's progress (no device reads it)
        """A campaign's progress: retained; no device reads it."""
        return f"{self.root}/server/campaign"

    def device_status(self, device: str = "+") -> str:  # retained, last will
        """A device's status (`+`: every device's): retained, and its last will says offline."""
        return f"{self.root}/device/{device}/status"

    def device_info(self, device: str = "+") -> str:  # retained
        """A device's description, its stack and data (`+`: every device's): retained."""
        return f"{self.root}/device/{device}/info"

    @property
    def run_config(self) -> str:  # retained
        """The run's config as the devices need it: retained."""
        return f"{self.root}/run/config"

    def assignment(self, device: str = "+") -> str:  # retained
        """The clients a device holds (`+`: every device's): retained."""
        return f"{self.root}/device/{device}/assign"

    @property
    def step(self) -> str:  # retained: the current round schedule / evaluate / finetune / stop
        """The current step (a round's schedule, evaluate, fine-tune, stop): retained."""
        return f"{self.root}/step"

    def weights(self, block: str = "+", chunk: int | str = "+") -> str:  # retained, versioned
        """One chunk of one block of the global model (`+`: any): retained and versioned."""
        return f"{self.root}/weights/{block}/{chunk}"

    def update(self, device: str = "+") -> str:
        """One topic per device (v5): client and chunk travel in the header, so the broker keeps
        at most one message per device here whatever a device login publishes."""
        return f"{self.root}/update/{device}"

    def secagg(self, device: str = "+") -> str:
        """A device's answers in a secure round's stages (up)."""
        return f"{self.root}/secagg/{device}"

    def secagg_relay(self, device: str = "+") -> str:
        """What the coordinator relays to a device's clients in a secure round (down)."""
        return f"{self.root}/device/{device}/secagg"

    def evaluation(self, device: str = "+") -> str:
        """A device's evaluation results (`+`: every device's)."""
        return f"{self.root}/eval/{device}"

    @property
    def control(self) -> str:
        """The coordinator's control messages to every device (abort)."""
        return f"{self.root}/control"

    def site(self, site: str, what: str) -> str:
        """[hierarchy] on a fleet, the coordinator's broker: an edge aggregator's `status`
        (retained, last will), the `task`s the coordinator gives it, its `result`s."""
        return f"{self.root}/site/{site}/{what}"

    def parse(self, topic: str) -> Optional[TopicRef]:
        """The topic's kind and levels; None for a topic outside this tree or of no known shape."""
        if not topic.startswith(self.root + "/"):
            return None
        p = topic[len(self.root) + 1:].split("/")
        shape = (p[0], len(p))
        if p[0] in ("device", "update", "eval", "secagg") and len(p) > 1 and not DEVICE_NAME.fullmatch(p[1]):
            return None  # not a device's name (fedseq-client's --device): nobody's topic
        if shape == ("server", 2) and p[1] in ("status", "campaign"):
            return TopicRef("server_status" if p[1] == "status" else "campaign")
        if shape == ("device", 3) and p[2] in ("status", "info", "assign", "secagg"):
            kind = {"status": "device_status", "info": "device_info", "assign": "assignment",
                    "secagg": "secagg_relay"}[p[2]]
            return TopicRef(kind, device=p[1])
        if shape == ("run", 2) and p[1] == "config":
            return TopicRef("run_config")
        if shape in (("step", 1), ("control", 1)):
            return TopicRef(p[0])
        if shape == ("weights", 3):
            return TopicRef("weights", block=p[1], chunk=p[2])
        if shape == ("update", 2):
            return TopicRef("update", device=p[1])
        if shape == ("secagg", 2):
            return TopicRef("secagg", device=p[1])
        if shape == ("eval", 2):
            return TopicRef("eval", device=p[1])
        if shape == ("site", 3) and p[2] in ("status", "run", "task", "result") \
                and DEVICE_NAME.fullmatch(p[1]):
            return TopicRef("site_" + p[2], device=p[1])  # [hierarchy]: `device` names the site
        return None
