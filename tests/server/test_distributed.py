"""fedseq-sim --workers: the simulation's clients trained by torch.distributed worker processes
(Gloo on loopback, real process groups): the in-process numbers, resume with another number of
workers, the failures a cluster has."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import Planted, quick_config, same_run, without_seconds
from fedseq.common.errors import ConfigError, TransportError
from fedseq.server.ops.simulation import run_simulation
from fedseq.server.pools.distributed import adopt_slurm_env, balance, pack, placement, unpack
from fedseq.server.rounds.checkpoint import load_checkpoint

SECRET = "3f9c2a7be41d8f6053a1c9e7b2d4f08a6e5c3b1a9d7f2e4c6b8a0d1f3e5c7a9b"  # a cluster run's
# 3 of 5 clients a round: the rounds' selections differ and are split unevenly over workers
OVER = ("rounds=3", "train.join_ratio=0.6", "train.threads=1", "model.name=convnet",
        "algorithm.unfreeze_rounds=[0,1,1,2]", "algorithm.finetune_epochs=1")


def test_balance_spreads_a_steps_rows_and_is_deterministic():
    rows = {0: 500, 1: 400, 2: 300, 3: 300, 4: 100}
    # by hand, largest first to the least loaded: 0 -> w0 (500), 1 -> w1 (400), 2 -> w1 (700),
    # 3 -> w0 (800), 4 -> w1 (800)
    assert balance([0, 1, 2, 3, 4], rows, 2) == [[0, 3], [1, 2, 4]]
    shares = balance(list(rows), rows, 2)
    assert sorted(c for s in shares for c in s) == list(rows)
    assert balance([1, 2], rows, 4) == [[1], [2], [], []]


def test_steps_carry_tensors_as_they_are():
    """pack/unpack (what steps and answers travel as): every dtype and shape comes back bitwise,
    writable and not sharing the sender's memory; a Parameter travels as its data."""
    from fedseq.common.algorithms.aggregate import ClientUpdate

    g = torch.Generator().manual_seed(0)
    sent = {
        "f32": torch.randn(3, 4, generator=g), "f64": torch.randn(5, dtype=torch.float64),
        "f16": torch.randn(6, generator=g).half(), "bf16": torch.randn(7, generator=g).bfloat16(),
        "i64": torch.arange(-3, 4), "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(250, 256, dtype=torch.uint8), "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3), "transposed": torch.randn(4, 6, generator=g).t(),
        "view": torch.arange(20.0)[5:9],
        "nested": [ClientUpdate(3, 1, {"w": torch.full((2, 2), -0.0)}, 10)],
    }
    back = unpack(pack(sent))
    for k, v in sent.items():
        if k == "nested":
            continue
        b = back[k]
        assert type(b) is type(v) and b.dtype == v.dtype and b.shape == v.shape, k
        assert torch.equal(b, v), k
    param = unpack(pack(torch.nn.Parameter(torch.ones(2))))
    assert type(param) is torch.Tensor and not param.requires_grad and torch.equal(param, torch.ones(2))
    d = back["nested"][0].deltas["w"]
    assert back["nested"][0].client == 3 and torch.equal(d, sent["nested"][0].deltas["w"])
    assert str(d[0, 0].item()) == "-0.0"  # bits, not values
    d.add_(1.0)  # writable, and not the sender's memory
    assert float(sent["nested"][0].deltas["w"].sum()) == 0.0


def test_a_step_or_answer_cannot_run_code(tmp_path):
    """Hardening V, finding 2: what ranks exchange is read by an unpickler that builds plain
    data, fedseq's dataclasses and tensors alone: an answer that would call a function is refused
    in one line and the function never runs; so is a tensor of a dtype no step carries."""
    import pickle

    marker = tmp_path / "ran"
    for hostile in (pickle.dumps((1.0, {3: Planted(marker)})),
                    pickle.dumps(torch.nn.Parameter(torch.ones(2)))):  # torch's own reduction
        with pytest.raises(TransportError, match="no step or answer holds") as err:
            unpack(hostile)
        assert "\n" not in str(err.value)
    assert not marker.exists()
    from fedseq.server.pools import distributed

    class Forged:  # _tensor("load", ...): a name of torch that is no dtype
        def __reduce__(self):
            return (distributed._tensor, ("load", (1,), bytearray(4)))

    forged = pickle.dumps(Forged(), protocol=5)
    with pytest.raises(TransportError, match="dtype load"):
        unpack(forged)
    assert distributed.DTYPES["float32"] is torch.float32

    class Huge:  # Hardening VI, finding 9: a tensor sized by its shape alone, without its bytes
        def __init__(self, shape, raw):
            self.args = ("float32", shape, raw)

        def __reduce__(self):
            return (distributed._tensor, self.args)

    for shape, raw, words in (((5 << 30,), bytearray(), "without its bytes"),
                              ((2, -3), bytearray(24), "tuple of sizes"),
                              ([4], bytearray(16), "tuple of sizes"),
                              ((3,), bytearray(16), r"shape '\[3\]' is invalid")):  # 16 B: 4 floats
        with pytest.raises(TransportError, match=words):
            unpack(pickle.dumps(Huge(shape, raw), protocol=5))
    assert unpack(pickle.dumps(Huge((0, 5), bytearray()), protocol=5)).shape == (0, 5)


