"""A device's link: its rates each way, one-way delay, jitter and loss, by a profile's name or
given whole. The simulated fleet (virtual_fleet.py) times transfers over it; the rehearsal
(server/ops/rehearsal.py) shapes a real link to it."""

from __future__ import annotations

from dataclasses import dataclass

from fedseq.common.errors import ConfigError


@dataclass(frozen=True)
class LinkProfile:
    """One device's link: rates in Mbit/s each way, one-way delay and jitter in ms, loss in %."""

    name: str
    down_mbit: float
    up_mbit: float
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def down_s(self, nbytes: int) -> float:
        """Seconds to receive `nbytes` (one-way delay included; simulated time)."""
        return self.delay_ms / 1e3 + nbytes * 8 / (self.down_mbit * 1e6)

    def up_s(self, nbytes: int) -> float:
        """Seconds to send `nbytes` (one-way delay included; simulated time)."""
        return self.delay_ms / 1e3 + nbytes * 8 / (self.up_mbit * 1e6)

    def describe(self) -> str:
        """One line: the profile's rates, delay, jitter and loss."""
        return (f"{self.name}: {self.down_mbit:g}/{self.up_mbit:g} Mbit/s down/up, "
                f"{self.delay_ms:g} ± {self.jitter_ms:g} ms one way, {self.loss_pct:g}% loss")


#: Named profiles (docs/rehearsal.md gives each figure's source or says it is an assumption).
PROFILES: dict[str, LinkProfile] = {
    "wifi-good": LinkProfile("wifi-good", 20.0, 20.0, 2.0, 1.0, 0.0),
    "wifi-poor": LinkProfile("wifi-poor", 2.0, 2.0, 20.0, 10.0, 1.0),
    "lte": LinkProfile("lte", 10.0, 5.0, 27.5, 10.0, 0.0),
    "3g-fast": LinkProfile("3g-fast", 1.6, 0.75, 75.0, 0.0, 0.0),
}


def parse_profile(text: str, where: str = "--link") -> LinkProfile:
    """A profile name, or `custom:down=MBIT,up=MBIT,delay=MS,jitter=MS,loss=PCT` (down required;
    up defaults to down, the others to 0); `where`: what an error names (the flag or key)."""
    if text in PROFILES:
        return PROFILES[text]
    if not text.startswith("custom:"):
        raise ConfigError(f"{where} {text!r}: unknown profile; use one of {', '.join(PROFILES)} or "
                          "custom:down=MBIT,up=MBIT,delay=MS,jitter=MS,loss=PCT")
    fields: dict[str, float] = {}
    for part in text[len("custom:"):].split(","):
        key, _, value = part.partition("=")
        if key not in ("down", "up", "delay", "jitter", "loss"):
            raise ConfigError(f"{where} {text!r}: unknown field {key!r}; fields: down, up, delay, "
                              "jitter, loss")
        try:
            fields[key] = float(value)
        except ValueError:
            raise ConfigError(f"{where} {text!r}: {key}={value!r} is not a number") from None
    if fields.get("down", 0) <= 0 or fields.get("up", fields.get("down", 1)) <= 0:
        raise ConfigError(f"{where} {text!r}: down (and up) must be a rate in Mbit/s above 0")
    if not 0 <= fields.get("loss", 0) < 100 or fields.get("delay", 0) < 0 or fields.get("jitter", 0) < 0:
        raise ConfigError(f"{where} {text!r}: loss must be 0-100 %, delay and jitter >= 0 ms")
    return LinkProfile("custom", fields["down"], fields.get("up", fields["down"]),
                       fields.get("delay", 0.0), fields.get("jitter", 0.0), fields.get("loss", 0.0))
