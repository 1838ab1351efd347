"""A lab's own package (examples/plugin: a plain torch model, a dataset, an algorithm and an
aggregation rule), installed by pip, runs like the built-ins: in simulation, across workers, on
devices over MQTT, listed by `fedseq plugins` and recorded in the run directory."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import same_run, server_only, without_seconds
from fedseq.common.algorithms import ALGORITHMS
from fedseq.common.config import load_config
from fedseq.common.registry import REGISTRY

pytestmark = server_only
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin"


@pytest.fixture(scope="module")
def lab_package(tmp_path_factory):
    """examples/plugin installed by pip into a folder of its own, on this process's sys.path and
    on PYTHONPATH for the processes it starts (workers, device daemons)."""
    site = tmp_path_factory.mktemp("lab-site")
    build = tmp_path_factory.mktemp("lab-build")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(site), str(EXAMPLE)],
                   check=True, cwd=build, env={**os.environ, "PIP_NO_CACHE_DIR": "1"})
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), before) if p)
    sys.path.insert(0, str(site))
    REGISTRY.refresh()
    yield site
    sys.path.remove(str(site))
    if before is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = before
    REGISTRY.refresh()


def lab_config(*extra: str):
    return load_config(None, [
        "model.name=labnet", "model.options.hidden=16", "data.dataset=blobs",
        "data.options.rows=400", "data.num_clients=4", "data.alpha=1.0", "data.min_samples=10",
        "algorithm.name=fedavg-l2", "aggregation.rule=labmean", "rounds=3",
        "train.join_ratio=1.0", "train.local_epochs=1", "algorithm.finetune_epochs=1", *extra])


def test_a_labs_package_runs_in_simulation_and_the_run_records_it(lab_package, tmp_path, one_thread):
    from fedseq.server.ops.simulation import run_simulation

    res = run_simulation(lab_config(), tmp_path / "run")
    assert [r["round"] for r in res.rows] == [0, 1, 2]
    assert res.rows[-1]["global_acc"] > 0.25 + 0.1  # four blobs: it learns
    assert res.rows[0]["train_flops"] > 0 and res.rows[0]["bytes_up"] > 0
    assert res.rows[0]["uploaded_blocks"] == ["body1", "body2", "head"]
    used = {u["group"]: u for u in json.loads((tmp_path / "run" / "plugins.json").read_text())}
    assert {g: (u["name"], u["distribution"], u["version"]) for g, u in used.items()} == {
        "models": ("labnet", "fedseq-labdemo", "0.4.0"),
        "datasets": ("blobs", "fedseq-labdemo", "0.4.0"),
        "algorithms": ("fedavg-l2", "fedseq-labdemo", "0.4.0"),
        "aggregators": ("labmean", "fedseq-labdemo", "0.4.0")}


def test_the_plugins_own_parameters_and_hook_count(lab_package, one_thread):
    """[algorithm.fedavg-l2] is validated by the plugin's own table; lam = 0 is FedAvg bitwise,
    lam > 0 is not (the client hook runs); the plugin rule is FedAvg's mean bitwise."""
    from fedseq.server.ops.simulation import run_simulation

    with pytest.raises(Exception, match="lam"):
        lab_config("algorithm.fedavg-l2.lam=-1")
    plain = run_simulation(lab_config("algorithm.name=fedavg", "aggregation.rule=mean"), None)
    zero = run_simulation(lab_config("algorithm.fedavg-l2.lam=0"), None)
    same_run(plain, zero)
    penalized = run_simulation(lab_config("algorithm.fedavg-l2.lam=0.05"), None)
    assert any(not torch.equal(penalized.global_weights[k], w) for k, w in zero.global_weights.items())