def test_only_plain_dataclasses_are_built_from_what_ranks_send():
    """Hardening VI, finding 9 (gadgets): of fedseq.common's dataclasses the unpickler builds only
    those whose building stores fields (the generated __init__, no __post_init__, __setstate__,
    __reduce__ or __new__ of their own). Krum's __post_init__ would run on a sender's values: a
    pickle naming it (before: built) is refused in one line; every class a step or answer holds
    is plain, and each one the rule admits is checked against the list of hooks."""
    import dataclasses
    import importlib
    import pkgutil

    import fedseq.common
    from fedseq.common.algorithms.robust import Krum
    from fedseq.server.pools.distributed import plain_dataclass

    crafted = b"cfedseq.common.algorithms.robust\nKrum\n)R."  # GLOBAL, (), REDUCE: Krum()
    with pytest.raises(TransportError, match="robust.Krum, which no step or answer holds"):
        unpack(crafted)
    assert not plain_dataclass(Krum)
    found = []
    for info in pkgutil.walk_packages(fedseq.common.__path__, "fedseq.common."):
        module = importlib.import_module(info.name)
        found += [obj for obj in vars(module).values() if isinstance(obj, type)
                  and dataclasses.is_dataclass(obj) and obj.__module__ == info.name]
    admitted = [c for c in found if plain_dataclass(c)]
    assert len(found) >= 30 and {"ClientPlan", "ClientUpdate"} <= {c.__name__ for c in admitted}
    assert {c.__name__ for c in found if c not in admitted} == {"ClippedMean", "CoordinateWise",
                                                                "Krum"}
    for cls in admitted:
        assert "__post_init__" not in vars(cls) and "__setstate__" not in vars(cls), cls


def _hello(rank, host, gpus):
    return {"rank": rank, "host": host, "gpus": gpus, "torch": "2.13.0+cpu"}


def test_placement_fills_each_machines_gpus_k_workers_to_a_gpu():
    hellos = [_hello(r, "a" if r <= 5 else "b", 2) for r in range(1, 9)]
    assert placement(hellos, "cpu", 2) == {r: "cpu" for r in range(1, 9)}
    # machine a: ranks 1-5 on 2 GPUs, 2 to a GPU, the fifth wraps; machine b: ranks 6-8
    assert placement(hellos, "cuda", 2) == {1: "cuda:0", 2: "cuda:0", 3: "cuda:1", 4: "cuda:1",
                                            5: "cuda:0", 6: "cuda:0", 7: "cuda:0", 8: "cuda:1"}
    assert placement(hellos, "cuda", 0) == {1: "cuda:0", 2: "cuda:1", 3: "cuda:0", 4: "cuda:1",
                                            5: "cuda:0", 6: "cuda:0", 7: "cuda:1", 8: "cuda:0"}
    assert set(placement(hellos, "cuda:1", 2).values()) == {"cuda:1"}
    assert set(placement(hellos, "auto", 1).values()) == {"cuda:0", "cuda:1"}
    mixed = hellos[:-1] + [_hello(8, "c", 0)]
    assert set(placement(mixed, "auto", 1).values()) == {"cpu"}  # never a mix of devices
    with pytest.raises(ConfigError, match="rank 8 on c sees no GPU"):
        placement(mixed, "cuda", 1)
    with pytest.raises(ConfigError, match="rank 1 on a sees 2 GPU"):
        placement(hellos, "cuda:2", 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs workers without a GPU")
def test_gpu_workers_without_a_gpu_are_refused_in_one_line(data_root, one_thread):
    """Real worker processes say they have no GPU; rank 0 refuses before any round."""
    cfg = quick_config(data_root, "algorithm.name=fedavg", *OVER, "train.device='cuda'")
    with pytest.raises(ConfigError, match=r"rank \d on .* sees no GPU") as exc:
        run_simulation(cfg, None, workers=2)
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="--workers-per-gpu 2: .* sees no GPU"):
        run_simulation(cfg, None, workers_per_gpu=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_workers_give_bitwise_the_in_process_gpu_run(data_root, one_thread):
    """Workers sharing the GPU(s), K = 2 to a GPU, train what one process trains on the GPU."""
    for name in ("fedavg", "fedseq-anti"):
        cfg = quick_config(data_root, f"algorithm.name={name}", *OVER, "train.device='cuda'")
        same_run(run_simulation(cfg, None, workers_per_gpu=2), run_simulation(cfg, None))


def test_srun_tasks_become_a_groups_ranks(monkeypatch):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()  # a copy to change
                                        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    # a batch script's own shell: Slurm sets SLURM_PROCID there too, but it is no step
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    adopt_slurm_env()
    assert "RANK" not in os.environ
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    adopt_slurm_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "4", "1")
    monkeypatch.setenv("SLURM_PROCID", "2")
    adopt_slurm_env()  # a launcher's RANK stays
    assert os.environ["RANK"] == "3"


