"""fedseq-sim --workers N: a simulation's clients trained by worker processes over torch.distributed.

Rank 0 runs the round loop with a `DistributedPool`; ranks 1..N are workers (`serve`). One
machine: `fedseq-sim --workers N` starts the workers itself (Gloo over loopback). Several
machines: the same command under `torchrun` (every rank runs fedseq-sim; rank 0 is the one that
writes the run directory).

Every step goes out to all workers at once (broadcast_step: the step, the weights, which worker
trains which client, and those clients' personal blocks) and comes back point to point once a
collective has gathered the answers' sizes (gather_answers). The round
loop folds the updates in client order, as in-process. A client's result depends on its data,
seeds, weights and torch thread count, never on which process trains it, so with the same threads
per client a run with any number of workers is bitwise the in-process run (tests/server/
test_distributed.py). The selected clients are spread over the workers each step by their rows
(largest first to the least loaded worker): a fixed client-to-worker assignment leaves one worker
with two thirds of a 6-client round about half the time. Rank 0 keeps every client's personal
blocks (as the in-process pool does: its checkpoints are the same, so a run resumes with another
number of workers, or in-process).

Every rank proves the run's secret twice before it is sent anything: through the rendezvous
store (membership.py), and again over its own connection to rank 0 once the Gloo group stands
(`prove_pairs`), so a process that slipped into the group in a rank's place (the store has no
access control) is refused. Rank 0 exchanges with each worker point to point alone. Steps and
answers are pickles of plain data (tensors as raw bytes: `pack`) read by an unpickler that can
build fedseq's own dataclasses and tensors and nothing else (`unpack`): a rank can at worst send
a bad update, which the round's contract refuses.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import io
import logging
import math
import os
import pickle
import platform
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any

# A rank started as `python -m fedseq.server.pools.distributed` (or fedseq-sim under torchrun,
# server/cli/commands.py): c10d's own log lines (a stack trace per connection retry) before torch
# loads; every failure of the group is said in one line here instead.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fedseq.common import __version__
from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.config import ExperimentConfig, dump_config, tomllib
from fedseq.common.errors import ConfigError, FedseqError, TransportError
from fedseq.common.evaluation import EvalReport
from fedseq.common.execution import ClientExecutor, InMemory
from fedseq.common.hardware import torch_device
from fedseq.common.models import BlockModel, Weights, personal_tensors
from fedseq.common.text import printable
from fedseq.server.pools.inprocess import on_device
from fedseq.server.pools.membership import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    admit_ranks,
    cluster_secret,
    new_secret,
    prove_membership,
)
from fedseq.server.pools.processes import die_with_parent, stop_children
from fedseq.server.rounds.pool_api import (
    ClientPool,
    EvalOutcome,
    FinetuneOutcome,
    PoolState,
    Progress,
    RoundOutcome,
    ScoreCheck,
    TrainRound,
    UpdateCheck,
)

log = logging.getLogger(__name__)

#: how long a step's collectives may wait: a dead worker is noticed at once (its sockets close),
#: a round's training may take long at paper scale. Joining and the greeting use JOIN_TIMEOUT.
STEP_TIMEOUT = datetime.timedelta(hours=6)
#: a worker's answer, once its size is known, arrives within this many seconds plus one per 10 MB
MIN_RECEIVE_S = 60.0
ANSWER_TAG = 7
_STEPS: list[Any] = []  # the group of the steps (every rank), made once the group is joined


def steps_group() -> Any:
    """The process group the steps run in: every rank, with STEP_TIMEOUT (the default group,
    used to join and greet, has JOIN_TIMEOUT: a missing rank is said within it)."""
    if not _STEPS:
        _STEPS.append(dist.new_group(backend="gloo", timeout=STEP_TIMEOUT))
    return _STEPS[0]
#: how long a rank waits to reach the rendezvous (FEDSEQ_JOIN_TIMEOUT_S overrides it)
JOIN_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("FEDSEQ_JOIN_TIMEOUT_S", 300)))


class _StepPickler(pickle.Pickler):
    """Pickles a CPU tensor as its dtype, shape and raw bytes. torch's own reduction of a tensor
    runs torch.save on its storage: 5 CNN updates (11.6 MB) took 23.5 ms to pickle and 8.4 ms to
    load, most of a step's overhead; as raw bytes, about 2 and 1 ms. Bitwise the same tensors."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            raw = obj.detach().contiguous().reshape(-1).view(torch.uint8)  # a Parameter: its data
            # a writable PickleBuffer is written as it is and loads as a bytearray (one copy)
            return _tensor, (str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                             pickle.PickleBuffer(raw.numpy().data))
        return NotImplemented  # anything else as pickle does it (`unpack` reads plain data only)