@pytest.mark.slow("two torch.distributed workers beside the in-process run: ~5 s")
def test_a_rules_options_are_its_own_and_checked_with_the_config(lab_package):
    """[aggregation.options] is validated by the rule's own options_model, in one line naming the
    rule; a rule without options (a plain callable, a built-in) refuses any."""
    from fedseq.common.errors import ConfigError

    assert lab_config("aggregation.rule=labmomentum",
                      "aggregation.options.beta=0.5").aggregation.options == {"beta": 0.5}
    for bad, says in ((["aggregation.rule=labmomentum", "aggregation.options.beta=2"],
                       "aggregation.options.beta (rule labmomentum): "),
                      (["aggregation.rule=labmomentum", "aggregation.options.iters=5"],
                       "aggregation.options.iters (rule labmomentum): "),
                      (["aggregation.options.iters=5"], "the rule labmean takes no options"),
                      (["aggregation.rule=median", "aggregation.options.iters=5"],
                       "the rule median takes no options")):
        with pytest.raises(ConfigError, match=re.escape(says)) as err:
            lab_config(*bad)
        assert "\n" not in str(err.value)


def test_a_rule_keeps_state_across_rounds_and_resumes_bitwise(lab_package, tmp_path, one_thread):
    """A rule with state (server momentum) is built once: its momentum moves later rounds (beta 0
    is the mean rule's run within float rounding, beta 0.9 is not), the run directory records its
    options, and a run paused after round 2 resumes from the checkpointed momentum bitwise."""
    from fedseq.server.ops.simulation import run_simulation
    from fedseq.server.rounds.checkpoint import load_checkpoint
    from fedseq.server.rounds.coordinator import RunPaused

    def run(rule, *opts, out=None, **kw):
        return run_simulation(lab_config("rounds=4", f"aggregation.rule={rule}", *opts), out, **kw)

    mean, still = run("labmean"), run("labmomentum", "aggregation.options.beta=0")
    gap = max((mean.global_weights[k] - v).abs().max().item()
              for k, v in still.global_weights.items() if v.is_floating_point())
    assert gap < 1e-5  # g + (mean - g): the mean within float rounding
    whole = run("labmomentum", "aggregation.options.beta=0.9")
    assert max((mean.global_weights[k] - v).abs().max().item()
               for k, v in whole.global_weights.items() if v.is_floating_point()) > 100 * gap
    with pytest.raises(RunPaused):
        run("labmomentum", "aggregation.options.beta=0.9", out=tmp_path / "run", pause_after=2)
    assert load_checkpoint(tmp_path / "run").rule  # the momentum, as tensors
    assert "[aggregation.options]\nbeta = 0.9" in (tmp_path / "run" / "config.toml").read_text()
    resumed = run("labmomentum", "aggregation.options.beta=0.9", out=tmp_path / "run",
                  mode="resume")
    assert all(torch.equal(resumed.global_weights[k], v) for k, v in whole.global_weights.items())
    assert without_seconds(resumed.rows) == without_seconds(whole.rows[2:])


def test_workers_find_the_plugins_through_installed_metadata_bitwise(lab_package, one_thread):
    from fedseq.server.ops.simulation import run_simulation

    cfg = lab_config()
    same_run(run_simulation(cfg, None, workers=2), run_simulation(cfg, None))


BUILTIN_ALGORITHMS = sorted(n for n in ALGORITHMS if REGISTRY.entry("algorithms", n).builtin)


@pytest.mark.parametrize("algorithm", BUILTIN_ALGORITHMS)
def test_every_builtin_algorithm_runs_on_a_plain_torch_module(lab_package, algorithm, one_thread):
    """FedSeq's schedule, FedPer's split, two heads (FedRoD, FedReG), GPFL's valve, the final
    fine-tuning: all of them on a model whose blocks fedseq read off its children."""
    from fedseq.server.ops.simulation import run_simulation

    res = run_simulation(lab_config(f"algorithm.name={algorithm}", "aggregation.rule=mean",
                                    "rounds=2"), None)
    assert res.rows[0]["status"] == "ok" and res.rows[0]["reported"] == [0, 1, 2, 3]
    assert res.final is not None


