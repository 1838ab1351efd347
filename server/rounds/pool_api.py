"""What the round asks of a pool, the transport that trains its selected clients: the `ClientPool`
protocol and the typed outcomes it hands back. The round loop (coordinator.py) talks only to it;
the pools (server/pools/: in-process, torch.distributed, an MQTT fleet) implement it.

A pool transports: it dispatches a step to the clients and hands back typed outcomes. Every
decision (who is selected, which update counts, whether a round has its quorum, when to evaluate,
what a checkpoint holds) stays with the round loop.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.evaluation import EvalReport
from fedseq.common.models import Weights
from fedseq.common.protocol.messages import SiteResultHeader

if TYPE_CHECKING:
    from fedseq.server.rounds.contract import RoundContract
    from fedseq.server.rounds.records import Rejection

#: the round loop's verdict on one update: None = valid, else why it is rejected
UpdateCheck = Callable[[ClientUpdate], "Rejection | None"]
#: the round loop's verdict on one client's reported test score (client, correct, total)
ScoreCheck = Callable[[int, int, int], "str | None"]
#: (clients done, clients in all) while fine-tuning
Progress = Callable[[int, int], None]
#: client -> (correct, total) on its own test rows
Scores = dict[int, tuple[int, int]]


@dataclass
class RoundOutcome:
    """What happened in a training step besides the valid updates (which the pool hands over
    while they arrive): filled in once the step's updates are exhausted."""

    #: selected clients whose device said it cannot run this step (no update will come)
    blocked: set[int] = field(default_factory=set)
    #: device -> the reason it gave for not running the step (deployment only)
    device_failures: dict[str, str] = field(default_factory=dict)
    #: seconds the transport waited for updates at most; None: no deadline (in-process)
    deadline_s: float | None = None
    #: client -> the device that sent its accepted update (deployment only)
    reporters: dict[int, str] = field(default_factory=dict)
    #: updates of an earlier step that arrived during this one and were dropped
    late_updates: int = 0
    #: devices still owing updates when the deadline passed (not failed, not offline)
    missed_deadline: list[str] = field(default_factory=list)
    #: the device that finished last, and how many seconds the round waited for it after the
    #: next slowest had finished (deployment only; None with fewer than two complete devices)
    slowest: tuple[str, float] | None = None
    #: devices of the fleet that were online and able to train when the step ended (neither
    #: failed in it nor unable to run the run); None: no devices (in-process)
    able_devices: int | None = None
    #: payload bytes (sent, received) on the coordinator's connection since the previous step
    #: measured, this one included; None where nothing crosses a wire (in-process)
    wire: tuple[int, int] | None = None
    #: over-selection: the clients whose update was not waited for once `enough` had come
    cancelled: list[int] = field(default_factory=list)


@dataclass
class EvalOutcome:
    """An evaluate step: the scores (`report`; a remote pool leaves the global model's fields
    None) and the payload bytes (sent, received) its connection measured since the previous step
    (None in-process)."""

    report: EvalReport
    wire: tuple[int, int] | None = None


@dataclass
class FinetuneOutcome:
    """A finetune step: each client's score after fine-tuning; the clients whose fine-tuning hit
    a NaN or Inf loss and stopped, with the batch where it did (their scores are their diverged
    models'); the joules each client's fine-tuning took on its device (clients without a figure
    left out; None where nothing is measured: in-process)."""

    scores: Scores
    diverged: dict[int, int] = field(default_factory=dict)
    energy: dict[int, float] | None = None
    #: data.placement = "device", evaluate: device -> the global model on its clients' test rows
    global_scores: dict[str, tuple[int, int]] = field(default_factory=dict)


class TrainRound:
    """A dispatched training step. Iterating yields the valid updates (at most one per client,
    only those the round loop's check accepted) in client order, as soon as they can be folded
    in; after the iteration, `outcome` says what else happened."""

    def __init__(self, updates: Generator[ClientUpdate, None, RoundOutcome]):
        self._updates = updates
        self.outcome = RoundOutcome()

    def __iter__(self) -> Iterator[ClientUpdate]:
        self.outcome = yield from self._updates


@dataclass
class PoolState:
    """What a pool needs to continue a run after a restart: JSON-able bookkeeping (the MQTT pool's
    run id, step sequence, assignment, block versions) and the personal blocks it holds for its
    clients (the in-process pool; on a fleet they live on the devices' disks)."""

    state: dict[str, Any] | None = None
    personal: dict[int, Weights] = field(default_factory=dict)