@pytest.mark.slow("torch.distributed worker processes (Gloo process groups): 14 s on 2 cores")
@pytest.mark.parametrize("name,workers,model", [("fedavg", 2, "convnet"),
                                                ("fedadam", 2, "convnet"),
                                                ("scaffold", 2, "convnet"),
                                                ("gpfl", 2, "convnet"),
                                                ("moon", 3, "convnet"),
                                                ("fednova", 2, "convnet"),
                                                ("fedreg", 2, "convnet"),
                                                ("fedseq-anti", 2, "convnet"),
                                                ("fedseq-anti", 3, "4convnet"),
                                                ("fedseq-anti", 2, "4convnet running")])
def test_workers_give_bitwise_the_in_process_run(data_root, one_thread, name, workers, model):
    """A plain, a server-optimized, a control-variate (SCAFFOLD: c_i kept by rank 0 as personal
    state), a two-head and a fine-tuned algorithm, and a BatchNorm model (its global model scored
    in shards) on batch statistics and on running statistics: weights, rows (accuracies, bytes,
    FLOPs, client steps) and per-client scores equal the in-process run's. (FedPer, FedDyn,
    Ditto and FedBN: test_a_run_resumes_with_another_number_of_workers, on 2 and 3 workers.)"""
    model, norm = (model.split() + ["batch"])[:2]
    cfg = quick_config(data_root, f"algorithm.name={name}", *OVER, f"model.name={model}",
                       f"model.norm={norm}")
    same_run(run_simulation(cfg, None, workers=workers), run_simulation(cfg, None))


@pytest.mark.slow("torch.distributed worker processes (Gloo process groups): 30 s on 2 cores")
@pytest.mark.parametrize("personal", [("algorithm.name=fedper",),
                                      ("algorithm.name=fedavg", "model.name=4convnet",
                                       "model.norm=fedbn"),
                                      ("algorithm.name=feddyn",),
                                      ("algorithm.name=ditto", "algorithm.ditto.epochs=1")])
def test_a_run_resumes_with_another_number_of_workers(data_root, tmp_path, one_thread, personal):
    """Personal state (FedPer's heads, FedBN's normalization layers, FedDyn's g_k beside the
    server's h, Ditto's own models) survives the checkpoint: a run started on 2 workers and
    resumed on 3 is bitwise the in-process run, every row (but its seconds) included. (So these
    four are not repeated in test_workers_give_bitwise_the_in_process_run.)"""
    cfg = quick_config(data_root, *OVER, *personal)
    whole = run_simulation(cfg, None)
    with pytest.raises(KeyboardInterrupt):  # RunPaused: stopped after round 0's checkpoint
        run_simulation(cfg, tmp_path / "run", workers=2, pause_after=1)
    assert load_checkpoint(tmp_path / "run").next_round == 1
    resumed = run_simulation(cfg, tmp_path / "run", mode="resume", workers=3)
    assert all(torch.equal(resumed.global_weights[k], v) for k, v in whole.global_weights.items())
    assert resumed.final.per_client == whole.final.per_client
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert without_seconds(rows) == without_seconds(whole.rows)


