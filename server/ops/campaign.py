"""Campaigns: many runs of one grid back to back, unattended (`fedseq-sim --campaign FILE`,
`fedseq-server campaign FILE`).

A campaign file (TOML) names a base experiment config, the algorithms, the seeds, overrides for
every run (`set`), named settings (each its own overrides) and the order of the grid's axes, and
whether a failed run stops the campaign. Every run writes a normal run directory,
OUT/<setting>/<algorithm>/seed-<s> (OUT/<algorithm>/seed-<s> without named settings), and
OUT/campaign.json records the grid and each run's outcome. The same command again continues the
campaign: finished runs are kept, an interrupted one resumes after its last complete round, a
failed one is tried again, missing ones start; a campaign file whose runs changed is refused,
one that only adds runs appends them.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedseq.common.config import ExperimentConfig, load_config
from fedseq.common.errors import ConfigError, DatasetError, FedseqError, validation_problem
from fedseq.common.files import atomic_write
from fedseq.server.rounds.seeds import (
    changed_keys,
    defining,
    parse_seeds,
    parse_vary,
    seed_config,
    seed_dir,
    seed_state,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Axis = Literal["setting", "algorithm", "seed"]
AXES: tuple[Axis, ...] = ("setting", "algorithm", "seed")
STATE_FILE = "campaign.json"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}")  # fullmatch: `$` would pass a "\n"


class Setting(BaseModel):
    """[settings.NAME]: one named setting of the grid."""

    model_config = ConfigDict(extra="forbid")
    set: list[str] = Field(default_factory=list, description=(
        "Overrides of this setting, as --set takes them: [\"data.alpha=0.5\"]."))
    algorithms: list[str] = Field(default_factory=list, description=(
        "The algorithms this setting runs, in place of the campaign's (an arm that is one "
        "algorithm: [\"fedseq-anti\"]); empty: the campaign's."))


class CampaignFile(BaseModel):
    """A campaign file: the grid of runs and how to go through it."""

    model_config = ConfigDict(extra="forbid")
    config: Path = Field(description="The base experiment config (TOML), relative to this file.")
    algorithms: list[str] = Field(default_factory=list, description=(
        "The algorithms (algorithm.name) of the grid; empty: the base config's."))
    seeds: str | list[int] = Field("0", description="The seeds: 0-4, \"0,1,2\" or [0, 1, 2].")
    vary: str = Field("all", description=(
        "The random streams the seed changes, as fedseq-sim --vary: all, or some of data, init, "
        "selection, training."))
    set: list[str] = Field(default_factory=list, description="Overrides of every run of the grid.")
    settings: dict[str, Setting] = Field(default_factory=dict, description=(
        "Named settings, each with its own overrides; none: the base config alone."))
    order: list[Axis] = Field(
        default_factory=lambda: list(AXES), description=(
            "The grid's axes, outermost first: [\"seed\", \"setting\", \"algorithm\"] runs every "
            "algorithm of seed 0 before seed 1."))
    on_failure: Literal["continue", "stop"] = Field("continue", description=(
        "What a failed run does to the campaign: continue with the next run, or stop."))

    @field_validator("settings")
    @classmethod
    def _folder_names(cls, v: dict[str, Setting]) -> dict[str, Setting]:
        bad = [name for name in v if not _NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"setting name {bad[0]!r} is not a folder name (letters, digits, "
                             "_ - . and no leading dot)")
        return v

    @field_validator("order")
    @classmethod
    def _every_axis_once(cls, v: list[str]) -> list[str]:
        if sorted(v) != sorted(AXES):
            raise ValueError(f"{v}: name each of setting, algorithm and seed once")
        return v


@dataclass(frozen=True)
class CampaignRun:
    """One run of the grid: its place, its folder (relative to the campaign's) and its config."""

    setting: str | None
    algorithm: str
    seed: int
    folder: str
    cfg: ExperimentConfig

    @property
    def name(self) -> str:
        """The run as the campaign's lines name it: its folder without the seed, then the seed."""
        return self.folder.removesuffix(f"/seed-{self.seed}") + f" seed {self.seed}"


def load_campaign(path: Path, extra: list[str] | None = None) -> tuple[CampaignFile, list[CampaignRun]]:
    """The campaign file and its runs in the file's order; `extra`: --set overrides applied to
    every run after the file's own. Raises ConfigError in one line."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"campaign file {path} not found; pass an existing FILE") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc}); fix the file") from exc
    try:
        spec = CampaignFile.model_validate(raw)
    except ValidationError as exc:
        p = validation_problem(exc)
        msg = "unknown key (see docs/how-to/campaigns.md)" if p.kind == "extra_forbidden" else p.msg
        raise ConfigError(f"{path}: {p.where or 'campaign'}: {msg}; fix the file{p.more}") from exc
    base = spec.config if spec.config.is_absolute() else path.parent / spec.config
    seeds = spec.seeds if isinstance(spec.seeds, list) else parse_seeds(spec.seeds)
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ConfigError(f"{path}: seeds {seeds}: give distinct seeds >= 0")
    vary = parse_vary(spec.vary)
    first = load_config(base, spec.set + list(extra or []))
    algorithms = spec.algorithms or [first.algorithm.name]
    if len(set(algorithms)) != len(algorithms):
        raise ConfigError(f"{path}: algorithms {algorithms} names one twice; give each once")
    settings: list[tuple[str | None, list[str], list[str]]] = (
        [(name, s.set, s.algorithms) for name, s in spec.settings.items()] or [(None, [], [])])
    every = list(dict.fromkeys(algorithms + [a for _, _, own in settings for a in own]))
    axes = {"setting": list(range(len(settings))), "algorithm": every, "seed": seeds}
    runs = []
    for combo in itertools.product(*(axes[a] for a in spec.order)):
        at = dict(zip(spec.order, combo, strict=True))
        name, overrides, own = settings[at["setting"]]
        if at["algorithm"] not in (own or algorithms):
            continue
        alg, seed = at["algorithm"], at["seed"]
        where = f"{path} (setting {name})" if name else str(path)
        try:
            cfg = load_config(base, spec.set + overrides + list(extra or [])
                              + [f"algorithm.name={json.dumps(alg)}"])
        except ConfigError as exc:
            raise ConfigError(f"{where}, algorithm {alg}: {exc}") from None
        folder = "/".join(p for p in (name, alg, seed_dir(Path(""), seed).name) if p)
        runs.append(CampaignRun(name, alg, seed, folder, seed_config(cfg, seed, vary)))
    return spec, runs


class Campaign:
    """A campaign's folder: OUT/campaign.json (its runs, each with its config's defining part
    and its outcome) beside the runs' directories."""

    def __init__(self, out: Path, runs: list[CampaignRun], source: Path):
        self.out, self.runs, self.source = Path(out), runs, Path(source)
        self.file = self.out / STATE_FILE
        self.outcomes: dict[str, dict[str, Any]] = {}

    def open(self, announce: Callable[[str], None]) -> None:
        """Check the runs against what the folder holds: a campaign started before must have the
        same runs (it may have more now: they are appended), else ConfigError in one line."""
        if self.file.exists():
            try:
                before = json.loads(self.file.read_text())
                old = {r["folder"]: r for r in before["runs"]}
                if not all(isinstance(f, str) and isinstance(r.get("config"), dict)
                           and isinstance(r.get("outcome", {}), dict) for f, r in old.items()):
                    raise ValueError("a run entry of another shape")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{self.file} is damaged ({exc}); move the folder away or pass "
                                  "another --out") from None
            new = {r.folder: r for r in self.runs}
            gone = [f for f in old if f not in new]
            if gone:
                raise ConfigError(f"{self.source} no longer has run {gone[0]} of the campaign in "
                                  f"{self.out} ({len(gone)} runs gone): restore the file, or pass "
                                  "another --out")
            for folder, r in old.items():
                # both with every default filled in: a key a newer fedseq added, at its
                # default, is no change
                changed = changed_keys(defining(r["config"]),
                                        defining(new[folder].cfg.model_dump(mode="json")))
                if changed:
                    raise ConfigError(f"{self.source} changed run {folder} of the campaign in "
                                      f"{self.out} ({', '.join(changed[:3])}): restore the file, "
                                      "or pass another --out")
            self.outcomes = {f: r.get("outcome", {}) for f, r in old.items()}
            added = len(new) - len(old)
            if added:
                announce(f"campaign: {added} runs added to the {len(old)} in {self.out}")
        elif self.out.exists() and any(self.out.iterdir()):
            raise ConfigError(f"{self.out} holds something other than a campaign; pass an empty "
                              "or new --out")
        self.out.mkdir(parents=True, exist_ok=True)
        self.save()

    def save(self) -> None:
        """Write campaign.json (atomically): every run's defining config and its outcome."""
        runs = [{"folder": r.folder, "setting": r.setting, "algorithm": r.algorithm,
                 "seed": r.seed, "config": defining(r.cfg.model_dump(mode="json")),
                 "outcome": self.outcomes.get(r.folder, {"state": "pending"})} for r in self.runs]
        atomic_write(self.file, json.dumps({"source": str(self.source), "runs": runs},
                                           indent=1).encode())

    def mark(self, run: CampaignRun, state: str, reason: str | None = None) -> None:
        """Record a run's outcome (its state, when, why) and save."""
        self.outcomes[run.folder] = {"state": state, "at": time.time(),
                                     **({"reason": reason} if reason else {})}
        self.save()

    def go(self, run_one: Callable[[CampaignRun, Path, str, dict[str, Any]], None],
           stop_on_failure: bool, announce: Callable[[str], None],
           progress: Progress | None = None) -> dict[str, int]:
        """Every run not finished, in order: run_one(run, its folder, mode, info) with mode
        new, resume or overwrite (a run that died before its first checkpoint). A FedseqError
        fails the run (recorded with its reason); KeyboardInterrupt stops the campaign, the run
        resumable. Counts by outcome."""
        n = len(self.runs)
        this = _Pass(self, n, stop_on_failure, announce, progress)
        counts, broken, failed = this.counts, this.broken, this.failed
        for i, run in enumerate(self.runs, 1):
            path = self.out / run.folder
            if run.setting in broken:
                self.mark(run, "skipped", f"not run: its setting failed ({broken[run.setting]})")
                counts["not run"] += 1
                continue
            try:
                state = seed_state(path, run.cfg)  # its folder may hold another run: it fails
            except FedseqError as exc:
                if failed(i, run, exc):
                    break
                continue
            if state == "finished":
                counts["finished before"] += 1
                if self.outcomes.get(run.folder, {}).get("state") != "finished":
                    self.mark(run, "finished")
                continue
            mode = {"restart": "overwrite"}.get(state, state)
            announce(f"campaign run {i} of {n}: {run.name} ({mode}) -> {path}")
            self.mark(run, "running")
            if progress is not None:
                progress.run_started(i, run)
            try:
                run_one(run, path, mode, {"campaign": str(self.out.resolve()),
                                          "campaign_run": f"{i} of {n}"})
            except FedseqError as exc:
                if failed(i, run, exc):
                    break
                continue
            except BaseException:
                self.mark(run, "interrupted")
                if progress is not None:
                    progress.ended("interrupted")
                raise
            self.mark(run, "finished")
            counts["finished"] += 1
        else:
            if progress is not None:
                progress.ended("finished")
        return counts


