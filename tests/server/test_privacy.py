"""Client-level DP-FedAvg: clipping on the client, the contract's norm check, the coordinator's
noise, Poisson sampling, the accountant, and the run's epsilon (docs/how-to/privacy.md)."""

import math

import pytest
import torch

from conftest import quick_config, synthetic_data
from fedseq.common.algorithms import make_algorithm
from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.robust import update_norm
from fedseq.common.config import load_config
from fedseq.common.errors import ConfigError
from fedseq.common.models import build_model, get_blocks
from fedseq.common.training import run_client_round
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.privacy.dp import NoisedSum, epsilon, poisson_clients, rounds_within
from fedseq.server.rounds.contract import round_contract

DP = ("privacy.enabled=true", "privacy.clip_norm=0.5", "privacy.noise_multiplier=1.1")


def test_the_accountant_is_dp_accountings_rdp_for_the_poisson_gaussian():
    import dp_accounting
    from dp_accounting import rdp

    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.01, dp_accounting.GaussianDpEvent(1.0)), 300))
    assert epsilon(0.01, 1.0, 300, 1e-5) == acc.get_epsilon(1e-5)
    # more rounds, more epsilon; more noise, less; no noise: no guarantee
    assert epsilon(0.01, 1.0, 100, 1e-5) < epsilon(0.01, 1.0, 300, 1e-5)
    assert epsilon(0.01, 2.0, 300, 1e-5) < epsilon(0.01, 1.0, 300, 1e-5)
    assert epsilon(0.01, 0.0, 1, 1e-5) == math.inf and epsilon(0.3, 1.0, 0, 1e-5) == 0.0
    fit = rounds_within(0.01, 1.0, 1e-5, 2.0, 10_000)
    assert epsilon(0.01, 1.0, fit, 1e-5) <= 2.0 < epsilon(0.01, 1.0, fit + 1, 1e-5)


def test_poisson_sampling_draws_each_client_with_its_rate():
    rounds = [poisson_clients(7, t, 1000, 0.1) for t in range(50)]
    sizes = [len(r) for r in rounds]
    assert abs(sum(sizes) / 50 - 100) < 5  # 50,000 Bernoulli(0.1): mean 100, sd of mean ~0.4
    assert len(set(map(len, rounds))) > 5  # the round's size varies
    assert poisson_clients(7, 3, 1000, 0.1) == rounds[3]  # a pure function of (seed, round)


def test_the_noise_has_the_configured_standard_deviation():
    """The noised mean of zero updates is noise / (qN): its sample standard deviation over 40,000
    coordinates is z C / (qN) within 2% (the estimate's relative sd is ~0.35%), and its mean ~0."""
    clip, z, expected = 0.5, 1.3, 4.0
    agg = NoisedSum(clip, z, expected, seed=3, round=2)
    zero = {"fc.weight": torch.zeros(200, 200)}
    agg.add(zero, {"fc": 123.0}, client=0)
    out = agg.apply({"fc.weight": torch.zeros(200, 200)})["fc.weight"].double()
    assert abs(float(out.std()) / (z * clip / expected) - 1) < 0.02
    assert abs(float(out.mean())) < 4 * (z * clip / expected) / 200
    again = NoisedSum(clip, z, expected, seed=3, round=2)
    again.add(zero, {"fc": 1.0}, client=0)
    assert torch.equal(again.apply({"fc.weight": torch.zeros(200, 200)})["fc.weight"],
                       out.float())  # the same stream whoever draws it
    other = NoisedSum(clip, z, expected, seed=3, round=3)
    other.add(zero, {"fc": 1.0}, client=0)
    assert not torch.equal(other.apply({"fc.weight": torch.zeros(200, 200)})["fc.weight"],
                           out.float())


def test_updates_are_summed_with_weight_one_over_the_expected_count():
    agg = NoisedSum(10.0, 0.0, 4.0, seed=0, round=0)
    for c, v in ((0, 1.0), (1, 3.0)):
        agg.add({"w.weight": torch.full((3,), v)}, {"w": 100.0 * (c + 1)}, client=c)
    out = agg.apply({"w.weight": torch.zeros(3)})
    assert torch.allclose(out["w.weight"], torch.full((3,), 1.0))  # (1 + 3) / 4