#: the dtypes a step or an answer may carry
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


def _tensor(dtype: str, shape: tuple[int, ...], raw: bytearray) -> torch.Tensor:
    """A tensor unpickled: the bytes it was sent as (a bytearray nobody else holds), not a copy."""
    kind = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if kind is None or not isinstance(raw, (bytes, bytearray)):
        raise pickle.UnpicklingError(f"a tensor of dtype {printable(str(dtype), 40)}")
    if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise pickle.UnpicklingError("a tensor whose shape is not a tuple of sizes")
    if not raw:  # its bytes are its size: an empty one holds no element (no allocation by shape)
        if math.prod(shape) != 0:
            raise pickle.UnpicklingError(f"a tensor of shape {printable(str(shape), 60)} "
                                         "without its bytes")
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(raw, dtype=kind).reshape(shape)


#: what runs when pickle builds an object, beyond storing its fields: a class that has any of
#: these (its own or inherited, not object's) is not plain data
_HOOKS = ("__post_init__", "__setstate__", "__reduce__", "__reduce_ex__", "__new__",
          "__getattr__", "__getattribute__", "__init_subclass__")


def plain_dataclass(cls: Any) -> bool:
    """Whether building `cls` from a pickle only stores fields: a dataclass whose __init__ is
    the one dataclasses generated, with none of `_HOOKS` (a __post_init__ would run whatever
    it does on the sender's values)."""
    return (isinstance(cls, type) and dataclasses.is_dataclass(cls)
            and getattr(getattr(cls.__init__, "__code__", None), "co_filename", "") == "<string>"
            and not any(h in vars(k) for k in cls.__mro__ if k is not object for h in _HOOKS))


class _PlainData(pickle.Unpickler):
    """Builds what a step or an answer holds (containers, numbers, strings, fedseq's own plain
    dataclasses, tensors through `_tensor`) and nothing else: no other callable is reachable,
    and building a plain dataclass runs nothing but its generated __init__, so a step or an
    answer cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, "_tensor"):
            return _tensor
        if module.startswith("fedseq.common.") and "." not in name:
            obj = super().find_class(module, name)
            if plain_dataclass(obj):
                return obj
        raise pickle.UnpicklingError(f"refers to {printable(module, 80)}.{printable(name, 80)}, "
                                     "which no step or answer holds")


def _pickled(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    _StepPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf


def pack(obj: Any) -> bytes:
    """What a step or an answer carries, as bytes (`unpack` gives it back)."""
    return _pickled(obj).getvalue()


def _packed_tensor(obj: Any) -> torch.Tensor:
    """`pack(obj)` as a uint8 tensor over the pickle's own buffer (not a copy), to send."""
    return torch.frombuffer(_pickled(obj).getbuffer(), dtype=torch.uint8)


def unpack(raw: Any) -> Any:
    """`raw`: bytes or any buffer of them (a uint8 array), read by `_PlainData`; TransportError
    in one line for anything else."""
    try:
        return _PlainData(io.BytesIO(raw)).load()
    except Exception as exc:  # any malformed or hostile pickle: one line, nothing built
        raise TransportError(f"a rank sent what no fedseq rank sends ({printable(str(exc), 200)})"
                             ) from exc


