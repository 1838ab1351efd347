"""Edge sites ([hierarchy], server/rounds/sites.py): HierFAVG's two tiers in simulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import quick_config, resumed_after, same_run, without_seconds
from fedseq.common.algorithms.aggregate import WeightedDeltaSum
from fedseq.common.errors import ConfigError
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.rounds.sites import EdgeSites, assign_clients, edge_key, partial_of, site_tree

SITES = 'hierarchy.sites={a=["d0","d1"],b=["d2"]}'
FLEET = 'fleet.devices=[{profile="nano",count=3,link="wifi-good"}]'
FLEET_SITES = 'hierarchy.sites={a=["nano-00","nano-01"],b=["nano-02"]}'
SECURE_SITES = 'hierarchy.sites={a=["d0"],b=["d1","d2"]}'  # clients 0, 3 and 1, 2, 4
UPLINKS = 'hierarchy.links={a="custom:down=10,up=1,delay=20",b="custom:down=10,up=1,delay=20"}'


def max_dw(a, b) -> float:
    return max(float((a.global_weights[k].double() - b.global_weights[k].double()).abs().max())
               for k in a.global_weights)


def test_clients_are_dealt_to_the_sites_devices_as_a_deployment_deals_them(data_root):
    cfg = quick_config(data_root, "data.num_clients=7", SITES)
    tree = site_tree(cfg)
    dealt = assign_clients(["d2", "d0", "d1"], 7)
    assert [s.name for s in tree] == ["a", "b"]
    assert tree[0].clients == frozenset(dealt["d0"] + dealt["d1"]) == {0, 1, 3, 4, 6}
    assert tree[1].clients == frozenset(dealt["d2"]) == {2, 5}
    assert edge_key(5, 0) == 5 and edge_key(5, 1) != 5 and edge_key(5, 1) != edge_key(6, 0)


def test_with_data_on_the_devices_a_site_holds_its_own_devices_clients(tmp_path, one_thread,
                                                                      monkeypatch):
    """data.placement = "device": a client's site is the site of the device holding it (not a
    round-robin deal): in the tree, in a simulation's rounds (--devices-data), and a device
    holding clients outside every site is refused in one line."""
    from conftest import fmnist_devices, placed_config

    root = fmnist_devices(tmp_path / "devices", {"local01": ["."], "local02": ["cam-a", "cam-b"],
                                                 "local03": ["x", "y"]}, rows=40)
    cfg = placed_config(root, 'hierarchy.sites={a=["local01","local03"],b=["local02"]}',
                        "data.num_clients=5", "rounds=1")
    owners = ("local01", "local02", "local02", "local03", "local03")
    assert {s.name: sorted(s.clients) for s in site_tree(cfg, owners=owners)} == {
        "a": [0, 3, 4], "b": [1, 2]}
    assert {s.name: sorted(s.clients) for s in site_tree(cfg)} == {"a": [0, 2, 3], "b": [1, 4]}
    seen: list[tuple[str, list[int]]] = []
    real = EdgeSites.partials

    def spy(self, t, trainers, *a):
        seen.extend(self.site_of(trainers).items())
        return real(self, t, trainers, *a)

    monkeypatch.setattr(EdgeSites, "partials", spy)
    run_simulation(cfg, None)
    assert seen == [("a", [0, 3, 4]), ("b", [1, 2])]
    with pytest.raises(ConfigError) as err:
        site_tree(cfg, owners=(*owners[:4], "local09"))
    assert "local09 hold clients" in str(err.value) and "\n" not in str(err.value)


def test_a_partial_is_the_sites_mean_delta_with_its_weight():
    """k = 1: the clients' weighted mean delta, in float32, with their total weight; folded at
    the coordinator with another site's it gives the flat sum within float32 rounding."""
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(4, 3, generator=g)}
    updates = [({"w": torch.randn(4, 3, generator=g)}, float(n)) for n in (10, 30, 5, 7)]
    flat, a, b = WeightedDeltaSum(), WeightedDeltaSum(), WeightedDeltaSum()
    for i, (d, n) in enumerate(updates):
        flat.add(d, {"w": n}, i)
        (a if i < 2 else b).add(d, {"w": n}, i)
    pa, pb = partial_of(a, start, start), partial_of(b, start, start)
    assert pa.deltas["w"].dtype == torch.float32 and pa.weights == {"w": 40.0}
    torch.testing.assert_close(pa.deltas["w"].double(), a.sums["w"] / 40)
    top = WeightedDeltaSum()
    top.add_partial(pa.deltas, pa.weights, pa.clients)
    top.add_partial(pb.deltas, pb.weights, pb.clients)
    assert top.clients_added() == [0, 1, 2, 3] and top.count() == 4
    assert float((top.apply(start)["w"] - flat.apply(start)["w"]).abs().max()) <= 1e-6