def test_a_client_clips_its_upload_and_the_contract_refuses_an_unclipped_one(data_root):
    cfg = load_config(None, ["algorithm.name=fedavg", "train.local_epochs=1", "train.batch_size=8",
                             "data.num_clients=4", "train.lr=0.5", *DP])
    model = build_model("cnn", (1, 28, 28), 4, False, generator_seed=1)
    alg = make_algorithm(cfg, model.spec)
    plan = alg.plan(0)
    assert plan.clip == 0.5
    data = synthetic_data(num_clients=4)
    start = get_blocks(model, model.spec.blocks)
    update, _ = run_client_round(model, dict(start), plan, data, data.clients[1], 0, 0)
    assert 0.45 < update_norm(update.deltas) <= 0.5  # lr 0.5 moves it far more: clipped
    from dataclasses import replace

    raw, _ = run_client_round(model, dict(start), replace(plan, clip=None), data, data.clients[1],
                              0, 0)
    assert update_norm(raw.deltas) > 0.5
    contract = round_contract(0, [1], plan.upload, start, data, None, 1e9, clip=0.5)
    assert contract.admit(update) is None
    refused = contract.admit(ClientUpdate(1, 0, raw.deltas, len(data.clients[1].train)))
    assert refused is not None and refused.code == "over-clip"
    assert "privacy.clip_norm" in refused.text and "\n" not in refused.text


def test_a_dp_run_records_its_epsilon_and_learns(data_root):
    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=3", "train.join_ratio=0.6",
                       "privacy.enabled=true", "privacy.clip_norm=5",
                       "privacy.noise_multiplier=0.3")
    result = run_simulation(cfg, out=None)
    eps = [r["epsilon"] for r in result.rows]
    assert eps == sorted(eps) and eps[0] > 0
    assert eps[-1] == pytest.approx(epsilon(0.6, 0.3, 3, cfg.privacy.delta))
    assert all(r["clients"] == poisson_clients(cfg.seed_for("selection"), r["round"],
                                               cfg.data.num_clients, 0.6) for r in result.rows)


@pytest.mark.parametrize("over, words", [
    (("aggregation.rule=median",), "median"),
    (("train.mode='async'", "fleet.devices=[{profile='nano'}]", "privacy.adaptive=true",
      "privacy.count_noise=5"), "async"),
    (("train.over_select=1.5",), "over_select"),
])
def test_what_breaks_the_analysis_is_refused_in_one_line(over, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*DP, *over])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_noised_sum_bounds_every_update_by_the_clip_norm():
    """What a lossy codec decodes may exceed C (int8's scales, top-k's residual): the sum scales
    it back to C, so one client moves the sum by at most C; an update within C is added as it
    is (bitwise)."""
    agg = NoisedSum(1.0, 0.0, 1.0, seed=0, round=0)
    agg.add({"w.weight": torch.tensor([3.0, 4.0])}, {"w": 1.0}, client=0)  # norm 5
    out = agg.apply({"w.weight": torch.zeros(2)})["w.weight"]
    assert torch.allclose(out, torch.tensor([0.6, 0.8]))
    small = NoisedSum(1.0, 0.0, 1.0, seed=0, round=0)
    within = torch.tensor([0.3, -0.2])
    small.add({"w.weight": within}, {"w": 1.0}, client=0)
    assert torch.equal(small.apply({"w.weight": torch.zeros(2)})["w.weight"], within)
    sparse = NoisedSum(1.0, 0.0, 1.0, seed=0, round=0)
    sparse.add({"w.weight": torch.tensor([0.0, 6.0, 8.0]).to_sparse()}, {"w": 1.0}, client=0)
    assert torch.allclose(sparse.apply({"w.weight": torch.zeros(3)})["w.weight"],
                          torch.tensor([0.0, 0.6, 0.8]))


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_a_dp_run_codes_its_updates_in_int8_or_topk(data_root, one_thread, codec):
    """Clipped before coding on the client, brought back to C by the noised sum: the run is
    private and learns; every round counts its updates (the contract refuses none for a norm
    its codec does not keep)."""
    cfg = quick_config(data_root, *DP_RUN, f"wire.up='{codec}'", "wire.topk=0.1",
                       "privacy.noise_multiplier=0.01")  # 3 clients a round: little noise
    result = run_simulation(cfg, out=None)
    rows = [r for r in result.rows if r["phase"] == "train"]
    assert all(r["reported"] == r["clients"] and not r.get("refusals") for r in rows)
    assert rows[-1]["epsilon"] == pytest.approx(epsilon(0.6, 0.01, 3, cfg.privacy.delta))
    float32 = 4 * rows[0]["trainable_params"]  # an update's bytes uncoded
    assert all(r["bytes_up"] < float32 * len(r["reported"]) / 3 for r in rows)  # coded
    assert result.final.global_acc > 0.3