def _workers_of_this_process() -> list[int]:
    me, out = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me and b"fedseq.server.pools.distributed" in cmd:
            out.append(int(pid))
    return out


@pytest.mark.slow("torch.distributed worker processes (Gloo process groups): 9 s on 2 cores")
def test_a_killed_worker_ends_the_run_in_one_line_and_it_resumes(data_root, tmp_path, one_thread):
    cfg = quick_config(data_root, "algorithm.name=fedavg", *OVER)
    killed = []

    def kill_one(row):
        if row.round == 0:
            pids = _workers_of_this_process()
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)
            killed.append(time.monotonic())

    with pytest.raises(TransportError) as err:
        run_simulation(cfg, tmp_path / "run", on_round=kill_one, workers=2)
    assert killed and time.monotonic() - killed[0] < 60
    assert "a simulation worker stopped" in str(err.value) and "\n" not in str(err.value)
    assert "--resume" in str(err.value)
    deadline = time.monotonic() + 30  # the other worker is stopped with the run
    while _workers_of_this_process() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _workers_of_this_process()
    resumed = run_simulation(cfg, tmp_path / "run", mode="resume", workers=2)
    whole = run_simulation(cfg, None)
    assert all(torch.equal(resumed.global_weights[k], v) for k, v in whole.global_weights.items())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_env(monkeypatch, port: int) -> dict[str, str]:
    """Rank 0 here, as torchrun would set it up; the worker's environment."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "FEDSEQ_JOIN_TIMEOUT_S": "60",
                 "FEDSEQ_SECRET": SECRET}.items():
        monkeypatch.setenv(k, v)
    return {**os.environ, "RANK": "1", "OMP_NUM_THREADS": "1"}


def test_a_worker_without_the_dataset_is_refused_in_one_line(data_root, tmp_path, monkeypatch,
                                                             one_thread):
    """Under a launcher's group (torchrun's environment): rank 1 runs where data.root (relative)
    is not there."""
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank1").mkdir()
    (tmp_path / "rank0" / "data").symlink_to(data_root)
    monkeypatch.chdir(tmp_path / "rank0")
    env = _torchrun_env(monkeypatch, _free_port())
    worker = subprocess.Popen([sys.executable, "-m", "fedseq.server.pools.distributed"], env=env,
                              cwd=tmp_path / "rank1", stderr=subprocess.PIPE, text=True)
    try:
        cfg = quick_config(Path("data"), "algorithm.name=fedavg", *OVER)
        with pytest.raises(ConfigError) as err:
            run_simulation(cfg, None)
        assert worker.wait(60) == 0
    finally:
        worker.kill()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("a simulation worker cannot run this experiment: rank 1")
    assert "missing dataset file" in msg


def test_a_worker_of_another_fedseq_is_refused_in_one_line(data_root, monkeypatch, one_thread):
    env = _torchrun_env(monkeypatch, _free_port())
    other = ("import fedseq.server.pools.distributed as d; d.__version__ = '0.0.0-other'; "
             "d.worker_main()")
    worker = subprocess.Popen([sys.executable, "-c", other], env=env)
    try:
        cfg = quick_config(data_root, "algorithm.name=fedavg", *OVER)
        with pytest.raises(ConfigError, match=r"rank 1 on .* runs fedseq 0.0.0-other with torch"):
            run_simulation(cfg, None)
        assert worker.wait(60) == 0
    finally:
        worker.kill()


@pytest.mark.slow("torch.distributed worker processes (Gloo process groups): 8 s on 2 cores")
def test_an_unreachable_rendezvous_is_one_line_not_a_hang(tmp_path):
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "FEDSEQ_JOIN_TIMEOUT_S": "3"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fedseq.server.pools.distributed"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.monotonic() - start < 60
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank 1 could not join the group at 127.0.0.1:" in lines[0]


def _cli_over(data_root: Path, *more: str) -> tuple[str, ...]:
    """quick_config's settings and OVER as fedseq-sim --set values."""
    return (f"data.root={str(data_root)!r}", "data.dataset=fmnist", "data.fraction=0.05",
            "data.num_clients=5", "data.alpha=0.5", "data.min_samples=40",
            "train.local_epochs=1", "train.batch_size=20", *OVER, *more)