def gather_answers(group: Any = None) -> list[Any]:
    """Rank 0: every worker's answer to a step (rank 1 first), point to point: its size, then
    the answer into a buffer of that size (Gloo's gather took 32-40 ms for two 10.5 MB answers
    on loopback where point to point took 6 ms, 2-core machine). A worker that died fails the
    size's receive at once; each answer may take MIN_RECEIVE_S plus a second per 10 MB."""
    group = group if group is not None else steps_group()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size() - 1)]
    for work in [dist.irecv(n, src=r, group=group, tag=ANSWER_TAG) for r, n in enumerate(sizes, 1)]:
        assert work is not None  # None only for a rank outside the group
        work.wait()
    bufs = [torch.empty(max(0, int(n)), dtype=torch.uint8) for n in sizes]
    works = [dist.irecv(b, src=r, group=group, tag=ANSWER_TAG) for r, b in enumerate(bufs, 1)]
    for work, b in zip(works, bufs, strict=True):
        assert work is not None
        work.wait(timeout=datetime.timedelta(seconds=MIN_RECEIVE_S + b.numel() / 10e6))
    return [unpack(b.numpy()) for b in bufs]


def broadcast_step(step: Any, group: Any = None) -> None:
    """Rank 0: a step to every worker, as its packed bytes (their size first), point to point
    to each (rank 0 talks to no worker through another): 4.7-5.5 ms a 2.3 MB step to 2 workers
    where broadcast_object_list took 8.3-11.6 ms (bench/step_broadcast.py)."""
    group = group if group is not None else steps_group()
    raw = _packed_tensor(step)
    size = torch.tensor([raw.numel()], dtype=torch.int64)
    works = [w for r in range(1, dist.get_world_size())
             for w in (dist.isend(size, dst=r, group=group), dist.isend(raw, dst=r, group=group))]
    for work in works:
        assert work is not None
        work.wait()


def receive_step(group: Any = None) -> Any:
    """A worker's side of broadcast_step: the next step, unpacked."""
    group = group if group is not None else steps_group()
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=0, group=group)
    raw = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(raw, src=0, group=group)
    return unpack(raw.numpy())


def send_answer(answer: Any, group: Any = None) -> None:
    """A worker's side of gather_answers."""
    group = group if group is not None else steps_group()
    raw = _packed_tensor(answer)
    dist.send(torch.tensor([raw.numel()], dtype=torch.int64), dst=0, group=group, tag=ANSWER_TAG)
    dist.send(raw, dst=0, group=group, tag=ANSWER_TAG)


def _pair_mac(secret: str, nonce: bytes, rank: int) -> torch.Tensor:
    mac = hmac.new(secret.encode(), nonce + f"|pair|{rank}".encode(), hashlib.sha256).digest()
    return torch.frombuffer(bytearray(mac), dtype=torch.uint8)


def prove_pairs(secret: str) -> None:
    """Right after the Gloo group forms, before anything else crosses it: rank 0 sends each
    worker a fresh nonce over their own connection and checks the HMAC it answers with. The
    store that told the ranks each other's addresses has no access control: a process that
    took a rank's place in the group (it read the store's port, wrote its own address) cannot
    answer, and the run stops in one line, having sent it nothing but the nonce."""
    if dist.get_rank() == 0:
        bad = []
        for r in range(1, dist.get_world_size()):
            nonce = bytearray(secrets.token_bytes(32))
            dist.send(torch.frombuffer(nonce, dtype=torch.uint8), dst=r)
            got = torch.zeros(32, dtype=torch.uint8)
            dist.recv(got, src=r)
            if not hmac.compare_digest(bytes(got.numpy()), bytes(_pair_mac(secret, bytes(nonce), r).numpy())):
                bad.append(r)
        dist.broadcast(torch.tensor([len(bad)], dtype=torch.int64), src=0)
        if bad:
            raise TransportError(f"rank {bad[0]}'s connection in the group did not prove the run's "
                                 "secret (another process took its place after the rendezvous); "
                                 "the run stops before anything is sent to it")
    else:
        nonce_t = torch.zeros(32, dtype=torch.uint8)
        dist.recv(nonce_t, src=0)
        dist.send(_pair_mac(secret, bytes(nonce_t.numpy()), dist.get_rank()), dst=0)
        verdict = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(verdict, src=0)
        if int(verdict):
            raise TransportError("rank 0 found a rank of the group that did not prove the secret; "
                                 "the run stopped")