@pytest.mark.parametrize("name", ["fedavg", "fedseq-anti", "fedper", "fedreg", "scaffold",
                                  "fednova", "feddyn", "fedadam"])
def test_two_tiers_with_one_site_round_are_the_flat_round(data_root, one_thread, name):
    """k = 1 is FedAvg through two tiers: after a round the global model is the flat run's
    within float rounding (max |dw| <= 1e-6), for a plain, a layer-scheduled, a personal, a
    rebalancing (FedReG's effective samples), a control-variate, a normalized, a dynamic-
    regularizer and a server-optimizer algorithm. The rows say one message a site reached the
    coordinator, and the clients each counted once."""
    over = (f"algorithm.name={name}", "rounds=1", "train.threads=1", "algorithm.finetune_epochs=0")
    flat = run_simulation(quick_config(data_root, *over), None)
    two = run_simulation(quick_config(data_root, *over, SITES), None)
    assert max_dw(flat, two) <= 1e-6
    row_flat, row_two = flat.rows[0], two.rows[0]
    assert row_two["upstream_messages"] == 2 and "upstream_messages" not in row_flat
    assert row_two["reported"] == row_flat["reported"] == [0, 1, 2, 3, 4]
    assert row_two["bytes_up"] == row_flat["bytes_up"]  # the devices' uploads, counted alike
    assert row_two["upstream_bytes"] < row_flat["bytes_up"]


def test_client_level_privacy_composes_over_sites(data_root, one_thread):
    """DP-FedAvg: clients clip, a site sums their clipped updates, the coordinator adds the
    noise once: the flat run's model within float rounding."""
    over = ("algorithm.name=fedavg", "rounds=1", "privacy.enabled=true", "privacy.clip_norm=0.5",
            "privacy.noise_multiplier=0.5", "seeds.noise=7", "train.threads=1",
            "algorithm.finetune_epochs=0")
    flat = run_simulation(quick_config(data_root, *over), None)
    two = run_simulation(quick_config(data_root, *over, SITES), None)
    assert max_dw(flat, two) <= 1e-6


@pytest.mark.parametrize("over,words", [
    (("train.mode=async",), "train.mode"),
    (("aggregation.rule=median",), "aggregation.rule"),
    (("train.over_select=1.5",), "train.over_select"),
    (("privacy.enabled=true", "hierarchy.edge_rounds=2"), "edge_rounds = 1"),
    (('hierarchy.sites={a=["d0"],b=["d0"]}',), "belongs to one site"),
    (('hierarchy.sites={a=[]}',), "has no devices"),
    (('hierarchy.sites={"a/b"=["d0"]}',), "site name"),
    (('hierarchy.links={c="lte"}',), "not among hierarchy.sites"),
])
def test_what_does_not_compose_is_refused_in_one_line(data_root, over, words):
    with pytest.raises(ConfigError) as err:
        quick_config(data_root, SITES, *over)
    assert words in str(err.value)