def test_a_buffered_asynchronous_run_is_noised_per_step_and_accounted_without_sampling(
        data_root, one_thread):
    """train.mode = "async": every server step's sum is noised over its buffer (the noised sum:
    ledger.updates), each client in it at most once, and the accountant composes the steps at
    q = 1 (the steps' clients are not Poisson-sampled)."""
    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=4", "train.threads=1",
                       "train.mode='async'", "train.concurrency=4", "train.buffer=3",
                       "fleet.devices=[{profile='nano'},{profile='orin-nano',count=2}]",
                       "privacy.enabled=true", "privacy.clip_norm=2",
                       "privacy.noise_multiplier=0.05")
    result = run_simulation(cfg, out=None)
    rows = [r for r in result.rows if r["phase"] == "train"]
    for r in rows:
        clients = [f["client"] for f in r["folds"]]
        assert len(clients) == len(set(clients))  # no client twice in a step's sum
        assert r["epsilon"] == pytest.approx(epsilon(1.0, 0.05, r["round"] + 1,
                                                      cfg.privacy.delta))
    assert sum(len(r["reported"]) for r in rows) >= 8
    from fedseq.server.privacy.dp import expected_clients, sampling_rate

    assert expected_clients(cfg) == 3 and sampling_rate(cfg) == 1.0  # over the buffer, q = 1


@pytest.mark.slow("an asynchronous DP run and its replay: 6 s on 2 cores")
def test_a_replayed_asynchronous_dp_run_uses_the_runs_secret_noise(data_root, tmp_path, one_thread):
    """--replay re-executes the arrivals with the noise seed the run's checkpoint keeps (it is
    in no config), so the replayed model is bitwise the run's."""
    from fedseq.server.ops.simulation import replay

    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=3", "train.threads=1",
                       "train.mode='async'", "train.concurrency=3", "train.buffer=2",
                       "fleet.devices=[{profile='nano'},{profile='orin-nano',count=2}]",
                       "privacy.enabled=true", "privacy.clip_norm=2",
                       "privacy.noise_multiplier=0.5")
    run_simulation(cfg, tmp_path / "run")
    _, same, verdict = replay(tmp_path / "run", tmp_path / "again")
    assert same, verdict


def test_a_run_over_its_budget_is_refused_with_the_rounds_that_fit():
    from fedseq.server.privacy.dp import check_budget

    cfg = load_config(None, [*DP, "rounds=500", "train.join_ratio=0.2",
                             "privacy.target_epsilon=4"])
    with pytest.raises(ConfigError) as err:
        check_budget(cfg)
    fit = rounds_within(0.2, 1.1, cfg.privacy.delta, 4.0, 500)
    assert f"{fit} rounds fit" in str(err.value) and "\n" not in str(err.value)
    check_budget(cfg.model_copy(update={"rounds": fit}))  # within: no error


DP_RUN = ("algorithm.name=fedavg", "rounds=3", "train.join_ratio=0.6", "train.threads=1",
          "privacy.enabled=true", "privacy.clip_norm=2", "privacy.noise_multiplier=0.5")


ADAPTIVE = ("privacy.adaptive=true", "privacy.clip_norm=0.05", "privacy.count_noise=1")