def balance(clients: list[int], rows: dict[int, int], workers: int) -> list[list[int]]:
    """Each worker's clients for one step: largest first to the least loaded worker (ties: the
    lower client, the lower worker), each worker's list in client order. Deterministic."""
    shares: list[list[int]] = [[] for _ in range(workers)]
    load = [0] * workers
    for c in sorted(clients, key=lambda c: (-rows[c], c)):
        w = min(range(workers), key=lambda w: (load[w], w))
        shares[w].append(c)
        load[w] += rows[c]
    return [sorted(s) for s in shares]


def placement(hellos: list[dict[str, Any]], choice: str, per_gpu: int) -> dict[int, str]:
    """Each worker's torch device: `choice` is train.device (cpu, cuda, cuda:N, auto). On GPUs,
    a machine's workers (by rank) fill its GPUs in turn, `per_gpu` to a GPU before the next
    (0: one each in turn); cuda:N puts every worker on GPU N; auto is cuda where every worker's
    machine has a GPU, else cpu (a run never mixes the two). Refuses in one line a GPU choice a
    worker's machine cannot honour."""
    ranks = sorted(h["rank"] for h in hellos)
    by_rank = {h["rank"]: h for h in hellos}
    if choice == "auto":
        choice = "cuda" if all(h["gpus"] > 0 for h in hellos) else "cpu"
    if not choice.startswith("cuda"):
        return {r: "cpu" for r in ranks}
    fixed = int(choice.split(":")[1]) if ":" in choice else None
    out: dict[int, str] = {}
    seen: dict[str, int] = {}  # host -> its workers placed so far
    for r in ranks:
        h = by_rank[r]
        if h["gpus"] <= (fixed or 0):
            has = f"{h['gpus']} GPU(s)" if h["gpus"] else f"no GPU (torch {h['torch']})"
            raise ConfigError(f"train.device = {choice!r}, but rank {r} on {h['host']} sees "
                              f"{has}; run the workers where the GPUs are, or use "
                              "train.device = 'cpu'")
        i = seen.get(h["host"], 0)
        seen[h["host"]] = i + 1
        gpu = fixed if fixed is not None else (i // per_gpu if per_gpu else i) % h["gpus"]
        out[r] = f"cuda:{gpu}"
    return out


def adopt_slurm_env() -> None:
    """Under `srun` (a step of several tasks), RANK, WORLD_SIZE and LOCAL_RANK from Slurm's
    SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_LOCALID, as torchrun would set them (MASTER_ADDR
    and MASTER_PORT stay the job script's to export). A batch script's own shell, which has
    SLURM_PROCID but is no step, is left alone; so is a launcher's RANK."""
    env = os.environ
    if "RANK" in env or int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1) < 2:
        return
    env["RANK"] = env.get("SLURM_PROCID", "0")
    env["WORLD_SIZE"] = env["SLURM_STEP_NUM_TASKS"]
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))


@dataclass
class StepTiming:
    """One step as rank 0 saw it: its wall time from broadcast to gathered answers, and the
    compute seconds of its busiest worker; the difference is the distribution's overhead."""

    kind: str
    wall_s: float
    busiest_s: float


def hand_on(trained: Iterable[tuple[ClientUpdate, Weights]], personal: dict[int, Weights],
            check: UpdateCheck) -> Generator[ClientUpdate, None, RoundOutcome]:
    """The workers' clients' (update, new personal blocks), in client order: keep each client's new
    personal blocks (a diverged client keeps its previous ones) and yield the updates the round
    loop's check accepts."""
    for update, blocks in trained:
        if update.diverged_at is None:
            personal[update.client] = blocks
        if check(update) is None:
            yield update
    return RoundOutcome()