@pytest.mark.parametrize("over,words", [
    (("algorithm.name=scaffold", SITES, "hierarchy.edge_rounds=2"), "control variates"),
    (("algorithm.name=feddyn", SITES, "hierarchy.edge_rounds=2"), "server state h"),
    (("algorithm.name=fednova", SITES, "hierarchy.edge_rounds=2"), "tau_eff"),
    ((FLEET, SITES), "must list the [fleet]'s devices"),
    ((FLEET, FLEET_SITES, 'hierarchy.links={a="slow"}'), "hierarchy.links.a"),
])
def test_a_tree_the_run_cannot_follow_is_refused_in_one_line(data_root, over, words):
    with pytest.raises(ConfigError) as err:
        run_simulation(quick_config(data_root, "rounds=1", *over), None)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_k_site_rounds_train_each_client_k_times(data_root, one_thread):
    """k = 2: each selected client trains twice a round (its FLOPs and steps count twice; it is
    reported once), the sites' models differ from the flat run's, the downlink codec encodes
    each site's model afresh, and one round of it learns."""
    over = ("algorithm.name=fedavg", "rounds=1", "train.threads=1", "wire.down=fp16", SITES,
            "hierarchy.edge_rounds=2")
    one = run_simulation(quick_config(data_root, *over[:-2]), None)
    two = run_simulation(quick_config(data_root, *over), None)
    assert max_dw(one, two) > 1e-3
    assert two.rows[0]["train_flops"] == 2 * one.rows[0]["train_flops"]
    assert two.rows[0]["client_steps"] == 2 * one.rows[0]["client_steps"]
    assert two.rows[0]["reported"] == [0, 1, 2, 3, 4]
    assert two.final.global_acc >= 0.3  # it learns


@pytest.mark.slow("three simulations of 2 rounds: 15 s on 2 cores")
def test_a_two_tier_run_resumes_bitwise(data_root, tmp_path, one_thread):
    cfg = quick_config(data_root, "algorithm.name=fedper", "rounds=3", "train.threads=1", SITES,
                       "hierarchy.edge_rounds=2")
    resumed, whole = resumed_after(cfg, tmp_path / "run", 1), run_simulation(cfg, None)
    assert all(torch.equal(resumed.global_weights[k], v) for k, v in whole.global_weights.items())
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert without_seconds(rows) == without_seconds(whole.rows)
    assert resumed.final.per_client == whole.final.per_client


def test_sites_as_the_networks_shape_only_give_the_flat_run(data_root, one_thread):
    """edge_aggregation = false: every update is folded at the coordinator: the flat run's
    weights and rows bitwise, but for the tree's transport fields (one message an update)."""
    over = ("algorithm.name=fedavg", "rounds=2", "train.threads=1", "algorithm.finetune_epochs=0",
            FLEET)
    flat = run_simulation(quick_config(data_root, *over), None)
    relay = run_simulation(quick_config(data_root, *over, FLEET_SITES,
                                        "hierarchy.edge_aggregation=false"), None)
    assert all(torch.equal(flat.global_weights[k], v) for k, v in relay.global_weights.items())
    tree_fields = {"upstream_messages", "upstream_bytes", "virtual_s", "virtual_time_s",
                   "modelled_energy_j"}
    def strip(rows):
        return [{k: v for k, v in r.items() if k not in tree_fields} for r in without_seconds(rows)]

    assert strip(relay.rows) == strip(flat.rows)
    assert relay.rows[0]["upstream_messages"] == 5


def test_a_slow_uplink_costs_a_flat_fleet_more_than_two_tiers(data_root, one_thread):
    """The simulated fleet over the tree: with 1 Mbit/s site uplinks, every update crossing
    them (flat) takes longer and spends more joules than one partial a site (two tiers)."""
    over = ("algorithm.name=fedavg", "rounds=1", "train.threads=1", "algorithm.finetune_epochs=0",
            FLEET, FLEET_SITES, UPLINKS)
    relay = run_simulation(quick_config(data_root, *over, "hierarchy.edge_aggregation=false"),
                           None).rows[0]
    two = run_simulation(quick_config(data_root, *over), None).rows[0]
    assert two["virtual_s"] < relay["virtual_s"]
    assert two["modelled_energy_j"] < relay["modelled_energy_j"]
    assert two["upstream_messages"] == 2 and relay["upstream_messages"] == 5
    # a partial crosses a 1 Mbit/s uplink in (its frame bytes x 8 / 1e6) s, plus 20 ms
    assert two["virtual_s"] > two["upstream_bytes"] / 2 * 8 / 1e6