@dataclass
class _Pass:
    """One pass of `Campaign.go` over the runs: its counts by outcome, the settings found
    broken, and what a failed run does to the rest."""

    campaign: Campaign
    n: int
    stop_on_failure: bool
    announce: Callable[[str], None]
    progress: Progress | None
    counts: dict[str, int] = field(default_factory=lambda: {
        "finished before": 0, "finished": 0, "failed": 0, "not run": 0})
    broken: dict[str | None, str] = field(default_factory=dict)  # setting -> its error

    def failed(self, i: int, run: CampaignRun, exc: FedseqError) -> bool:
        """Record the failure; whether the campaign stops there (on_failure = "stop"). An
        error of the config or the data (a missing dataset file, a split that cannot be made)
        is one the setting's other runs would meet again: they are skipped, whatever
        on_failure says."""
        self.campaign.mark(run, "failed", str(exc))
        self.counts["failed"] += 1
        self.announce(f"campaign run {i} of {self.n}: {run.name} failed: {exc}")
        if isinstance(exc, (ConfigError, DatasetError)):
            self.broken[run.setting] = str(exc)
            self.announce("campaign: the remaining runs" + (f" of setting {run.setting}"
                          if run.setting else "") + " are skipped (the same config or data "
                          "error); fix it in the campaign file, its config or --set, then run "
                          "the same command again")
        if self.stop_on_failure:
            self.counts["not run"] = self.n - i
            self.announce("campaign stopped (on_failure = \"stop\"); run the same command "
                          "again to try the failed run again and go on")
            if self.progress is not None:
                self.progress.ended("stopped")
        return self.stop_on_failure


