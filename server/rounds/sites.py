"""Edge sites ([hierarchy]): HierFAVG's two tiers (Liu et al. 2019, "Client-Edge-Cloud
Hierarchical Federated Learning") in a synchronous round.

The fleet's devices are grouped into sites; clients are dealt to the devices of all sites as a
deployment deals them (`assign_clients`: devices by name, round-robin), or with data.placement =
"device" are the clients each device holds (`deal`), so a client's site is its device's. In a
global round each site runs `hierarchy.edge_rounds` = k site rounds: its selected clients train
from the site's model, the site folds their valid updates as the coordinator would (the round
contract, the algorithm's weights, the codecs) and steps its model with their mean.
After the k-th it hands the coordinator one partial aggregate: its model's change since the
global model, in float32, with its total weight per tensor (`SitePartial`). The coordinator folds
the partials (`WeightedDeltaSum.add_partial`) and steps the global model as after a flat round.

With k = 1 a site's partial is its clients' weighted mean delta, so the two tiers give the flat
round's aggregate within float32 rounding of the means. Site round 0 trains under the global
round's key (the flat run's randomness); site round e > 0 under `edge_key(t, e)`.

`hierarchy.edge_aggregation = false` keeps the sites as the network's shape only (every update
crosses its site's link and is folded at the coordinator: the flat run, timed over the tree).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fedseq.common.algorithms.aggregate import ClientUpdate, WeightedDeltaSum
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.config import ExperimentConfig
from fedseq.common.errors import AggregationError, ConfigError
from fedseq.common.models import Weights, in_blocks
from fedseq.common.protocol.messages import SiteResultHeader
from fedseq.common.text import printable
from fedseq.server.privacy.secure_sum import SecureSum
from fedseq.server.rounds.contract import RoundContract, SitePartial, secure_stages
from fedseq.server.rounds.links import LinkProfile, parse_profile
from fedseq.server.rounds.pool_api import RoundOutcome, SiteAggregators, UpdateCheck
from fedseq.server.rounds.records import Rejection
from fedseq.server.rounds.virtual_fleet import VirtualFleet, sync_round

if TYPE_CHECKING:
    from fedseq.server.rounds.ledger import Ledger, RoundUpdates

log = logging.getLogger(__name__)

#: site round e > 0 of global round t trains under the key t + e * EDGE_STRIDE (its own
#: randomness, apart from every global round's)
EDGE_STRIDE = 1 << 32


def assign_clients(devices: list[str], num_clients: int) -> dict[str, list[int]]:
    """Balanced and stable: devices sorted by name, clients dealt round-robin."""
    names = sorted(devices)
    return {d: list(range(i, num_clients, len(names))) for i, d in enumerate(names)}


def edge_key(t: int, e: int) -> int:
    """The training key of site round `e` of global round `t` (t itself for the first)."""
    return t + e * EDGE_STRIDE


@dataclass(frozen=True)
class Site:
    """One site: its name, its devices (by name), the clients they hold and its link to the
    coordinator (None: no cost in simulated time)."""

    name: str
    devices: tuple[str, ...]
    clients: frozenset[int]
    link: LinkProfile | None = None


def site_tree(cfg: ExperimentConfig, fleet: VirtualFleet | None = None,
              owners: tuple[str, ...] | None = None) -> list[Site]:
    """The run's sites in name order. With a simulated fleet, its devices must be the sites'
    devices, name for name: a ConfigError listing the fleet's names otherwise. `owners`
    (data.placement = "device"): each client's device, whose site holds it (`deal`)."""
    h = cfg.hierarchy
    devices = sorted(h.site_of())
    if fleet is not None and sorted(d.name for d in fleet.devices) != devices:
        names = [d.name for d in fleet.devices]
        raise ConfigError("hierarchy.sites must list the [fleet]'s devices, each in one site: "
                          f"the fleet has {', '.join(names)}; the sites list "
                          f"{', '.join(devices)}")
    dealt = deal(cfg, owners)
    return [Site(name, tuple(sorted(ds)), frozenset(c for d in ds for c in dealt[d]),
                 parse_profile(h.links[name], f"hierarchy.links.{name}") if name in h.links
                 else None)
            for name, ds in sorted(h.sites.items())]


def deal(cfg: ExperimentConfig, owners: tuple[str, ...] | None = None) -> dict[str, list[int]]:
    """Each device of the sites -> its clients: dealt round-robin (`assign_clients`), or with
    data.placement = "device" the clients each device holds (`owners`: each client's device, in
    client-id order), where a device outside every site is a ConfigError."""
    devices = sorted(cfg.hierarchy.site_of())
    if owners is None:
        return assign_clients(devices, cfg.data.num_clients)
    stray = sorted(set(owners) - set(devices))
    if stray:
        raise ConfigError(f"device(s) {', '.join(stray[:10])} hold clients (data.placement = "
                          "\"device\") but are in no site: list each in hierarchy.sites")
    out: dict[str, list[int]] = {d: [] for d in devices}
    for c, d in enumerate(owners):
        out[d].append(c)
    return out