@pytest.mark.slow("torch.distributed worker processes (Gloo process groups): 15 s on 2 cores")
def test_two_tiers_are_bitwise_across_workers(data_root, one_thread):
    cfg = quick_config(data_root, "algorithm.name=fedseq-anti", "rounds=2", "train.threads=1",
                       SITES, "hierarchy.edge_rounds=2")
    same_run(run_simulation(cfg, None, workers=2), run_simulation(cfg, None))


@pytest.mark.parametrize("setting, words", [
    ("hierarchy.edge_aggregation=false", "the flat run timed over the tree: simulate it, or rehearse it"),
])
def test_a_fleet_of_sites_refuses_what_does_not_compose_in_one_line(data_root, setting, words):
    """What a fleet's edge aggregators cannot run is refused before anything opens (the broker
    below does not exist), in one line."""
    from fedseq.server.ops.deployment import run_deployment

    with pytest.raises(ConfigError) as err:
        run_deployment(quick_config(data_root, SITES, setting), None, broker="mqtt://127.0.0.1:1")
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow("DP-SGD's per-example gradients, three rounds' worth: 15 s on 2 cores")
def test_record_level_dp_counts_every_site_round(data_root, one_thread):
    """DP-SGD on the clients: with k = 2 each client's epsilon counts its steps of both site
    rounds, as if it had trained twice as many rounds flat."""
    dp = ("algorithm.name=fedavg", "train.threads=1", "privacy.enabled=true",
          "privacy.level=record", "privacy.noise_multiplier=1.0", "train.join_ratio=0.4")
    two = run_simulation(quick_config(data_root, *dp, "rounds=1", SITES,
                                      "hierarchy.edge_rounds=2"), None)
    flat = run_simulation(quick_config(data_root, *dp, "rounds=2"), None)
    assert two.rows[0]["epsilon"] == pytest.approx(flat.rows[1]["epsilon"])


@pytest.mark.parametrize("dp", [(), ("privacy.enabled=true", "privacy.clip_norm=0.5",
                                      "privacy.noise_multiplier=0.5", "seeds.noise=3")])
def test_secure_aggregation_runs_within_each_site(data_root, one_thread, dp):
    """[secagg] with sites: each site's clients mask among themselves and the site unmasks
    their sum (what the coordinator learns: site sums); k = 1 is the flat secure round within
    the fixed-point encoding's rounding, with DP-FedAvg's noise added once at the coordinator
    too. The rows count the secure stages' bytes of every site's clients."""
    over = ("algorithm.name=fedavg", "rounds=1", "train.threads=1", "algorithm.finetune_epochs=0",
            "secagg.enabled=true", *dp)
    flat = run_simulation(quick_config(data_root, *over), None)
    two = run_simulation(quick_config(data_root, *over, SECURE_SITES), None)
    assert max_dw(flat, two) <= 1e-6
    assert two.rows[0]["upstream_messages"] == 2 and two.rows[0]["secure_recovered"] == []
    assert two.rows[0]["bytes_up"] > 0


def test_a_site_whose_secure_sum_fails_costs_only_its_clients(data_root, one_thread):
    """A site with one selected client cannot mask (SecAgg+ needs neighbours): that site's round
    fails, its client is recorded as failed with the site's reason, the other site's partial
    counts."""
    over = ("algorithm.name=fedavg", "rounds=1", "train.threads=1", "secagg.enabled=true", SITES)
    row = run_simulation(quick_config(data_root, *over), None).rows[0]
    assert row["status"] == "ok" and row["upstream_messages"] == 1
    assert row["failed"] == [2] and row["reported"] == [0, 1, 3, 4]
    assert "no masked input arrived" in row["device_failures"]["site b"]