@pytest.mark.slow("differentially private training with its accountant: 7 s on 2 cores")
@pytest.mark.parametrize("more", [(), ADAPTIVE])
def test_a_dp_run_is_bitwise_across_workers_and_resume(data_root, tmp_path, one_thread, more):
    """Fixed and adaptive clipping (the clip norm checkpointed with the run). The noise seed is
    each run's own secret: `--workers` is compared with the noise pinned ([seeds] noise); a
    resume, unpinned, continues with the secret its checkpoint holds, so it is bitwise the
    uninterrupted run of that seed."""
    from conftest import resumed_after, same_run
    from fedseq.server.rounds.checkpoint import load_checkpoint

    pinned = quick_config(data_root, *DP_RUN, *more, "seeds.noise=5")
    alone = run_simulation(pinned, tmp_path / "full")
    same_run(run_simulation(pinned, None, workers=2), alone)

    cfg = quick_config(data_root, *DP_RUN, *more)
    resumed = resumed_after(cfg, tmp_path / "part", 1)
    secret = load_checkpoint(tmp_path / "part").loop.noise_seed
    assert secret is not None and secret != cfg.seed
    whole = run_simulation(quick_config(data_root, *DP_RUN, *more, f"seeds.noise={secret}"), None)
    assert all(torch.equal(resumed.global_weights[k], v) for k, v in whole.global_weights.items())
    import json

    rows = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epsilon"] for r in rows] == [r["epsilon"] for r in whole.rows]
    assert [r.get("clip_norm") for r in rows] == [r.get("clip_norm") for r in whole.rows]


@pytest.mark.slow("four one-round DP simulations: 7 s on 2 cores")
def test_no_device_can_regenerate_the_noise_from_what_it_is_sent(data_root, tmp_path, one_thread):
    """Hardening VI, finding 3: the noise was drawn from the run's seed, which every device gets,
    so a device could regenerate it from two published models and recover another client's
    update. Unpinned, the noise seed is a secret drawn for each run and kept in its checkpoint
    alone: the noise of the sum is not the one the run's seed gives, two runs of one config
    differ only by their noise, and neither the config a device gets nor config.toml has it."""
    from fedseq.server.rounds.checkpoint import load_checkpoint

    cfg = quick_config(data_root, *DP_RUN, "rounds=1", "train.join_ratio=1.0")
    a = run_simulation(cfg, tmp_path / "a")
    b = run_simulation(cfg, tmp_path / "b")
    quiet = run_simulation(quick_config(data_root, *DP_RUN, "rounds=1", "train.join_ratio=1.0",
                                        "privacy.noise_multiplier=0"), None)
    secret = load_checkpoint(tmp_path / "a").loop.noise_seed
    assert secret not in (None, cfg.seed) and secret != load_checkpoint(tmp_path / "b").loop.noise_seed
    for run in ("a", "b"):
        text = (tmp_path / run / "config.toml").read_text()
        assert str(load_checkpoint(tmp_path / run).loop.noise_seed) not in text
    assert str(secret) not in str(cfg.for_devices())
    # what a device would regenerate from the run's seed (the old noise stream) is not the noise
    guessed = run_simulation(quick_config(data_root, *DP_RUN, "rounds=1", "train.join_ratio=1.0",
                                          f"seeds.noise={cfg.seed}"), None)
    for k, v in a.global_weights.items():
        if v.is_floating_point() and not torch.equal(v, quiet.global_weights[k]):
            assert not torch.equal(v, b.global_weights[k])  # another secret, other noise
            assert not torch.equal(v, guessed.global_weights[k])
    noise = torch.cat([(a.global_weights[k] - quiet.global_weights[k]).flatten()
                       for k in a.global_weights if a.global_weights[k].is_floating_point()])
    assert float(noise.abs().max()) > 0  # the noise is there


