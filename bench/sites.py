"""Edge sites ([hierarchy], server/rounds/sites.py) against one tier: in simulation, on a fleet
on this machine, on a rehearsed fleet.

    python bench/sites.py [--data-root ../shared/data] [--part inbound fold accuracy]

Parts, each printed as one table:

- inbound: what reaches the coordinator in a round, flat against two tiers: messages and frame
  bytes (the rows' upstream_messages / upstream_bytes; flat: every counted update). 60 clients
  on 20 devices in 4 sites (5 devices a site), join ratio 0.5, FedAvg on the CNN, 5% of
  Fashion-MNIST. Goal: divided by the devices per site.
- fold: the coordinator's work after the round's slowest update has arrived, in this process
  (no broker): flat, folding that update into the sum of N updates and stepping the model;
  two tiers, its site folding it, making its partial and the coordinator folding the sites'
  partials and stepping. The CNN's 582,026 parameters; N = 1,000 devices flat against 10,000
  over 10 sites. Goal: two tiers at 10,000 at most 2 s more than flat at 1,000. The MQTT part
  of a site's round (its edge aggregator on its own broker) is not measured here.
- scale: fedseq-sim's wall seconds a round at 10,000 simulated devices (10,000 clients, join
  ratio 0.01, IID rows of all Fashion-MNIST), flat against 10 sites of 1,000: what the tree's
  bookkeeping costs the simulator.
- accuracy: the simulated fleet's time and modelled energy to the flat run's final accuracy
  less one point,
  two sites of 5 Jetson Nanos each on wifi-good, each site behind a slow uplink to the
  coordinator (custom:down=10,up=1,delay=20: 1 Mbit/s up), 30 clients, join ratio 0.5, FedAvg,
  20 rounds: flat (every update crosses the uplink), two tiers with k = 1 and k = 2; one table
  per seed (`--seeds 0 1 2`).
- fleet: inbound on a real fleet, on this machine: fedseq-server start with 6 local devices
  (fedseq-client daemons) on the embedded amqtt, flat, against the same devices in 2 sites of 3
  (a broker and an edge aggregator each, fedseq-server edge): the payload bytes the coordinator's
  own connection received each round (wire_bytes_in: updates or partials, statuses, scores)
  and the frames that carried the round's training (flat: an update per client; two tiers: a
  partial per site). 12 clients, all of them a round, FedAvg on the CNN, 5% of Fashion-MNIST,
  2 rounds. Not in the default parts (it takes the machine's cores for a minute or two).
- rehearsal: the accuracy part on a rehearsed fleet (root; server/ops/rehearsal.py): 6 local
  devices (fedseq-client daemons) in network namespaces on wifi-good links, in two sites of 3,
  each site a gateway namespace (its broker, its edge aggregator) behind a slow uplink to the
  coordinator (custom:down=10,up=4: tc's tbf rate, this kernel has no netem), the coordinator's
  broker a Mosquitto from the project's broker.conf and ACL. 12 clients, join ratio 0.5,
  FedAvg on the CNN, 20 rounds: flat over the tree (hierarchy.edge_aggregation = false: every
  update crosses its site's uplink), two tiers with k = 1 and k = 2. Time: the rows' measured
  round seconds, summed to the round that reaches the flat run's final global accuracy less a
  point. Energy: modelled from those measured times with the Jetson Nano's watts (10 W
  training, 2 W idle; this machine has no power sensor): every device idle all round plus
  training's extra draw for the training seconds the devices reported (the rows' paces). Not
  in the default parts (about 15 minutes of both cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import quick_config  # noqa: E402
from fedseq.common.algorithms.aggregate import WeightedDeltaSum  # noqa: E402
from fedseq.common.models import build_model, get_blocks  # noqa: E402
from fedseq.server.ops.simulation import run_simulation  # noqa: E402
from fedseq.server.rounds.sites import partial_of  # noqa: E402


def inbound(root: Path) -> None:
    devices = [f"d{i:02d}" for i in range(20)]
    sites = ",".join(f's{s}=[{",".join(repr(d) for d in devices[5 * s:5 * s + 5])}]'
                     for s in range(4)).replace("'", '"')
    over = ("algorithm.name=fedavg", "rounds=2", "data.num_clients=60", "data.min_samples=10",
            "train.join_ratio=0.5", "train.threads=1", "model.name=cnn")
    print("inbound: per round (2 rounds), 60 clients on 20 devices in 4 sites")
    print(f"{'tiers':>6} {'messages':>9} {'MB':>9} {'ratio':>6}")
    flat = run_simulation(quick_config(root, *over), None).rows
    two = run_simulation(quick_config(root, *over, f"hierarchy.sites={{{sites}}}"), None).rows
    for f, t in zip(flat, two, strict=True):
        if f.get("phase") != "train":
            continue
        print(f"{'flat':>6} {len(f['reported']):>9} {f['bytes_up'] / 1e6:>9.2f}")
        print(f"{'two':>6} {t['upstream_messages']:>9} {t['upstream_bytes'] / 1e6:>9.2f} "
              f"{f['bytes_up'] / t['upstream_bytes']:>6.1f}")


def fleet(root: Path) -> None:
    from fedseq.server.ops.deployment import run_deployment

    names = [f"local{i:02d}" for i in range(1, 7)]
    sites = 'hierarchy.sites={a=["local01","local02","local03"],b=["local04","local05","local06"]}'
    over = ("algorithm.name=fedavg", "rounds=2", "data.num_clients=12", "data.min_samples=10",
            "train.join_ratio=1.0", "train.threads=1", "model.name=cnn", "deploy.port=0")
    print(f"fleet: per round, 12 clients on {len(names)} local devices; flat on one amqtt, "
          "two tiers in 2 sites of 3 (a broker and an edge each)")
    print(f"{'tiers':>6} {'round':>5} {'frames':>7} {'MB in':>9} {'ratio':>6} {'seconds':>8}")
    flat = run_deployment(quick_config(root, *over), None, local_devices=6, client_threads=1,
                          announce=lambda m: None).rows
    two = run_deployment(quick_config(root, *over, sites), None, local_devices=6,
                         client_threads=1, announce=lambda m: None).rows
    for f, t in zip(flat, two, strict=True):
        if f.get("phase") != "train":
            continue
        print(f"{'flat':>6} {f['round']:>5} {len(f['reported']):>7} "
              f"{f['wire_bytes_in'] / 1e6:>9.2f} {'':>6} {f['seconds']:>8.1f}")
        print(f"{'two':>6} {t['round']:>5} {t['upstream_messages']:>7} "
              f"{t['wire_bytes_in'] / 1e6:>9.2f} {f['wire_bytes_in'] / t['wire_bytes_in']:>6.1f} "
              f"{t['seconds']:>8.1f}")


def fold(repeats: int = 5) -> None:
    model = build_model("cnn", (1, 28, 28), 10, generator_seed=0)
    start = get_blocks(model, model.spec.blocks)
    g = torch.Generator().manual_seed(0)
    delta = {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in start.items()}
    weights = {k.split(".")[0]: 100.0 for k in start}

    def flat_after_last(n: int) -> float:
        acc = WeightedDeltaSum()
        for i in range(n - 1):  # the others, before the last arrives
            acc.add(delta, weights, i)
        t0 = time.perf_counter()
        acc.add(delta, weights, n - 1)
        acc.apply(start)
        return time.perf_counter() - t0

    def two_after_last(n: int, sites: int) -> float:
        per = n // sites
        partials = []
        for s in range(sites - 1):  # the other sites' partials are in
            acc = WeightedDeltaSum()
            for i in range(per):
                acc.add(delta, weights, s * per + i)
            partials.append(partial_of(acc, start, start))
        last = WeightedDeltaSum()
        for i in range(per - 1):
            last.add(delta, weights, i)
        t0 = time.perf_counter()
        last.add(delta, weights, n - 1)
        partials.append(partial_of(last, start, start))
        top = WeightedDeltaSum()
        for p in partials:
            top.add_partial(p.deltas, p.weights, p.clients)
        top.apply(start)
        return time.perf_counter() - t0

    flat = statistics.median(flat_after_last(1000) for _ in range(repeats))
    two = statistics.median(two_after_last(10_000, 10) for _ in range(repeats))
    print(f"fold: after the slowest update, median of {repeats} (CNN, 582,026 parameters)")
    print(f"  flat, 1,000 devices:            {flat * 1e3:8.1f} ms")
    print(f"  two tiers, 10,000 over 10 sites: {two * 1e3:8.1f} ms  ({(two - flat) * 1e3:+.1f} ms)")


def scale(root: Path) -> None:
    n = 10_000
    names = [f"nano-{i:02d}" for i in range(n)]
    sites = "hierarchy.sites={" + ",".join(
        f's{s}=[' + ",".join(f'"{d}"' for d in names[s * 1000:(s + 1) * 1000]) + "]"
        for s in range(10)) + "}"
    over = ("algorithm.name=fedavg", "rounds=3", f"data.num_clients={n}", "data.min_samples=5",
            "data.fraction=1.0", "data.partition=iid", "train.join_ratio=0.01",
            "train.threads=1", "model.name=cnn", "train.eval_every=100",
            f'fleet.devices=[{{profile="nano",count={n},link="wifi-good"}}]')
    print(f"scale: {n:,} simulated devices, 100 clients a round; wall seconds a round "
          "(rounds 1-2; round 0 builds the caches)")
    for name, more in (("flat", ()), ("10 sites", (sites,))):
        seconds = [r["seconds"] for r in run_simulation(quick_config(root, *over, *more),
                                                         None).rows if r.get("phase") == "train"]
        print(f"  {name:>8}: {statistics.mean(seconds[1:]):.2f} s")


def accuracy(root: Path, seed: int = 0) -> None:
    fleet = 'fleet.devices=[{profile="nano",count=10,link="wifi-good"}]'
    names = [f"nano-{i:02d}" for i in range(10)]
    sites = ('hierarchy.sites={a=[' + ",".join(f'"{d}"' for d in names[:5]) + '],b=['
             + ",".join(f'"{d}"' for d in names[5:]) + ']}')
    links = 'hierarchy.links={a="custom:down=10,up=1,delay=20",b="custom:down=10,up=1,delay=20"}'
    over = ("algorithm.name=fedavg", "rounds=20", "data.num_clients=30", "data.min_samples=10",
            "train.join_ratio=0.5", "train.threads=1", "model.name=cnn", f"seed={seed}", fleet,
            sites, links)
    runs = {"flat": ("hierarchy.edge_aggregation=false",), "two k=1": (),
            "two k=2": ("hierarchy.edge_rounds=2",)}
    rows = {name: run_simulation(quick_config(root, *over, *more), None).rows
            for name, more in runs.items()}
    target = [r for r in rows["flat"] if r.get("phase") == "train"][-1]["global_acc"] - 0.01
    print(f"accuracy, seed {seed}: to the flat run's final global accuracy less a point, "
          f"{100 * target:.2f}% (20 rounds, 2 sites x 5 nanos, 1 Mbit/s site uplinks)")
    print(f"{'run':>8} {'round':>6} {'virtual_s':>10} {'energy_kJ':>10} {'final_acc':>10}")
    for name, rs in rows.items():
        train = [r for r in rs if r.get("phase") == "train"]
        hit = next((r for r in train if r["global_acc"] >= target), None)
        energy = sum(r["modelled_energy_j"] for r in train[:train.index(hit) + 1]) if hit else None
        print(f"{name:>8} {hit['round'] if hit else '-':>6} "
              f"{hit['virtual_time_s'] if hit else float('nan'):>10.1f} "
              f"{energy / 1e3 if energy else float('nan'):>10.2f} "
              f"{100 * train[-1]['global_acc']:>9.2f}%")


def rehearsal(root: Path) -> None:
    from fedseq.server.ops import rehearsal as rh
    from fedseq.server.ops.deployment import run_deployment
    from fedseq.server.rounds import links as ln
    from fedseq.server.rounds.virtual_fleet import PROFILES

    names = [f"local{i:02d}" for i in range(1, 7)]
    tree = {"a": names[:3], "b": names[3:]}
    uplink = "custom:down=10,up=4"
    over = ("algorithm.name=fedavg", "rounds=20", "data.num_clients=12", "data.min_samples=10",
            "train.join_ratio=0.5", "train.threads=1", "model.name=cnn", "deploy.port=0",
            "deploy.embedded_broker=mosquitto",
            "hierarchy.sites={" + ",".join(f"{s}=[{','.join(repr(d) for d in ds)}]"
                                           for s, ds in tree.items()).replace("'", '"') + "}",
            f'hierarchy.links={{a="{uplink}",b="{uplink}"}}')
    runs = {"flat": ("hierarchy.edge_aggregation=false",), "two k=1": (),
            "two k=2": ("hierarchy.edge_rounds=2",)}
    nano = PROFILES["nano"]
    rows = {}
    for name, more in runs.items():
        with rh.Rehearsal(names, {d: ln.PROFILES["wifi-good"] for d in names}, None, tree,
                          {s: ln.parse_profile(uplink) for s in tree}) as r:
            said = r.describe()
            rows[name] = [x for x in run_deployment(
                quick_config(root, *over, *more), None, local_devices=len(names),
                client_threads=1, announce=lambda m: None, rehearsal=r).rows
                if x.get("phase") == "train"]
    target = rows["flat"][-1]["global_acc"] - 0.01
    print(f"rehearsal: to the flat run's final global accuracy less a point, {100 * target:.2f}% "
          f"(20 rounds, 2 sites x 3 devices, 4 Mbit/s site uplinks)\n  {said}")
    print(f"{'run':>8} {'round':>6} {'seconds':>8} {'energy_kJ':>10} {'final_acc':>10} "
          f"{'MB_up/round':>12}")
    for name, train in rows.items():
        hit = next((i for i, x in enumerate(train) if x["global_acc"] >= target), None)
        upto = train[:hit + 1] if hit is not None else []
        seconds = sum(x["seconds"] for x in upto)
        joules = sum(len(names) * nano.idle_w * x["seconds"]
                     + sum((nano.train_w - nano.idle_w) * s for s, _ in x["paces"].values())
                     for x in upto)
        up = statistics.mean(x["upstream_bytes"] for x in train) / 1e6
        print(f"{name:>8} {train[hit]['round'] if upto else '-':>6} "
              f"{seconds if upto else float('nan'):>8.1f} "
              f"{joules / 1e3 if upto else float('nan'):>10.2f} "
              f"{100 * train[-1]['global_acc']:>9.2f}% {up:>12.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-root", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--part", nargs="+", default=["inbound", "fold", "scale", "accuracy"],
                    choices=["inbound", "fold", "scale", "accuracy", "fleet", "rehearsal"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0],
                    help="the accuracy part's seeds (each: three 20-round runs)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for part in args.part:
        if part == "fold":
            fold()
        elif part == "accuracy":
            for seed in args.seeds:
                accuracy(args.data_root, seed)
        else:
            globals()[part](args.data_root)


if __name__ == "__main__":
    main()