class DistributedPool(ClientPool):
    """The clients of a simulation, trained by the workers of a torch.distributed process group
    (this process is rank 0). Their personal blocks are kept here."""

    def __init__(self, data_sizes: dict[int, tuple[int, int]], model: BlockModel,
                 personal_blocks: tuple[str, ...], seed: int, eval_batch: int):
        #: client -> (training rows, test rows): what a step's share is balanced by
        self.sizes = data_sizes
        self.seed = seed
        self.eval_batch = eval_batch
        self.workers = dist.get_world_size() - 1
        #: every step's wall time here and its busiest worker's compute (bench/workers.py)
        self.timings: list[StepTiming] = []
        initial = personal_tensors(model, personal_blocks)
        self.personal: dict[int, Weights] = {
            c: {k: v.clone() for k, v in initial.items()} for c in data_sizes}

    def _step(self, kind: str, **body: Any) -> list[Any]:
        """Send a step to every worker and gather their answers (rank 1 first)."""
        start = time.perf_counter()
        try:
            broadcast_step((kind, body))
            answers = gather_answers()
        except (RuntimeError, dist.DistError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise TransportError(f"a simulation worker stopped during a {kind} step ({first}); "
                                 "the run directory resumes after its last complete round: "
                                 "fedseq-sim --resume OUT") from exc
        for a in answers:
            if isinstance(a, str):  # a worker's own error, in one line
                raise TransportError(f"a simulation worker failed a {kind} step: {a}")
        self.timings.append(StepTiming(kind, time.perf_counter() - start,
                                       max(seconds for seconds, _ in answers)))
        return [answer for _, answer in answers]

    def _shares(self, clients: list[int], which: int) -> list[list[int]]:
        return balance(clients, {c: self.sizes[c][which] for c in clients}, self.workers)

    def open(self, weights: Weights, personal: tuple[str, ...]) -> None:
        """Nothing to announce: every step carries what its clients need."""

    def train(self, round: int, clients: list[int], plan: ClientPlan, weights: Weights,
              check: UpdateCheck, enough: int | None = None, secure: Any = None) -> TrainRound:
        return TrainRound(self._train(round, clients, plan, weights, check))

    def _train(self, round: int, clients: list[int], plan: ClientPlan, weights: Weights,
               check: UpdateCheck) -> Generator[ClientUpdate, None, RoundOutcome]:
        got: dict[int, tuple[ClientUpdate, Weights]] = {}
        for answer in self._step("train", round=round, plan=plan, weights=weights,
                                 shares=self._shares(clients, 0),
                                 personal={c: self.personal[c] for c in clients}):
            got.update(answer)
        return (yield from hand_on((got[c] for c in clients), self.personal, check))

    def evaluate(self, weights: Weights, eval_heads: tuple[str, ...], check: ScoreCheck
                 ) -> EvalOutcome:
        """Every client's personalized model, and the global model in shards (each worker on its
        clients' test rows)."""
        clients = sorted(self.sizes)
        g_correct = g_total = 0
        per_client: dict[int, tuple[int, int]] = {}
        for rep in self._step("evaluate", weights=weights, eval_heads=eval_heads,
                              shares=self._shares(clients, 1), personal=self.personal):
            g_correct += rep.global_correct
            g_total += rep.global_total
            per_client.update(rep.per_client)
        return EvalOutcome(EvalReport(g_correct, g_total, dict(sorted(per_client.items()))))

    def finetune(self, plan: ClientPlan, weights: Weights, eval_heads: tuple[str, ...],
                 check: ScoreCheck, progress: Progress) -> FinetuneOutcome:
        clients = sorted(self.sizes)
        out = FinetuneOutcome({})
        for scores, diverged in self._step("finetune", plan=plan, weights=weights,
                                           eval_heads=eval_heads, shares=self._shares(clients, 0),
                                           personal=self.personal):
            out.scores.update(scores)
            out.diverged.update(diverged)
        out.scores = dict(sorted(out.scores.items()))
        out.diverged = dict(sorted(out.diverged.items()))
        progress(len(out.scores), len(clients))
        return out

    def snapshot(self) -> PoolState:
        return PoolState(None, self.personal)

    def restore(self, state: PoolState) -> None:
        self.personal.update(state.personal)

    def stop(self) -> None:
        """Tell the workers the run is over (they exit)."""
        broadcast_step(("stop", {}))

    def __enter__(self) -> DistributedPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """After a finished run the workers are told to stop (they exit); after a failure the
        group's end stops them (end_group), as a worker may be the failure."""
        if kind is None:
            self.stop()


# -- rank 0: the group and its workers ----------------------------------------------------------


@dataclass
class Group:
    """What rank 0 started and decided: the worker processes it runs itself (none under a
    launcher), each worker's torch device, and the GPU they train on ("" on CPU)."""

    procs: list[subprocess.Popen]
    devices: dict[int, str]
    gpu: str


def start_group(cfg: ExperimentConfig, workers: int, threads: int, per_gpu: int = 0) -> Group:
    """Rank 0 of a new group: under torchrun (RANK/WORLD_SIZE set) join it, else start `workers`
    worker processes on this machine (every socket on loopback). Every rank first proves it knows
    the run's secret (membership.py); then rank 0 hands every worker the config, its thread
    count and its device (`placement`), and checks what each says (its fedseq and torch
    versions, its GPUs, its data). Refuses in one line what cannot work."""
    procs: list[subprocess.Popen] = []
    if under_torchrun():
        store, rank, world = env_store()
        secret = cluster_secret()
        hellos = admit_ranks(store, world, secret, JOIN_TIMEOUT)
        init_group(store, rank, world, secret)
    else:
        procs, hellos = _local_workers(workers, threads)
    try:
        mine = (__version__, torch.__version__)
        problems = [f"rank {h['rank']} on {printable(h['host'], 80)} runs fedseq "
                    f"{printable(h['fedseq'], 40)} with torch {printable(h['torch'], 40)}, rank 0 "
                    f"fedseq {mine[0]} with torch {mine[1]}"
                    for h in hellos if (h["fedseq"], h["torch"]) != mine]
        devices: dict[int, str] = {}
        refused: ConfigError | None = None
        if not problems:
            try:
                devices = placement(hellos, cfg.train.device, per_gpu)
            except ConfigError as exc:
                refused = exc
        go = not problems and refused is None
        world_group = dist.group.WORLD
        broadcast_step((dump_config(cfg), threads, devices) if go else None, world_group)
        if refused is not None:
            raise refused
        if not problems:  # then the experiment: the data must be there
            ready = gather_answers(world_group)
            problems = [f"rank {h['rank']} on {printable(str(h['host']), 80)}: "
                        f"{printable(str(h['error']), 300)}" for h in ready if h["error"]]
            if problems:
                broadcast_step(("stop", {}), world_group)
        if problems:
            raise ConfigError("a simulation worker cannot run this experiment: " + problems[0]
                              + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                              + "; install the same fedseq, torch and dataset everywhere")
    except BaseException:
        end_group(procs)
        raise
    by_rank = {h["rank"]: h for h in hellos}
    gpus = sorted({by_rank[r]["gpu_names"][int(d.split(":")[1])] for r, d in devices.items()
                   if d.startswith("cuda")})
    return Group(procs, devices, " + ".join(gpus))


def _local_workers(workers: int, threads: int) -> tuple[list[subprocess.Popen], list[Any]]:
    """`workers` worker processes started on this machine, admitted (each proved it knows the
    run's secret) and joined to rank 0's group on loopback: the processes and their hellos."""
    procs: list[subprocess.Popen] = []
    store = loopback_store(workers + 1)
    secret = new_secret()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), SECRET_ENV: secret}
    env.pop(SECRET_FILE_ENV, None)
    env.setdefault("MALLOC_ARENA_MAX", "2")
    for rank in range(1, workers + 1):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "fedseq.server.pools.distributed", "127.0.0.1", str(store.port),
             str(rank), str(workers + 1)], env=env, preexec_fn=die_with_parent))
    try:
        hellos = admit_ranks(store, workers + 1, secret, JOIN_TIMEOUT)
        init_group(store, 0, workers + 1, secret, loopback=True)
    except (RuntimeError, dist.DistError) as exc:
        stop_workers(procs)
        raise TransportError(f"the {workers} simulation workers did not join within "
                             f"{JOIN_TIMEOUT.total_seconds():.0f} s: {str(exc).splitlines()[0]}") from exc
    except TransportError:  # one was refused (membership.py says which and why)
        stop_workers(procs)
        raise
    return procs, hellos