def test_secure_site_rounds_step_each_sites_model(data_root, one_thread):
    """k = 2 under [secagg]: each site round is a secure round of its own (its own graph and
    keys); the run learns as the plain two-tier run does, within the encoding's rounding."""
    over = ("algorithm.name=fedavg", "rounds=1", "train.threads=1", "algorithm.finetune_epochs=0",
            SECURE_SITES, "hierarchy.edge_rounds=2")
    plain = run_simulation(quick_config(data_root, *over), None)
    secure = run_simulation(quick_config(data_root, *over, "secagg.enabled=true"), None)
    assert max_dw(plain, secure) <= 1e-5


def test_the_example_is_the_testbed_on_two_sites():
    """examples/sites-testbed.toml: the testbed's config with [fleet] and [hierarchy] added, its
    10 simulated Nanos in two labs of 5, 15 clients each, each behind its own uplink."""
    from fedseq.common.config import load_config
    from fedseq.server.rounds.virtual_fleet import VirtualFleet

    root = Path(__file__).resolve().parents[2] / "examples"
    sites, plain = load_config(root / "sites-testbed.toml"), load_config(root / "fmnist-testbed.toml")
    assert sites.model_copy(update={"fleet": plain.fleet, "hierarchy": plain.hierarchy}) == plain
    tree = site_tree(sites, VirtualFleet(sites))
    assert [(s.name, len(s.devices), len(s.clients)) for s in tree] == [("lab1", 5, 15),
                                                                          ("lab2", 5, 15)]
    assert all(s.link is not None and s.link.up_mbit == 1 for s in tree)


@pytest.mark.parametrize("name", ["fedadam", "fedper"])
def test_a_server_optimizer_and_a_personal_algorithm_take_k_site_rounds(data_root, one_thread,
                                                                        name):
    """k = 2 with FedAdam (its optimizer steps along the mean of the sites' changes: HierFAVG
    under a server optimizer) and FedPer (each client's head trained in both site rounds): the
    run learns, and differs from k = 1."""
    over = (f"algorithm.name={name}", "rounds=1", "train.threads=1", "algorithm.finetune_epochs=0",
            SITES)
    one = run_simulation(quick_config(data_root, *over), None)
    two = run_simulation(quick_config(data_root, *over, "hierarchy.edge_rounds=2"), None)
    assert max_dw(one, two) > 1e-3
    assert two.rows[-1]["status"] == "ok" and two.rows[0]["reported"] == [0, 1, 2, 3, 4]
    assert two.final.global_acc >= 0.3  # it learns


class _SampleWeights:
    """An algorithm's default weights: a client's sample count per block."""

    @staticmethod
    def aggregation_weights(update):
        return {k: float(update.num_samples) for k in update.deltas}