def _sim_command(out: Path, *over: str) -> list[str]:
    sets = [a for o in over for a in ("--set", o)]
    return [str(Path(sys.executable).parent / "fedseq-sim"), *sets, "--out", str(out), "--quiet"]


def _metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k != "seconds"}
            for x in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from fedseq.common.protocol.tensors import decode_tensors

    return decode_tensors((out / "model.safetensors").read_bytes())


def _same_as_one_process(out: Path, one: Path, over: tuple[str, ...], env: dict[str, str]) -> None:
    """The run directory `out` holds bitwise the run plain fedseq-sim writes to `one`: every row
    but its seconds, the final weights."""
    alone = subprocess.run(_sim_command(one, *over), env=env, capture_output=True, text=True,
                           timeout=600)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert _metrics(out) == _metrics(one)
    a, b = _weights(out), _weights(one)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "--no-python"]


@pytest.mark.slow("torch.distributed worker processes (Gloo process groups): 15 s on 2 cores")
def test_fedseq_sim_under_torchrun_gives_the_in_process_run(data_root, tmp_path):
    """The same program under torchrun (one node, 3 ranks): rank 0 writes the run directory."""
    over = _cli_over(data_root, "algorithm.name=fedper")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDSEQ_SECRET": SECRET}
    done = subprocess.run(_torchrun("--nnodes", "1", "--nproc-per-node", "3", "--master-port",
                                    str(_free_port()))
                          + _sim_command(tmp_path / "dist", *over), env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    _same_as_one_process(tmp_path / "dist", tmp_path / "one", over, env)
    status = json.loads((tmp_path / "dist" / "status.json").read_text())
    assert status["state"] == "finished" and status["workers"] == 2


@pytest.mark.slow("torch.distributed worker processes (Gloo process groups): 13 s on 2 cores")
def test_fedseq_sim_as_srun_tasks_gives_the_in_process_run(data_root, tmp_path):
    """Three fedseq-sim processes with the environment srun gives a step's tasks (and the
    MASTER_ADDR/MASTER_PORT a job script exports) are one group: rank 0 writes the run."""
    over = _cli_over(data_root, "algorithm.name=fedavg")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", FEDSEQ_SECRET=SECRET)
    srun = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), SLURM_STEP_NUM_TASKS="3",
                SLURM_NTASKS="3", SLURM_JOB_ID="77")
    tasks = [subprocess.Popen(_sim_command(tmp_path / "dist", *over),
                              env={**env, **srun, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(3)]
    try:
        logs = [t.communicate(timeout=600)[0] for t in tasks]
    finally:
        for t in tasks:
            t.kill()
    assert [t.returncode for t in tasks] == [0, 0, 0], "\n".join(log[-1500:] for log in logs)
    _same_as_one_process(tmp_path / "dist", tmp_path / "one", over, env)
    assert json.loads((tmp_path / "dist" / "status.json").read_text())["workers"] == 2


@pytest.mark.slow("torch.distributed worker processes (Gloo process groups): 19 s on 2 cores")
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.xdist_group("netns")  # the rehearsal's bridge: one at a time
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_nodes_in_network_namespaces_give_the_one_machine_run(data_root, tmp_path,
                                                                  rendezvous):
    """Several machines rehearsed on one: two "nodes" (network namespaces joined by the
    rehearsal's bridge), torchrun's rendezvous across them at node1's address, 2 ranks each:
    static (--node-rank, --master-addr) and c10d (--rdzv-backend c10d, what a cluster's
    elastic jobs use: the rendezvous decides which node holds global rank 0)."""
    from fedseq.server.ops.rehearsal import Rehearsal

    over = _cli_over(data_root, "algorithm.name=fedreg")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDSEQ_SECRET": SECRET}

    def meeting(r: int) -> tuple[str, ...]:
        if rendezvous == "static":
            return ("--node-rank", str(r), "--master-addr", "10.77.0.2", "--master-port", "29417")
        # The endpoint's node hosts the rendezvous store, and rank 0's node tells the others
        # its address: torchrun takes both from the hostname, which the namespaces share (it
        # resolves to 127.0.0.1 here), so each node is told (on a cluster the hostname is the
        # node's own and neither option is needed)
        return ("--rdzv-backend", "c10d", "--rdzv-endpoint", "10.77.0.2:29417",
                "--rdzv-id", "fedseq-test", "--local-addr", f"10.77.0.{r + 2}",
                "--rdzv-conf", f"is_host={'true' if r == 0 else 'false'}")

    with Rehearsal(["node1", "node2"], {}) as net:
        # each node's hostname resolves to 127.0.0.1 here: Gloo is told the node's interface
        nodes = [subprocess.Popen(
            net.command(f"node{r + 1}", _torchrun(
                "--nnodes", "2", "--nproc-per-node", "2", *meeting(r))
                + _sim_command(tmp_path / f"node{r + 1}", *over)),
            env={**env, "GLOO_SOCKET_IFNAME": f"fsq{net.id}d{r + 1}"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for r in (0, 1)]
        try:
            logs = [n.communicate(timeout=600)[0] for n in nodes]
        finally:
            for n in nodes:  # torchrun and its ranks, should the test fail
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(n.pid, signal.SIGKILL)
    assert [n.returncode for n in nodes] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    written = [n for n in ("node1", "node2") if (tmp_path / n).exists()]
    assert len(written) == 1  # only rank 0 writes a run directory
    assert rendezvous == "c10d" or written == ["node1"]  # static: rank 0 is --node-rank 0's
    _same_as_one_process(tmp_path / written[0], tmp_path / "one", over, env)
    assert json.loads((tmp_path / written[0] / "status.json").read_text())["workers"] == 3


def _parent(pid: int) -> int:
    """The parent pid of `pid` (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def _rank_process(rank: int, torchrun: int) -> int | None:
    """The pid of the fedseq-sim process that the torchrun `torchrun` started as `rank`: only
    its descendants count, as another test's torchrun may run ranks of the same number."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"fedseq-sim" in cmd and f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in \
                b"".join(env):
            up = int(pid)
            while up > 1 and up != torchrun:
                up = _parent(up)
            if up == torchrun:
                return int(pid)
    return None


@pytest.mark.slow("torch.distributed worker processes (Gloo process groups): 19 s on 2 cores")
def test_a_worker_killed_under_torchrun_max_restarts_resumes_the_run(data_root, tmp_path):
    """torchrun starts the group again after a worker dies; rank 0 continues the run directory
    after its last complete round, and the result is the uninterrupted run's."""
    over = _cli_over(data_root, "algorithm.name=fedavg", "rounds=4")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDSEQ_SECRET": SECRET}
    run = subprocess.Popen(_torchrun("--nnodes", "1", "--nproc-per-node", "3", "--max-restarts",
                                     "1", "--master-port", str(_free_port()))
                           + _sim_command(tmp_path / "dist", *over), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = tmp_path / "dist" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and run.poll() is None and not (
                metrics.exists() and metrics.read_text().count("\n") >= 1):
            time.sleep(0.1)
        victim = _rank_process(2, run.pid)
        assert victim is not None and run.poll() is None
        os.kill(victim, signal.SIGKILL)
        log = run.communicate(timeout=600)[0]
    finally:
        run.kill()
    assert run.returncode == 0, log[-3000:]
    status = json.loads((tmp_path / "dist" / "status.json").read_text())
    assert status["state"] == "finished" and len(status["segments"]) >= 2, status  # resumed
    _same_as_one_process(tmp_path / "dist", tmp_path / "one", over, env)


def _listening(pids: set[int]) -> list[str]:
    """The local addresses the processes `pids` listen on (TCP, IPv4 and IPv6), as hex from
    /proc/net/tcp*: 0100007F is 127.0.0.1, 00000000 any address."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                out.append(f[1].split(":")[0])
    return out


def _tree(root: int) -> set[int]:
    pids = {root}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if _parent(int(pid)) == root:
            pids.add(int(pid))
    return pids


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


def test_workers_listen_on_loopback_only(data_root, tmp_path):
    """Hardening IV, finding 4: `fedseq-sim --workers 2` is no network service: the rendezvous
    store and every Gloo socket of rank 0 and its workers listen on loopback only, whatever the
    machine's hostname resolves to."""
    over = _cli_over(data_root, "algorithm.name=fedavg", "rounds=8")
    run = subprocess.Popen(_sim_command(tmp_path / "w", *over) + ["--workers", "2"],
                           env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while run.poll() is None and time.monotonic() < deadline and len(seen) < 5:
            seen = _listening(_tree(run.pid))  # the store, and each rank's Gloo listener
            time.sleep(0.2)
        assert len(seen) >= 5, seen
        assert set(seen) <= LOOPBACK, seen
    finally:
        run.kill()
        run.wait()


def test_a_rank_without_the_secret_is_refused_before_anything_is_unpickled(
        data_root, monkeypatch, one_thread):
    """Hardening IV, finding 4: under a launcher, a process that joins as rank 1 without the
    run's secret is refused in one line before rank 0 unpickles anything (its hello is JSON
    with an HMAC, membership.py); the process is told so too."""
    import torch.distributed.distributed_c10d as c10d

    env = _torchrun_env(monkeypatch, _free_port())
    unpickled: list[int] = []
    real = c10d._tensor_to_object
    monkeypatch.setattr(c10d, "_tensor_to_object", lambda *a, **k: unpickled.append(1) or real(*a, **k))
    intruder = subprocess.Popen([sys.executable, "-m", "fedseq.server.pools.distributed"],
                                env={**env, "FEDSEQ_SECRET": SECRET[::-1]}, stderr=subprocess.PIPE,
                                text=True)
    try:
        cfg = quick_config(data_root, "algorithm.name=fedavg", *OVER)
        with pytest.raises(TransportError, match="rank 1 does not know the run's secret") as err:
            run_simulation(cfg, None)
        _, said = intruder.communicate(timeout=60)
    finally:
        intruder.kill()
    assert unpickled == [] and "\n" not in str(err.value)
    assert intruder.returncode == 2 and "it refused this rank" in said, said


ROGUE = """
import sys, torch, torch.distributed as dist, datetime
store = dist.PrefixStore("/fedseq/attempt_0", dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2,
                         is_master=False, timeout=datetime.timedelta(seconds=60)))
store.wait(["fedseq/verdict"])  # rank 1 proved the secret through the store: take its place
dist.init_process_group("gloo", store=store, rank=1, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
nonce = torch.zeros(32, dtype=torch.uint8)
dist.recv(nonce, src=0)
dist.send(torch.zeros(32, dtype=torch.uint8), dst=0)  # its best guess at the proof
verdict = torch.zeros(1, dtype=torch.int64)
dist.broadcast(verdict, src=0)
print("refused" if int(verdict) else "admitted")
"""


def test_a_process_that_takes_a_rank_after_the_rendezvous_is_refused(data_root, monkeypatch,
                                                                      one_thread):
    """Hardening V, finding 2: the rendezvous store has no access control, so a process without
    the secret can let rank 1 prove itself there and then take rank 1's place in the Gloo group.
    Its connection to rank 0 cannot prove the secret: rank 0 stops in one line before it sends
    the config or reads anything from it (before, rank 0 sent it the config and unpickled its
    answer)."""
    from fedseq.server.pools import distributed

    port = _free_port()
    env = _torchrun_env(monkeypatch, port)
    loaded: list[int] = []
    real = distributed._PlainData.load
    monkeypatch.setattr(distributed._PlainData, "load", lambda self: loaded.append(1) or real(self))
    sent: list[object] = []
    real_pack = distributed._packed_tensor
    monkeypatch.setattr(distributed, "_packed_tensor", lambda obj: sent.append(obj) or real_pack(obj))
    honest = subprocess.Popen([sys.executable, "-c", (
        "import sys, datetime, torch.distributed as dist; "
        "from fedseq.server.pools.membership import prove_membership; "
        "s = dist.PrefixStore('/fedseq/attempt_0', dist.TCPStore('127.0.0.1', int(sys.argv[1]), 2, "
        "is_master=False, timeout=datetime.timedelta(seconds=60))); "
        f"prove_membership(s, 1, '{SECRET}', {{'rank': 1, 'host': 'h', 'fedseq': '', "
        "'torch': '', 'gpus': 0, 'gpu_names': []}, datetime.timedelta(seconds=60)); "
        "import time; time.sleep(90)"), str(port)], env=env)
    rogue = subprocess.Popen([sys.executable, "-c", ROGUE, str(port)],
                             env={k: v for k, v in env.items() if k != "FEDSEQ_SECRET"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cfg = quick_config(data_root, "algorithm.name=fedavg", *OVER)
        with pytest.raises(TransportError, match="did not prove the run's secret") as err:
            run_simulation(cfg, None)
        out, said = rogue.communicate(timeout=60)
    finally:
        rogue.kill()
        honest.kill()
    assert "\n" not in str(err.value)
    assert out.strip() == "refused", said
    assert loaded == [] and sent == []  # nothing read from it, no config sent to it


def test_a_cluster_run_without_a_secret_says_how_to_give_one(monkeypatch):
    from fedseq.server.pools.membership import cluster_secret

    monkeypatch.delenv("FEDSEQ_SECRET", raising=False)
    monkeypatch.delenv("FEDSEQ_SECRET_FILE", raising=False)
    with pytest.raises(ConfigError, match="export FEDSEQ_SECRET=") as err:
        cluster_secret()
    assert "\n" not in str(err.value)


def test_membership_over_a_store():
    """admit_ranks / prove_membership over an in-process store: the right secret admits and
    returns the hellos; a forged hello, a wrong rank and a verdict rank 0 did not sign are
    refused."""
    import datetime
    import json
    import threading

    import torch.distributed as dist

    from fedseq.server.pools.membership import admit_ranks, prove_membership

    t = datetime.timedelta(seconds=20)

    def run(secrets: dict[int, str], forged: bytes | None = None):
        store = dist.HashStore()
        errors: dict[int, Exception] = {}

        def rank(r: int) -> None:
            try:
                if forged is not None and r == 2:
                    store.set("fedseq/hello/2", forged)
                    return
                prove_membership(store, r, secrets[r], {"rank": r, "host": "h"}, t)
            except Exception as exc:  # noqa: BLE001 - looked at below
                errors[r] = exc

        threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
        for th in threads:
            th.start()
        try:
            return admit_ranks(store, 3, "s", t), errors
        except TransportError as exc:
            return exc, errors
        finally:
            for th in threads:
                th.join(30)

    hellos, errors = run({1: "s", 2: "s"})
    assert hellos == [{"rank": 1, "host": "h"}, {"rank": 2, "host": "h"}] and not errors
    refused, errors = run({1: "s", 2: "x"})
    assert "rank 2 does not know the run's secret" in str(refused)
    assert all("refused" in str(e) for e in errors.values()) and set(errors) == {1, 2}
    pickle_hello = b"\x80\x04\x95" + b"x" * 20  # a pickle where JSON belongs
    refused, _ = run({1: "s"}, pickle_hello)
    assert "rank 2's hello is not what a fedseq rank sends" in str(refused)
    body = json.dumps({"rank": 1, "host": "h"})
    refused, _ = run({1: "s"}, json.dumps({"hello": body, "mac": "0" * 64}).encode())
    assert "rank 2 does not know the run's secret" in str(refused)


def test_the_loopback_store_closes_only_its_own_descriptor():
    """The one-machine store listens on a socket made here (loopback only), handed over as a
    descriptor of its own: when the store goes, libuv closes that one, never a number that
    another socket of the process took since (before, the number was closed twice: a coordinator
    in the same process later lost a socket of its broker's)."""
    import gc

    from fedseq.server.pools.distributed import loopback_store

    store = loopback_store(1)
    store.set("k", "v")
    probe = socket.socket()  # takes the lowest free descriptor number
    probe.bind(("127.0.0.1", 0))
    probe.listen()
    del store
    gc.collect()
    time.sleep(0.5)
    try:
        os.fstat(probe.fileno())  # still open: the store closed only its own (EBADF before)
        assert probe.getsockname()[0] == "127.0.0.1"
    finally:
        probe.close()


def test_a_weak_or_exposed_cluster_secret_is_refused(monkeypatch, tmp_path):
    """Hardening V, finding 7: a secret shorter than 32 characters (or of few distinct ones), or a
    secret file others can read, is refused in one line that says how to make one."""
    from fedseq.server.pools.membership import cluster_secret

    monkeypatch.delenv("FEDSEQ_SECRET_FILE", raising=False)
    for weak in ("7", "ab", "x" * 64):
        monkeypatch.setenv("FEDSEQ_SECRET", weak)
        with pytest.raises(ConfigError, match="too weak.*openssl rand -hex 32") as err:
            cluster_secret()
        assert "\n" not in str(err.value)
    good = SECRET
    monkeypatch.setenv("FEDSEQ_SECRET", good)
    assert cluster_secret() == good
    path = tmp_path / "secret"
    path.write_text(good + "\n")
    path.chmod(0o644)
    monkeypatch.setenv("FEDSEQ_SECRET_FILE", str(path))
    with pytest.raises(ConfigError, match="readable by others.*chmod 600"):
        cluster_secret()
    path.chmod(0o600)
    assert cluster_secret() == good