def test_fedseq_plugins_lists_every_name_with_its_distribution(lab_package):
    out = subprocess.run([str(Path(sys.executable).with_name("fedseq")), "plugins", "--json"],
                         capture_output=True, text=True, check=True, env=dict(os.environ))
    rows = json.loads(out.stdout)
    ours = {(r["group"], r["name"]): r for r in rows if r["distribution"] == "fedseq-labdemo"}
    assert set(ours) == {("models", "labnet"), ("datasets", "blobs"),
                         ("algorithms", "fedavg-l2"), ("aggregators", "labmean"),
                         ("aggregators", "labmomentum")}
    assert all(r["version"] == "0.4.0" and not r["builtin"] for r in ours.values())
    assert {r["group"] for r in rows if r["builtin"]} == {"models", "datasets", "algorithms",
                                                          "aggregators"}


def test_a_deployment_runs_the_labs_package_on_its_devices(lab_package, tmp_path, one_thread):
    """Two local fedseq-client daemons (allowed the run's plugins by the coordinator that starts
    them in its own environment) train the plugin model on the plugin dataset over amqtt, bitwise
    the simulation."""
    from fedseq.server.ops.deployment import run_deployment
    from fedseq.server.ops.simulation import run_simulation

    cfg = lab_config("rounds=2", "deploy.port=0")
    dep = run_deployment(cfg, tmp_path / "dep", local_devices=2, client_threads=1,
                         announce=lambda m: None)
    sim = run_simulation(cfg, None)
    for d, s in zip(dep.rows[:2], sim.rows[:2], strict=True):
        assert d["clients"] == s["clients"] and d["reported"] == d["clients"]
        assert d["global_acc"] == s["global_acc"] and d["personal_acc"] == s["personal_acc"]


@pytest.mark.slow("three daemons, 60 rounds of a small model over amqtt: ~20 s")
def test_a_small_models_fast_rounds_drop_no_honest_devices_message(lab_package, tmp_path, one_thread,
                                                                   caplog):
    """Hardening VII, finding 7: with a lab's small model (rounds of about 0.1 s) every honest
    device was dropped by its budget in every run ("dropped messages from watch03 unread"), each
    drop a 2 s round (that lab's update was about 50 KiB). The budget now follows what each step
    asks: 60 rounds of a 110-unit labnet (a 57 KiB update) on three daemons, one client each,
    drop nothing and every round hears every client."""
    from fedseq.server.ops.deployment import run_deployment

    cfg = lab_config("rounds=60", "deploy.port=0", "data.num_clients=3", "model.options.hidden=110",
                     "algorithm.finetune_epochs=0")
    with caplog.at_level(logging.WARNING, logger="fedseq"):
        dep = run_deployment(cfg, tmp_path / "dep", local_devices=3, client_threads=1,
                             announce=lambda m: None)
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped == []
    train = [r for r in dep.rows if r["phase"] == "train"]
    assert len(train) == 60 and all(r["reported"] == r["clients"] for r in train)


@pytest.mark.slow("PNGs written and decoded, then in-process and two-worker runs: ~6 s")
def test_a_labs_own_image_folder_runs_with_no_code_of_its_own(tmp_path, monkeypatch, one_thread):
    """The built-in imagefolder dataset: class folders of PNGs under the data root, the CNN on
    them, in simulation and across workers, bitwise."""
    pytest.importorskip("PIL")
    import numpy as np
    from PIL import Image

    from fedseq.server.ops.simulation import run_simulation

    monkeypatch.setenv("FEDSEQ_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    for cls, level in (("empty", 30), ("full", 220)):
        for i in range(60):
            pixels = np.clip(rng.normal(level, 25, (28, 28)), 0, 255).astype(np.uint8)
            folder = tmp_path / "data" / "cam" / cls
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels, "L").save(folder / f"{i}.png")
    cfg = load_config(None, [
        f"data.root={str(tmp_path / 'data')!r}", "data.dataset=imagefolder",
        "data.options.path='cam'", "data.options.classes=['empty','full']",
        "data.options.size=28", "data.options.channels=1", "data.num_clients=3",
        "data.alpha=1.0", "data.min_samples=20", "model.name=cnn", "algorithm.name=fedavg",
        "rounds=2", "train.join_ratio=1.0", "train.local_epochs=1"])
    res = run_simulation(cfg, None)
    assert res.rows[-1]["global_acc"] > 0.9  # two levels of grey
    same_run(run_simulation(cfg, None, workers=2), res)