class CampaignStatus(BaseModel):
    """A campaign's progress, retained on the broker (Topics.campaign) for `fedseq-server status`:
    JSON the coordinator writes and no device reads."""

    model_config = ConfigDict(extra="ignore")
    campaign: str = Field(description="The campaign's folder on the coordinator.")
    state: Literal["running", "finished", "stopped", "interrupted"] = "running"
    run: int = Field(0, description="The run going on, from 1 (0: none yet).")
    runs: int = Field(0, description="The campaign's runs.")
    folder: str = Field("", description="The run going on, as OUT/<folder>.")
    round: int = Field(-1, description="Its last complete round (-1: none yet).")
    rounds: int = Field(0, description="Its rounds.")
    finished: int = 0
    failed: int = 0
    seconds_per_round: float | None = Field(None, description=(
        "The mean seconds of the rounds this campaign process has measured."))
    left_s: float | None = Field(None, description=(
        "Rounds left in the campaign x seconds_per_round (fine-tuning not counted)."))
    updated: float = Field(0.0, description="Unix time of this status.")


class Progress:
    """Where a campaign is: fed by Campaign.go (each run's start and end) and by each round's
    row, it gives the CampaignStatus and calls `on_change` with it."""

    def __init__(self, book: Campaign, on_change: Callable[[CampaignStatus], None] = lambda s: None):
        self.book, self.on_change = book, on_change
        self.status = CampaignStatus(campaign=str(book.out), runs=len(book.runs))
        self.seconds: list[float] = []

    def _publish(self, **changes: Any) -> None:
        s = self.status.model_copy(update=changes)
        states = [o.get("state") for o in self.book.outcomes.values()]
        per_round = sum(self.seconds) / len(self.seconds) if self.seconds else None
        left = None
        if per_round is not None:  # this run's rounds to go, then every later unfinished run's
            later = sum(r.cfg.rounds for r in self.book.runs[s.run:]
                        if self.book.outcomes.get(r.folder, {}).get("state") != "finished")
            left = (max(0, s.rounds - s.round - 1) + later) * per_round
        self.status = s.model_copy(update={
            "finished": states.count("finished"), "failed": states.count("failed"),
            "seconds_per_round": per_round, "left_s": left, "updated": time.time()})
        self.on_change(self.status)

    def run_started(self, index: int, run: CampaignRun) -> None:
        """Publish that run `index` started."""
        self._publish(run=index, folder=run.folder, round=-1, rounds=run.cfg.rounds)

    def round_done(self, round: int, phase: str, seconds: float | None) -> None:
        """Publish a run's finished round (a training round's seconds count toward the time
        left)."""
        if phase == "train" and seconds is not None:
            self.seconds.append(seconds)
        self._publish(round=round if phase == "train" else self.status.round)

    def ended(self, state: str) -> None:
        """Publish the campaign's end: its state."""
        self._publish(state=state)