def loopback_store(world: int) -> Any:
    """The rendezvous store of a one-machine group, listening on 127.0.0.1 only (torch's own
    would listen on every address): on a socket made here, handed to the store's server as a
    file descriptor of its own (libuv closes it with the store; the one made here is closed at
    once, so no descriptor number is ever closed twice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        fd = os.dup(sock.fileno())
        try:
            return dist.TCPStore("127.0.0.1", sock.getsockname()[1], world, is_master=True,
                                 timeout=JOIN_TIMEOUT, wait_for_workers=False,
                                 master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise


def loopback_interface() -> str:
    """The loopback interface's name (Gloo binds to an interface's address; "lo" on Linux)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def under_torchrun() -> bool:
    """Whether this process is one rank of a group a launcher made (torchrun, srun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def env_store() -> tuple[Any, int, int]:
    """(the rendezvous store, this rank, the world size) of the group torchrun (or srun with
    MASTER_ADDR/PORT) describes. The store is reached within JOIN_TIMEOUT or the process ends
    in one line (not after the steps' timeout)."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"a distributed simulation needs RANK, WORLD_SIZE, MASTER_ADDR and "
                          f"MASTER_PORT (torchrun sets them; under srun, export MASTER_ADDR and "
                          f"MASTER_PORT in the job script): {exc} is not set") from exc
    # torchrun's agent hosts the store itself; a plain launcher leaves it to rank 0
    master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store: Any = dist.TCPStore(host, port, world, is_master=master, timeout=JOIN_TIMEOUT)
    except (RuntimeError, dist.DistError) as exc:
        raise _not_joined(rank, host, port, exc) from exc
    # after a restart (torchrun --max-restarts) the store still holds the last attempt's
    # addresses: each attempt has its own keys, as torch's env:// rendezvous does it
    store = dist.PrefixStore(
        f"/fedseq/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return store, rank, world


def init_group(store: Any, rank: int, world: int, secret: str, loopback: bool = False) -> None:
    """Join the Gloo group over `store` (once every rank is admitted), make the steps' group, and
    prove every rank's connection to rank 0 (`prove_pairs`); `loopback`: both groups bind the
    loopback interface, whatever this machine's hostname resolves to."""
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=JOIN_TIMEOUT)
        try:
            prove_pairs(secret)
            steps_group()  # made here, while Gloo is told to bind loopback
        except BaseException:  # a refused rank: leave the group, so this process can form another
            _STEPS.clear()
            dist.destroy_process_group()
            raise
    except (RuntimeError, dist.DistError) as exc:
        raise _not_joined(rank, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          os.environ.get("MASTER_PORT", "?"), exc) from exc
    finally:
        if loopback:
            if saved is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
            else:
                os.environ["GLOO_SOCKET_IFNAME"] = saved