class ClientPool(Protocol):
    """The transport between the round loop and the logical clients. A pool is a context
    manager: what it opened (a broker connection, worker processes) is closed when its block
    ends (server/rounds/run.py enters it on the run's stack)."""

    def __enter__(self) -> ClientPool: ...

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None: ...

    def open(self, weights: Weights, personal: tuple[str, ...]) -> None:
        """Before the first step of a run (new or resumed): make the run, the current global
        blocks and the names of the algorithm's personal blocks known to the clients."""
        ...

    def train(self, round: int, clients: list[int], plan: ClientPlan, weights: Weights,
              check: UpdateCheck, enough: int | None = None, secure: Any = None) -> TrainRound:
        """Have the selected clients train `plan` from `weights` (plus their personal blocks);
        `enough` (over-selection on a fleet): stop waiting once that many valid updates came. A
        simulation's pools train every client they are given (the round loop gives them only
        the first to arrive on its simulated fleet) and ignore it. `secure`: the round's
        SecureSum under [secagg]; a pool of devices (`masks_on_devices`) relays its stages,
        others ignore it (its clients' side is played in this process)."""
        ...

    def evaluate(self, weights: Weights, eval_heads: tuple[str, ...], check: ScoreCheck
                 ) -> EvalOutcome:
        """Every client's personalized model (`weights` overridden by its personal blocks,
        `eval_heads` summed) on its own test rows. A pool that holds every client's test rows
        (in-process) also scores the global model in the same forward pass; a remote one leaves
        the global fields None and the round loop scores the global model itself."""
        ...

    def finetune(self, plan: ClientPlan, weights: Weights, eval_heads: tuple[str, ...],
                 check: ScoreCheck, progress: Progress) -> FinetuneOutcome:
        """Every client fine-tunes from `weights` and reports accuracy on its own test rows."""
        ...

    def snapshot(self) -> PoolState:
        """What a checkpoint must hold for this pool to continue the run."""
        ...

    def restore(self, state: PoolState) -> None:
        """Continue from a checkpoint's `snapshot()` (before `open`)."""
        ...


@dataclass
class SiteRounds:
    """What the edge aggregators answered for a round: each answering site's result (its header,
    as validated on receipt, and its partial's deltas) and why each other site sent none; the
    outcome's deadline and wire bytes."""

    answers: dict[str, tuple[SiteResultHeader, Weights]] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    outcome: RoundOutcome = field(default_factory=RoundOutcome)


@runtime_checkable
class SiteAggregators(Protocol):
    """A pool whose sites fold their own clients' updates: [hierarchy] on a fleet, an edge
    aggregator per site (server/pools/mqtt/edges.py). The round loop's EdgeSites (sites.py)
    asks it for the sites' partials instead of running the site rounds itself."""

    def site_rounds(self, round: int, by_site: dict[str, list[int]], plan: ClientPlan,
                    needed: list[str], start: Weights, contract: RoundContract) -> SiteRounds:
        """Have each site run its k site rounds of global round `round` over its selected
        clients (`by_site`) from the global model `start` (`needed`: the blocks its clients
        receive; `contract`: the round's bound on a delta and clip norm), and hand back what
        each site answered; the round loop admits every partial (the round contract's `admit`)."""
        ...


class Asking(Protocol):
    """`AsyncPool.asker`: asks again for answers lost on the way."""

    def poll(self, owed: list[int]) -> None:
        """After each wait for events: ask again for `owed` clients' answers after a silence."""
        ...


class AsyncPool(ClientPool, Protocol):
    """A pool whose clients train at their devices' own pace (train.mode = "async" on a real
    fleet: the MQTT pool; server/pools/mqtt/arrivals.py `MqttArrivals` drives it). The in-process
    and `--workers` pools need none of this: a simulation's arrivals come in the order of its
    simulated fleet's clock (buffered.py `VirtualArrivals`), and they train through
    `ClientPool.train` like a round's clients.

    An event from `async_events` is an update that arrived (`take` reads it, `release` drops it),
    a device gone offline, or a device that failed its step."""

    def device_of(self, client: int) -> str | None:
        """The device hosting `client` (None: none yet)."""
        ...

    def can_train(self, client: int, failing: Collection[str] = ()) -> bool:
        """Whether `client`'s device can train now (not one of `failing`)."""
        ...

    def online_devices(self) -> set[str]:
        """The devices online that host a client."""
        ...

    def cannot_run(self) -> dict[str, str]:
        """Devices that said they cannot run any step of this run -> why."""
        ...

    def await_devices(self) -> None:
        """Wait for the devices as a round does before its step."""
        ...

    def dispatch(self, round: int, flights: dict[int, int | None], plan: ClientPlan,
                 weights: Weights) -> int:
        """Publish model version `round` and the clients in flight, each with the step that
        dispatched it (None: this one); returns this step's number."""
        ...

    def async_events(self, timeout: float) -> list[Any]:
        """What the devices sent within `timeout` seconds."""
        ...

    def take(self, ev: Any) -> ClientUpdate:
        """An arrived update, its deltas in memory."""
        ...

    def release(self, ev: Any) -> None:
        """An arrived update nobody takes."""
        ...

    def asker(self) -> Asking:
        """What asks again for answers lost on the way, for one server step."""
        ...

    def wire_bytes(self) -> tuple[int, int]:
        """The (sent, received) bytes since the last call."""
        ...

    def end_async(self) -> None:
        """The asynchronous part is over: late updates are dropped from now on."""
        ...