def partial_of(acc: WeightedDeltaSum, before: Weights, start: Weights, site: str = ""
               ) -> SitePartial:
    """A site's partial after its last site round: `acc` that round's aggregate, `before` the
    site's model it trained from, `start` the global model the global round began with. Each
    tensor's change (before - start) + the round's mean delta is computed in float64 and sent
    in float32; with one site round (before is start) it is the clients' weighted mean delta."""
    deltas: Weights = {}
    weights: dict[str, float] = {}
    for k, s in acc.sums.items():
        w = acc.weights[k]
        if w <= 0:
            continue
        mean = s / w
        if before is not start:
            mean = mean + (before[k].to(torch.float64) - start[k].to(torch.float64))
        deltas[k] = mean.to(torch.float32)
        weights[k] = w
    return SitePartial(deltas, weights, acc.clients_added(), site)


class EdgeSites:
    """The sites of a run and their part of a synchronous round: `train` runs every site's k
    site rounds over the run's pool and folds each site's partial into the round's aggregate,
    with the per-client bookkeeping (norms, FLOPs, bytes) of every update a site folded."""

    def __init__(self, book: Ledger):
        self.book = book
        self.k = book.cfg.hierarchy.edge_rounds
        self.sites = site_tree(book.cfg, book.fleet, book.data.owners)
        if self.k > 1 and book.alg.site_rounds_problem is not None:
            raise ConfigError(f"hierarchy.edge_rounds = {self.k}: {book.alg.name} cannot take "
                              f"several site rounds: {book.alg.site_rounds_problem}; use "
                              "edge_rounds = 1")
        #: client -> its site's name
        self.home = {c: site.name for site in self.sites for c in site.clients}
        self.sites_by_name = {site.name: site for site in self.sites}
        #: what reached the coordinator in the last round: (messages, frame bytes)
        self.upstream = (0, 0)
        #: [secagg], the last round: clients whose masks were recovered, clients left out
        self.recovered: list[int] = []
        self.excluded: dict[int, str] = {}

    def site_of(self, clients: list[int]) -> dict[str, list[int]]:
        """`clients` by site (sites in name order, clients in order), sites without one left out."""
        out: dict[str, list[int]] = {site.name: [] for site in self.sites}
        for c in clients:
            out[self.home[c]].append(c)
        return {s: cs for s, cs in out.items() if cs}

    def train(self, t: int, trainers: list[int], plan: ClientPlan, needed: list[str],
              contract: RoundContract, got: RoundUpdates,
              checker: Callable[[RoundContract], UpdateCheck]) -> None:
        """Every site's k site rounds of global round t, their partials folded into `got`: run
        here over the run's pool, or on a fleet by each site's edge aggregator (the pool's
        `SiteAggregators`). Every partial passes the contract's `admit` first; one that does not costs
        its site's clients the round, recorded with why."""
        book = self.book
        start = book.offered()
        if isinstance(book.pool, SiteAggregators):
            made = self._remote(t, trainers, plan, needed, start, contract, got)
        else:
            made = [(p, got.samples, None) for p in self.partials(
                t, trainers, plan, needed, contract, got, checker, start,
                book.sent(in_blocks(start, needed)))]
        partials = []
        for p, samples, head in made:
            why = contract.admit(p, self.sites_by_name[p.site].clients,
                                 {c: samples[c] for c in p.clients if c in samples}, self.k)
            if why is not None:
                log.warning("round %d: site %s's partial is refused: %s", t, p.site, why)
                got.outcome.device_failures[f"site {p.site}"] = f"its partial was refused: {why}"
                got.outcome.blocked |= set(self.site_of(trainers).get(p.site, []))
                continue
            if head is not None:
                self._note(t, got, head, plan, contract)
            partials.append(p)
        for p in partials:  # in site order
            got.aggregate.add_partial(p.deltas, p.weights, p.clients)  # type: ignore[attr-defined]
        # a client counts once a round, and only in a site's partial (a site whose round failed
        # loses its clients' updates, as a failed round loses all)
        counted = {c for p in partials for c in p.clients}
        got.reported = [c for c in sorted(dict.fromkeys(got.reported)) if c in counted]
        got.local_scores = {c: x for c, x in got.local_scores.items() if c in counted}
        self.upstream = (len(partials), sum(book.update_bytes(p.deltas) for p in partials))

    def _remote(self, t: int, trainers: list[int], plan: ClientPlan, needed: list[str],
                start: Weights, contract: RoundContract, got: RoundUpdates
                ) -> list[tuple[SitePartial, dict[int, tuple[int, int | None]],
                                SiteResultHeader | None]]:
        """A fleet's edge aggregators run the sites' rounds: each answering site's partial,
        the sample counts it claims and its result (what it says of its clients, noted once
        the partial passed its check); a silent site's clients recorded as missing with why."""
        pool = self.book.pool
        assert isinstance(pool, SiteAggregators)
        by_site = self.site_of(trainers)
        answered = pool.site_rounds(t, by_site, plan, needed, start, contract)
        got.outcome = answered.outcome
        self.recovered, self.excluded = [], {}
        out: list[tuple[SitePartial, dict[int, tuple[int, int | None]],
                        SiteResultHeader | None]] = []
        for site, clients in by_site.items():
            if site not in answered.answers:
                why = answered.missing.get(site, "it sent nothing")
                log.warning("round %d: site %s sent no partial: %s", t, site, why)
                got.outcome.device_failures[f"site {site}"] = why
                got.outcome.blocked |= set(clients)
                continue
            head, deltas = answered.answers[site]
            got.outcome.device_failures.update(head.failures)
            got.outcome.blocked |= set(head.blocked) & set(clients)
            # [secagg]: what the site's secure rounds recovered and proved, of its own clients
            self.recovered += [c for c in head.recovered if c in clients]
            left = {c: printable(why, 300) for c, why in head.excluded.items()
                    if c in clients and c not in self.book.excluded}
            self.book.excluded.update(left)
            self.excluded.update(left)
            for c, why in head.rejected.items():
                if c in clients:
                    got.rejected[c] = Rejection("at-site", f"site {site}: {printable(why, 300)}")
            out.append((SitePartial(deltas, dict(head.weights), [f.client for f in head.clients],
                                    site),
                        {f.client: (f.num_samples, f.effective_samples) for f in head.clients},
                        head))
        return out

    def _note(self, t: int, got: RoundUpdates, head: SiteResultHeader, plan: ClientPlan,
              contract: RoundContract) -> None:
        """What a site's partial (checked) says of the updates it folded, noted in the round's
        row as the coordinator notes the updates it folds itself (their FLOPs and steps counted
        once per site round); a local score that cannot be the client's is left out."""
        if self.book.cfg.secagg.enabled:  # its clients' secure stages' bytes, counted there
            got.bytes_up += head.bytes_up
        for f in head.clients:
            score = None
            if f.local_correct is not None and f.local_total is not None:
                score = (f.local_correct, f.local_total)
                wrong = (contract.score_problem(f.client, score) if contract.test_samples
                         is not None else "its test rows are not known here")
                if wrong is not None:
                    log.warning("round %d: site %s's local score of client %d is left out: %s",
                                t, head.site, f.client, wrong)
                    score = None
            for e in range(f.folds):  # its seconds (of all its site rounds) and bytes once
                update = ClientUpdate(f.client, t, {}, f.num_samples, f.effective_samples,
                                      0.0 if e else f.train_seconds, score, device=f.device,
                                      under_clip=f.under_clip)
                self.book.account(got, update, plan, f.norm, None if e else f.upload_bytes)
            got.costs[f.client] = (f.device, None)
            got.outcome.reporters[f.client] = f.device

    def partials(self, t: int, trainers: list[int], plan: ClientPlan, needed: list[str],
                 contract: RoundContract, got: RoundUpdates,
                 checker: Callable[[RoundContract], UpdateCheck], start: Weights,
                 first: Weights) -> list[SitePartial]:
        """The k site rounds of global round t of every site holding one of `trainers` (an
        edge aggregator: its own), from the model `start` (`first`: its needed blocks as the
        clients receive them); each site's partial, in site order (none for a site whose
        rounds failed or folded nothing). What the sites folded is noted in `got`."""
        book = self.book
        by_site = self.site_of(trainers)
        accs = {s: book.site_aggregate(t, cs, contract.reference) for s, cs in by_site.items()}
        self.recovered, self.excluded = [], {}
        # site round 0: every site trains from the global model, so one dispatch for all
        self._dispatch(t, trainers, plan, first, contract, checker, got,
                       lambda c: accs[self.home[c]])
        partials = []
        for site, clients in by_site.items():
            before, acc = start, accs[site]
            inner: WeightedDeltaSum | None = None
            for e in range(1, self.k + 1):
                try:
                    settled = self._settle(acc, before, got, edge_key(t, e - 1))
                    inner = settled
                    if e == self.k or not settled.count():
                        break
                    model = settled.apply(before)
                except AggregationError as exc:
                    log.warning("round %d: site %s's round %d failed: %s", t, site, e - 1, exc)
                    got.outcome.device_failures[f"site {site}"] = str(exc)
                    inner = None
                    break
                before, key = model, edge_key(t, e)
                reference = {k: model[k] for k in contract.reference}
                acc = book.site_aggregate(key, clients, reference)
                self._dispatch(key, clients, plan, book.sent(in_blocks(model, needed), fresh=True),
                               dataclasses.replace(contract, round=key, reference=reference),
                               checker, got, dict.fromkeys(clients, acc).__getitem__)
            if inner is not None and inner.count():
                partials.append(partial_of(inner, before, start, site))
        return partials

    def _settle(self, acc: WeightedDeltaSum | SecureSum, before: Weights, got: RoundUpdates,
                key: int) -> WeightedDeltaSum:
        """A site round's sum as the site knows it: under [secagg] unmasked (its clients' secure
        stages' bytes counted, the clients who dropped after sharing keys and those proven bad
        noted); AggregationError where it cannot be unmasked."""
        if not isinstance(acc, SecureSum):
            return acc
        try:
            return acc.unmask(before)
        finally:
            got.bytes_up += acc.bytes_up()
            self.recovered += acc.recovered
            self.excluded.update(self.book.exclude(acc.server.blamed, key))

    def _dispatch(self, key: int, clients: list[int], plan: ClientPlan, weights: Weights,
                  contract: RoundContract, checker: Callable[[RoundContract], UpdateCheck],
                  got: RoundUpdates, into: Callable[[int], WeightedDeltaSum | SecureSum]) -> None:
        """One site round's step over the pool, its updates checked against `contract`: each
        valid update folded into its site's aggregate (`into(client)`), the step's outcome
        merged into the round's. Under [secagg] an edge aggregator's pool of devices relays
        its site's secure sum's stages, its devices sending masked inputs (an in-process pool
        plays the clients' side: nothing to relay)."""
        book = self.book
        sums = list({id(a): a for a in map(into, clients)}.values())
        contract, relay = secure_stages(contract, sums[0] if len(sums) == 1 else None)
        dispatch = book.pool.train(key, clients, plan, weights, checker(contract), **relay)
        for update in dispatch:
            book.fold(got, update, plan, into=into(update.client))
            got.costs[update.client] = (update.device, update.cost)
        merge_outcome(got.outcome, dispatch.outcome)

    def timing(self, t: int, trainers: list[int], plan: ClientPlan, down: dict[int, int],
               needed: list[str]) -> tuple[float, dict[int, float]]:
        """Global round t on the simulated fleet over the sites: the round's seconds, and each
        client's seconds of training. A site receives the round's blocks over its link once,
        then its devices over theirs. Edge aggregation: k site rounds, each until its last
        update reached the site, each later one sending every needed block again (the site's
        model moved); then the partial over the site's link. Without: every update crosses the
        site's link after it reached the site, one at a time, in the order they arrive."""
        book = self.book
        fleet = book.fleet
        assert fleet is not None
        flops = {c: book.flops(c, plan) for c in trainers}
        up = book.upload_size(plan)
        again = book.blocks_bytes(needed)
        end, trained = 0.0, dict[int, float]()
        links = {site.name: site.link for site in self.sites}
        for name, mine in self.site_of(trainers).items():
            link = links[name]
            clock = link.down_s(max(down[c] for c in mine)) if link else 0.0
            if book.cfg.hierarchy.edge_aggregation:
                for e in range(self.k):
                    sizes = down if e == 0 else dict.fromkeys(mine, again)
                    timing = sync_round(fleet, mine, flops, sizes, up, edge_key(t, e))
                    for c, x in timing.items():
                        trained[c] = trained.get(c, 0.0) + x.train_s
                    clock += max(x.arrival for x in timing.values())
                clock += link.up_s(book.partial_size(plan)) if link else 0.0
            else:
                timing = sync_round(fleet, mine, flops, down, up, t)
                free = clock
                for x in sorted(timing.values(), key=lambda x: x.arrival):
                    sent_at = max(clock + x.arrival, free)
                    free = sent_at + (up * 8 / (link.up_mbit * 1e6) if link else 0.0)
                trained.update({c: x.train_s for c, x in timing.items()})
                clock = free + (link.delay_ms / 1e3 if link else 0.0)
            end = max(end, clock)
        return end, trained


def merge_outcome(into: RoundOutcome, step: RoundOutcome) -> None:
    """Add one site step's outcome to the round's: who could not train, who sent what."""
    into.blocked |= step.blocked
    into.device_failures.update(step.device_failures)
    into.reporters.update(step.reporters)
    into.late_updates += step.late_updates
    into.missed_deadline += [d for d in step.missed_deadline if d not in into.missed_deadline]
    if step.deadline_s is not None:
        into.deadline_s = max(into.deadline_s or 0.0, step.deadline_s)


__all__ = ["EDGE_STRIDE", "EdgeSites", "Site", "SitePartial", "assign_clients", "deal", "edge_key",
           "merge_outcome", "partial_of", "site_tree"]