def _not_joined(rank: int, host: str, port: object, exc: BaseException) -> TransportError:
    why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return TransportError(f"rank {rank} could not join the group at {host}:{port} within "
                          f"{JOIN_TIMEOUT.total_seconds():.0f} s ({why}); check MASTER_ADDR/"
                          "MASTER_PORT and that rank 0 runs")


def hello(rank: int) -> dict[str, Any]:
    """What a worker says of itself before it is given work (JSON: membership.py)."""
    gpus = torch.cuda.device_count()
    return {"rank": rank, "host": platform.node(), "fedseq": __version__,
            "torch": torch.__version__, "gpus": gpus,
            "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)]}


def stop_workers(procs: list[subprocess.Popen]) -> None:
    """Stop the worker processes (terminate, then kill after 10 s)."""
    stop_children(procs, timeout=10)


def end_group(procs: list[subprocess.Popen]) -> None:
    """Leave the process group and stop the workers started here."""
    _STEPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    stop_workers(procs)


# -- ranks 1..N: the workers --------------------------------------------------------------------


def serve() -> None:
    """A worker's life: join, load the experiment rank 0 sends, say hello, run steps until
    told to stop."""
    from fedseq.server.rounds.experiment import load_experiment

    rank = dist.get_rank()
    ready: dict[str, Any] = {"rank": rank, "host": platform.node(), "error": None}
    job = _receive()
    if job is None:  # rank 0 refused our versions
        return
    config, threads, devices = job
    torch.set_num_threads(threads)
    exp = None
    try:
        cfg = ExperimentConfig.model_validate(tomllib.loads(config))
        device = torch_device(devices[rank])
        exp = load_experiment(cfg)
    except (FedseqError, ValueError) as exc:
        ready["error"] = str(exc).splitlines()[0]
    send_answer(ready, dist.group.WORLD)
    if exp is None:
        _receive()  # rank 0 says stop
        return
    model, data = on_device(exp.model, exp.data, device)
    seed = cfg.seed_for("training")
    eval_batch = cfg.train.eval_batch_size
    while True:
        kind, body = receive_step()
        if kind == "stop":
            return
        mine = body["shares"][rank - 1]
        start = time.perf_counter()
        # the step's clients' personal blocks, as rank 0 holds them; what training changes is
        # answered back
        personal = InMemory(body["personal"])
        clients = ClientExecutor(model, data, seed, eval_batch, personal, cfg.algorithm.name)
        try:
            if kind == "train":
                answer: Any = {}
                for c in mine:
                    update = clients.train(c, body["round"], body["plan"], body["weights"])
                    answer[c] = (update, personal.blocks[c])
            elif kind == "evaluate":
                answer = clients.evaluate(body["weights"], (), body["eval_heads"], clients=mine)
            else:
                scores, diverged = {}, {}
                for c in mine:
                    scores[c], d = clients.finetune(c, body["plan"], body["weights"], (),
                                                    body["eval_heads"])
                    if d is not None:
                        diverged[c] = d
                answer = (scores, diverged)
        except Exception as exc:  # noqa: BLE001 - said to rank 0 in one line, which ends the run
            log.exception("worker %d: %s step failed", rank, kind)
            why = str(exc).splitlines()[0] if str(exc) else ""
            send_answer(f"rank {rank}: {type(exc).__name__}: {why}")
            continue
        send_answer((time.perf_counter() - start, answer))


def _receive() -> Any:
    """What rank 0 sends while the workers join (the job, or None: stop)."""
    return receive_step(dist.group.WORLD)


def worker_main() -> None:
    """`python -m fedseq.server.pools.distributed HOST PORT RANK WORLD` (started by rank 0), or a rank
    other than 0 of a launcher's group (fedseq-sim under torchrun)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        local = len(sys.argv) == 5 and not under_torchrun()
        if local:
            host, port, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
            store = dist.TCPStore(host, port, world, is_master=False, timeout=JOIN_TIMEOUT)
        else:
            store, rank, world = env_store()
        secret = os.environ.get(SECRET_ENV, "") if local else cluster_secret()
        prove_membership(store, rank, secret, hello(rank), JOIN_TIMEOUT)
        init_group(store, rank, world, secret, loopback=local)
        serve()
    except FedseqError as exc:
        print(f"fedseq worker: {exc}", file=sys.stderr)
        sys.exit(2)
    except (RuntimeError, dist.DistError) as exc:  # rank 0 went away: nothing left to do
        print(f"fedseq worker: the run ended ({str(exc).splitlines()[0] if str(exc) else exc})",
              file=sys.stderr)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    # run as the imported module, not as __main__: what a worker pickles (_tensor) must name a
    # module rank 0 can import
    from fedseq.server.pools.distributed import worker_main as imported_main

    imported_main()