@pytest.mark.slow("a DP deployment on two daemons over amqtt beside its simulation")
def test_a_dp_deployment_gives_the_simulations_run(data_root, tmp_path, one_thread):
    """Clipped on the devices (over MQTT, an embedded broker), noised on the coordinator from the
    noise stream: bitwise the simulation's weights, rows and epsilon; the noise seed is not in
    the config the devices get."""
    from fedseq.server.ops.deployment import run_deployment

    cfg = quick_config(data_root, *DP_RUN, *ADAPTIVE, "deploy.port=0", "seeds.noise=77")
    sent = cfg.for_devices()
    assert "privacy" not in sent and not (sent.get("seeds") or {}).get("noise")
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1,
                         announce=lambda *a, **k: None)
    sim = run_simulation(cfg, out=None)
    for d, s in zip(dep.rows, sim.rows, strict=True):
        assert d["clients"] == s["clients"] and d["epsilon"] == s["epsilon"]
        assert d["clip_norm"] == s["clip_norm"]  # the devices' bits crossed the wire
        assert d["global_acc"] == s["global_acc"]
    assert all(torch.equal(dep.global_weights[k], v) for k, v in sim.global_weights.items())


def test_adaptive_clipping_moves_the_clip_norm_to_the_quantile():
    """C exp(-eta (share within - gamma)): every update within C shrinks it, none grows it (no
    noise here); the updates' noise multiplier leaves the count its share of z (Theorem 1)."""
    from fedseq.server.privacy.dp import next_clip, update_noise

    cfg = load_config(None, [*DP, "privacy.adaptive=true", "privacy.noise_multiplier=0",
                             "data.num_clients=100", "train.join_ratio=0.1"])
    assert next_clip(cfg, 2.0, 10, 0, seed=0) == pytest.approx(2.0 * math.exp(-0.2 * 0.5))
    assert next_clip(cfg, 2.0, 0, 0, seed=0) == pytest.approx(2.0 * math.exp(0.2 * 0.5))
    assert next_clip(cfg, 2.0, 5, 0, seed=0) == pytest.approx(2.0)
    noisy = load_config(None, [*DP, "privacy.adaptive=true", "privacy.noise_multiplier=1",
                               "privacy.count_noise=5"])
    assert update_noise(noisy) == pytest.approx((1 - 1 / 100) ** -0.5)
    with pytest.raises(ConfigError, match="count_noise"):
        load_config(None, [*DP, "privacy.adaptive=true", "privacy.noise_multiplier=4",
                           "privacy.count_noise=1"])


def test_an_adaptive_run_raises_a_too_small_clip_norm(data_root):
    cfg = quick_config(data_root, *DP_RUN, *ADAPTIVE, "rounds=4", "privacy.noise_multiplier=0.1",
                       "seeds.noise=0")  # the count's noise pinned: small, as drawn
    rows = run_simulation(cfg, out=None).rows
    clips = [r["clip_norm"] for r in rows]
    assert clips[0] == 0.05 and clips == sorted(clips) and clips[-1] > 0.05  # every update > C


def test_a_private_run_says_its_epsilon_and_how_loud_its_noise_is():
    """The testbed's 30 clients: a large epsilon or a noise far above the updates, said before
    the run starts; many clients a round and enough noise: no warning."""
    from fedseq.server.privacy.dp import statement

    small = load_config(None, ["privacy.enabled=true", "data.num_clients=30",
                               "train.join_ratio=0.2", "rounds=100"])
    said = statement(small, 573_578)
    assert said is not None and "epsilon 16.1 at delta 1e-05 after 100 rounds" in said
    assert "~126 x" in said and "epsilon above 10" in said and "cost accuracy" in said
    big = load_config(None, ["privacy.enabled=true", "data.num_clients=100000",
                             "train.join_ratio=0.01", "rounds=100", "privacy.noise_multiplier=1"])
    said = statement(big, 582_026)
    assert said is not None and "protects little" not in said and "cost accuracy" not in said
    assert statement(load_config(None, []), 10) is None


RECORD = ("privacy.enabled=true", "privacy.level='record'", "privacy.clip_norm=1.0",
          "privacy.noise_multiplier=0.8")