@pytest.mark.parametrize("change, why", [
    ({}, None),
    ({"clients": [0, 2]}, "not this round's clients at site a"),
    ({"clients": [0, 5]}, "not this round's clients at site a"),
    ({"clients": [0, 0]}, "more than once"),
    ({"weights": {"w": 300.0}}, "weight 300 is not its clients' 30"),
    ({"weights": {"w": float("nan")}}, "weight nan is not its clients' 30"),  # (passed before)
    ({"weights": {"w": float("inf")}}, "weight inf is not its clients' 30"),
    ({"counts": {0: (100, None), 1: (20, None)}}, "num_samples=100, but client 0 has 10"),
    ({"counts": {0: (10, 4), 1: (20, None)}}, "effective_samples=4, but this round"),
    ({"deltas": {"w": torch.full((3, 2), 5.0)}}, "magnitude 5 > the round's bound 1"),
    ({"deltas": {"w": torch.full((3, 2), 5.0)}, "k": 2}, "magnitude 5 > 2 x the round's bound 1"),
    ({"deltas": {"w": torch.full((3, 2), 5.0)}, "k": 5}, None),
    ({"deltas": {"w": torch.zeros(3, 2, dtype=torch.float64)}}, "expected float32[3, 2]"),
    ({"deltas": {"w": torch.zeros(2, 3)}}, "expected float32[3, 2]"),
    ({"deltas": {"w": torch.full((3, 2), float("nan"))}}, "NaN or Inf"),
    ({"deltas": {"w": torch.zeros(3, 2), "v": torch.zeros(1)},
      "weights": {"w": 30.0, "v": 30.0}}, "not the round's uploaded ones (v)"),
])
def test_a_partial_is_checked_before_it_counts(change, why):
    """What an edge aggregator claims is held to what the coordinator knows: its clients (the
    round's, its site's, once each), their sample counts, each tensor's weight recomputed from
    them, the tensors' names, dtypes and shapes, and their size within k x the round's bound."""
    from fedseq.server.rounds.contract import RoundContract, SitePartial
    from fedseq.server.rounds.sites import Site

    contract = RoundContract(0, frozenset({0, 1, 2}), {"w": torch.zeros(3, 2)},
                             {0: 10, 1: 20, 2: 5}, None, 1.0,
                             weigh=_SampleWeights.aggregation_weights)
    site = Site("a", ("d0", "d1"), frozenset({0, 1, 5}))
    p = SitePartial(change.get("deltas", {"w": torch.full((3, 2), 0.1)}),
                    change.get("weights", {"w": 30.0}), change.get("clients", [0, 1]), "a")
    counts = change.get("counts", {c: ({0: 10, 1: 20, 2: 5, 5: 7}[c], None) for c in p.clients})
    got = contract.admit(p, site.clients, counts, change.get("k", 1))
    if why is None:
        assert got is None
    else:
        assert got is not None and why in str(got), got


def test_an_answer_sent_again_is_not_a_late_update(data_root):
    """A task sent again after the coordinator's connection was down is answered again: a
    repeat of an answer the coordinator heard is not counted in `late_updates`; an answer that
    comes after its task's collection ended (once, however often it is sent) is."""
    from fedseq.common.protocol.frames import pack_chunk
    from fedseq.common.protocol.messages import SiteResultHeader
    from fedseq.server.pools.mqtt.edges import EdgePool

    pool = EdgePool(quick_config(data_root, SITES), "mqtt://127.0.0.1:1", "run-1")
    topic = pool.topics.site("a", "result")

    def answer(seq: int, chunk: int = 0) -> None:
        head = SiteResultHeader(run_id="run-1", site="a", seq=seq, chunk=chunk, chunks=2, size=8,
                                sha256="0" * 64)
        pool._on_message(topic, pack_chunk(head, b"\0" * 4))

    pool.awaiting = 3
    answer(3)  # heard while task 3 is collected
    pool.awaiting = -1
    answer(3), answer(3, chunk=1)  # sent again after the collection ended
    assert pool.late == 0
    answer(4), answer(4), answer(4, chunk=1)  # task 4's answer, after its collection, twice
    assert pool.late == 1