def test_a_device_that_cannot_follow_the_run_says_why_and_is_excluded_at_once(
        lab_package, tmp_path, mosquitto, one_thread):
    """On Mosquitto with the project's ACL: local01 allows the lab's plugins, local02 has them
    installed but not allowed. local02 publishes why it cannot follow the run; the coordinator
    fails its clients at once, with that reason, instead of waiting out the round's deadline."""
    import time

    from conftest import device_process
    from fedseq.server.ops.deployment import run_deployment
    from fedseq.server.pools.processes import stop_children

    port, home, _ = mosquitto
    cfg = lab_config("rounds=2", "deploy.min_devices=2", "deploy.round_timeout_s=120",
                     "deploy.eval_timeout_s=120", "deploy.username=coordinator",
                     f"deploy.password_file={str(home / 'coordinator.pw')!r}")
    allow = [a for p in cfg.plugins() for a in ("--allow-plugin", p)]
    daemons = [device_process("local01", port, home, home, *allow),
               device_process("local02", port, home, home)]
    started = time.monotonic()
    try:
        res = run_deployment(cfg, tmp_path / "run", broker=f"mqtt://127.0.0.1:{port}",
                             announce=lambda s: None)
    finally:
        stop_children(daemons)
    assert time.monotonic() - started < 100  # no round waited out its 120 s deadline
    train = [r for r in res.rows if r["phase"] == "train"]
    assert len(train) == 2
    for row in train:
        why = row["device_failures"]["local02"]
        assert "local02 cannot follow run" in why and "--allow-plugin" in why, why
        assert row["reported"] and set(row["reporters"].values()) == {"local01"}


def test_the_doctor_says_what_the_daemon_does_of_each_plugin(lab_package, tmp_path):
    """Issue 94, finding 3: doctor warned that runs using the lab's rule "are refused here"
    unless allowed, while the daemon followed them (a rule runs on the coordinator; a device
    never loads it). Both now ask the registry's one lookup (`device_refusal`): with nothing
    allowed, doctor calls the rule nothing to allow and the model refused, and the daemon
    follows a run with the rule and refuses one with the model; a rule of another version
    installed here does not stop it either."""
    from fedseq.client.doctor import check_plugins
    from fedseq.client.session import DeviceSession
    from fedseq.client.settings import load_settings
    from fedseq.common.protocol.messages import RunConfig
    from fedseq.common.protocol.topics import Topics

    said = {line.split(" (")[0]: ok for ok, line in check_plugins(
        load_settings(None, {"device": "d1"}, environ={}))}
    assert said["plugin aggregation rule 'labmean'"] is True
    assert said["plugin model 'labnet'"] is None
    runs = []  # (the coordinator's run configs, each pinning the rule at another version)
    for cfg, follows in ((load_config(None, ["aggregation.rule=labmean"]), True),
                         (lab_config(), False)):
        pins = {**REGISTRY.pins(cfg.registered_names()),
                "aggregators/labmean": "fedseq-labdemo==0.0.1"}
        runs.append((RunConfig(run_id="r1", config=cfg.for_devices(), plugins=pins), follows))
    REGISTRY.restrict([])  # the daemon's restriction (nothing allowed)
    try:
        for rc, follows in runs:
            s = DeviceSession("d1", "mqtt://127.0.0.1:1", "cpu", tmp_path)
            s.announce = lambda: None
            s.on_message(Topics().run_config, rc.encode())
            assert (s.run is not None) is follows, s.last_error
    finally:
        REGISTRY.restrict(None)