@pytest.mark.slow("differentially private training with its accountant: 5 s on 2 cores")
def test_a_record_level_run_reports_its_clients_largest_epsilon(data_root, one_thread):
    """DP-SGD in every client's training: the rows carry the largest epsilon of any client's
    training examples, its steps at rate batch / its rows (recomputed here from the rows)."""
    pytest.importorskip("opacus")
    from fedseq.common.flops import plan_steps
    from fedseq.server.privacy.dp import record_epsilon

    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=2", "data.fraction=0.03",
                       "train.join_ratio=0.6", "train.threads=1", *RECORD)
    result = run_simulation(cfg, out=None)
    from fedseq.server.rounds.experiment import load_experiment

    exp = load_experiment(cfg)
    plan = exp.algorithm.plan(0)
    steps: dict[int, int] = {}
    for r in result.rows:
        if r["phase"] != "train":
            continue
        for c in r["clients"]:
            steps[c] = steps.get(c, 0) + plan_steps(plan, exp.data, exp.data.clients[c])
        sizes = {c.client: len(c.train) for c in exp.data.clients}
        assert r["epsilon"] == pytest.approx(record_epsilon(cfg, steps, sizes))
    assert 0 < result.rows[0]["epsilon"] < result.rows[1]["epsilon"]


@pytest.mark.parametrize("over, words", [
    (("algorithm.name=fedprox",), "Proximal"),
    (("algorithm.name=fedavg", "model.name=4convnet"), "batch normalization"),
    (("algorithm.name=fedreg",), "rebalanced"),
    (("algorithm.name=fedavg", "privacy.target_epsilon=4", "train.mode=async"), "ahead"),
    (("algorithm.name=fedavg", "privacy.target_epsilon=0.01"), "round 0 would take a client"),
])
def test_what_dp_sgd_cannot_account_is_refused_in_one_line(data_root, over, words):
    pytest.importorskip("opacus")  # without it, that is the one line (dpsgd.unavailable)
    with pytest.raises(ConfigError) as err:
        run_simulation(quick_config(data_root, "data.fraction=0.03", *RECORD, *over), out=None)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow("differentially private training with its accountant: 5 s on 2 cores")
def test_a_record_level_run_stops_before_the_round_that_would_pass_its_budget(data_root, tmp_path,
                                                                           one_thread):
    """target_epsilon between round 1's epsilon and round 3's: the rounds end with the last
    round within it, which is evaluated; the fine-tuning follows; the row says why."""
    pytest.importorskip("opacus")
    from fedseq.common.flops import plan_steps
    from fedseq.server.privacy.dp import record_epsilon
    from fedseq.server.rounds.experiment import load_experiment
    from fedseq.server.rounds.ledger import select_clients

    base = ("algorithm.name=fedbabu", "rounds=4", "data.fraction=0.03", "train.join_ratio=0.6",
            "train.threads=1", "train.eval_every=10", "algorithm.finetune_epochs=1", *RECORD)
    cfg = quick_config(data_root, *base)
    exp = load_experiment(cfg)
    plan, steps, eps = exp.algorithm.plan(0), {}, []
    for t in range(3):  # each round's largest client epsilon, as the ledger accounts it
        for c in select_clients(cfg.seed_for("selection"), t, 5, cfg.selected_per_round()):
            steps[c] = steps.get(c, 0) + plan_steps(plan, exp.data, exp.data.clients[c])
        eps.append(record_epsilon(cfg, steps, {c.client: len(c.train) for c in exp.data.clients}))
    budget = (eps[1] + eps[2]) / 2
    cfg = quick_config(data_root, *base, f"privacy.target_epsilon={budget}")
    cut = run_simulation(cfg, tmp_path / "run")
    train = [r for r in cut.rows if r["phase"] == "train"]
    assert [r["epsilon"] for r in train] == pytest.approx(eps[:2])
    assert max(eps[:2]) <= budget < eps[2]
    assert "round 2 would take a client" in train[-1]["stopped"]
    assert train[-1]["global_acc"] is not None  # evaluated as the last round
    assert cut.rows[-1]["phase"] == "finetune" and cut.rows[-1]["round"] == 2
    import json

    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "finished"