def test_a_sites_invalid_answer_costs_its_own_clients_at_once_and_its_flood_is_its_own(data_root):
    """Hardening VII, finding 5: a partial whose weight is NaN passed, turned the aggregate NaN
    and failed every site's round. Every float from the wire is refused when parsed: the site
    that sent it misses the round at once, with why, and the other site is waited for as
    before. A site login's messages are charged to its own budget (bytes and CPU of the
    network thread, as a device login's): its flood is dropped unread, each drop told to the
    broker's flood guard, and another site's status still arrives."""
    from fedseq.common.protocol.frames import pack_chunk
    from fedseq.common.protocol.messages import SiteResultHeader, SiteStatus
    from fedseq.server.pools.mqtt.edges import EdgePool

    pool = EdgePool(quick_config(data_root, SITES), "mqtt://127.0.0.1:1", "run-1")
    for site in ("a", "b"):
        pool.status[site] = SiteStatus(site=site, state="online", devices=["x"])
    head = SiteResultHeader(run_id="run-1", site="a", seq=3, weights={"w": 1.0}, chunk=0,
                            chunks=1, size=4, sha256="0" * 64)
    nan = pack_chunk(head, b"\0" * 4).replace(b'"w":1.0', b'"w":NaN')
    pool.awaiting = 3
    pool._on_message(pool.topics.site("a", "result"), nan)
    answers, missing = pool._collect(3, ["a", "b"], 1.0)
    assert answers == {}
    assert missing["a"].startswith("its answer is invalid: invalid SiteResultHeader: ")
    assert "not finite" in missing["a"] and missing["b"] == "no answer within 1 s"

    disabled: list[str] = []
    pool.guard = type("Guard", (), {"dropped": staticmethod(disabled.append)})()
    flood = SiteStatus(site="b", state="online", devices=["x"] * 500).encode()
    for _ in range(2000):
        pool._on_message(pool.topics.site("b", "status"), flood)
    assert 0 < pool.events.qsize() < 200 and pool.flooded > 1800
    assert disabled == ["b"] * pool.flooded  # each drop told to the flood guard, as a device's
    pool._on_message(pool.topics.site("a", "status"), SiteStatus(site="a", state="offline").encode())
    events = [pool.events.get_nowait() for _ in range(pool.events.qsize())]
    assert events[-1][:2] == ("status", "a") and events[-1][2].state == "offline"


def test_an_edge_that_cannot_follow_the_run_is_named_at_once(data_root, caplog):
    """Issue 94, finding 5: an edge aggregator that could not follow a run (a dataset missing
    at the site) left the coordinator waiting out deploy.wait_devices_s, then saying "0 devices
    online at 2 of 2 sites ... start each site's broker". The edge says why in its status; the
    coordinator names the site and its reason at once, goes on with the other site, and fails
    at once, with every site's reason, where none can follow."""
    import time

    import pytest

    from fedseq.common.errors import TransportError
    from fedseq.common.protocol.messages import SiteStatus
    from fedseq.server.pools.mqtt.edges import EdgePool

    pool = EdgePool(quick_config(data_root, SITES, "deploy.wait_devices_s=300"),
                    "mqtt://127.0.0.1:1", "run-1")
    pool._publish_run = lambda gathering=False: None
    why = "data.dataset: no FashionMNIST under /var/lib/fedseq-edge/data"
    pool.status["a"] = SiteStatus(site="a", state="online", error=why, error_run_id="run-1")
    pool.status["b"] = SiteStatus(site="b", state="online", devices=["d2"])
    began = time.monotonic()
    with caplog.at_level("WARNING"):
        assert pool.wait_for_sites(1, 300) == ["d2"]
    assert time.monotonic() - began < 10
    assert f"site a cannot follow run run-1: {why}" in caplog.text
    pool.status["b"] = SiteStatus(site="b", state="online", error="another",
                                  error_run_id="run-1")
    with pytest.raises(TransportError, match="no site can follow run run-1: site a cannot "
                                             "follow run run-1: data.dataset"):
        pool.wait_for_sites(1, 300)
    assert SiteStatus.decode(pool.status["a"].encode()).error == why


def test_an_edge_says_in_its_status_why_it_cannot_follow_a_run(data_root, tmp_path):
    """The edge's side of the test above: a run naming a model not installed at the site is
    refused in the edge's status (error, error_run_id), as well as in its log."""
    from fedseq.common.protocol.messages import SiteRun, SiteStatus
    from fedseq.server.ops.edge import EdgeAggregator
    from fedseq.server.pools.mqtt.edges import site_config

    edge = EdgeAggregator("a", "mqtt://127.0.0.1:1", "mqtt://127.0.0.1:1", data_root)
    said: list[bytes] = []
    edge.link.connected.set()
    edge.link.publish = lambda topic, payload, **kw: said.append(payload)
    cfg = site_config(quick_config(data_root, SITES))
    cfg["model"]["name"] = "not-installed-here"
    edge._join(SiteRun(run_id="run-9", config=cfg))
    st = SiteStatus.decode(said[-1])
    assert st.error_run_id == "run-9" and "not-installed-here" in st.error