def test_a_checkpoint_keeps_each_clients_dp_sgd_steps():
    from fedseq.server.rounds.checkpoint import LoopState

    state = LoopState({"a": 1}, {0: {"a": 1}}, record_steps={3: 40, 7: 12})
    assert LoopState.from_json(state.to_json()).record_steps == {3: 40, 7: 12}
    assert "record_steps" not in LoopState({"a": 1}, {}).to_json()  # as before without it


@pytest.mark.slow("three short DP simulations, one of them buffered-asynchronous: ~8 s")
def test_epsilon_counts_what_was_sampled_not_what_arrived(data_root):
    """Hardening VI, finding 9. Every round's epsilon is the accountant's for the rounds run,
    whatever arrived: a round whose every update is refused (dropouts, as the devices' failures
    are) spends what a counted round spends, since the clients were sampled and the noise was
    drawn; a buffered-asynchronous run is accounted per server step at q = 1, however many
    updates its steps folded."""
    base = ("algorithm.name=fedavg", "rounds=3", "train.join_ratio=0.6", "privacy.enabled=true",
            "privacy.clip_norm=5", "privacy.noise_multiplier=0.8", "seeds.noise=0")
    counted = run_simulation(quick_config(data_root, *base), out=None).rows
    refused = run_simulation(quick_config(data_root, *base, "aggregation.max_abs_delta=1e-30"),
                             out=None).rows
    assert all(r["status"] == "ok" for r in counted)
    assert all(r["status"] == "failed" and not r["reported"] for r in refused)
    want = [epsilon(0.6, 0.8, t + 1, 1e-5) for t in range(3)]
    assert [r["epsilon"] for r in counted] == [r["epsilon"] for r in refused]
    assert [r["epsilon"] for r in counted] == pytest.approx(want)
    asynchronous = run_simulation(quick_config(
        data_root, *base, "train.mode='async'", "train.concurrency=3", "train.buffer=2",
        "fleet.devices=[{profile='nano',count=2}]"), out=None).rows
    steps = [r for r in asynchronous if r["phase"] == "train"]
    assert [r["epsilon"] for r in steps] == pytest.approx(
        [epsilon(1.0, 0.8, t + 1, 1e-5) for t in range(len(steps))])


@pytest.mark.slow("record-level DP-SGD simulated and on two local daemons over amqtt: ~25 s")
def test_record_level_accounting_on_devices_counts_what_they_ran(data_root, tmp_path, one_thread):
    """Hardening VI, finding 9: Opacus's DP-SGD on real daemons. The coordinator accounts each
    client's steps from the plan; the devices' models are bitwise the simulation's (each step
    draws its noise from the client's seeded stream, so a device that ran other steps could
    not match), the rows' epsilon is the simulation's, and Opacus's own RDP accountant, given
    each client's steps and sampling rate, gives the same epsilon within 1%."""
    pytest.importorskip("opacus")
    from opacus.accountants import RDPAccountant

    from fedseq.common.flops import plan_steps
    from fedseq.server.ops.deployment import run_deployment
    from fedseq.server.rounds.experiment import load_experiment

    cfg = quick_config(data_root, "algorithm.name=fedavg", "rounds=2", "data.fraction=0.03",
                       "train.join_ratio=0.6", "train.threads=1", "deploy.port=0", *RECORD)
    sim = run_simulation(cfg, None)
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1,
                         announce=lambda m: None)
    assert all(torch.equal(dep.global_weights[k], v) for k, v in sim.global_weights.items())
    exp = load_experiment(cfg)
    plan, steps = exp.algorithm.plan(0), {}
    for d, s in zip(dep.rows, sim.rows, strict=True):
        assert (d["phase"], d["clients"], d.get("epsilon")) == (s["phase"], s["clients"],
                                                                s.get("epsilon"))
        if d["phase"] != "train":
            continue
        for c in d["clients"]:
            steps[c] = steps.get(c, 0) + plan_steps(plan, exp.data, exp.data.clients[c])
        theirs = []
        for c, n in steps.items():
            accountant = RDPAccountant()
            accountant.history = [(0.8, min(1.0, 20 / len(exp.data.clients[c].train)), n)]
            theirs.append(accountant.get_epsilon(cfg.privacy.delta))
        assert d["epsilon"] == pytest.approx(max(theirs), rel=0.01)
