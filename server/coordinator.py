"""The round loop: select clients, send what they need, aggregate what comes back, evaluate.

Transport-agnostic: it talks to a ClientPool (in-process or MQTT) and a RunDir.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedseq.common.algorithms import Algorithm
from fedseq.common.algorithms.aggregate import ClientUpdate, block_of
from fedseq.common.algorithms.fedreg import FedReG
from fedseq.common.algorithms.robust import make_aggregator, update_norm
from fedseq.common.config import ExperimentConfig
from fedseq.common.data.federated import FederatedData
from fedseq.common.evaluation import EvalReport, pooled_accuracy
from fedseq.common.flops import FlopCache, plan_flops
from fedseq.common.models import BlockModel, Weights, count_params, get_blocks
from fedseq.common.protocol.tensors import frame_size
from fedseq.common.seeding import numpy_rng
from fedseq.server.checkpoint import Checkpoint, save_checkpoint
from fedseq.server.pool import ClientPool
from fedseq.server.rundir import RunDir
from fedseq.server.validation import round_contract

log = logging.getLogger(__name__)


def select_clients(seed: int, round: int, num_clients: int, per_round: int) -> list[int]:
    """The round's participants: a pure function of (seed, round)."""
    rng = numpy_rng(seed, "select", round)
    return sorted(int(c) for c in rng.choice(num_clients, per_round, replace=False))


def _outliers(norms: dict[int, float], factor: float) -> tuple[list[int], float]:
    """Clients whose update norm exceeds factor x the round's median norm, and that median."""
    if len(norms) < 3:
        return [], 0.0
    median = float(np.median(list(norms.values())))
    return sorted(c for c, n in norms.items() if n > factor * median), median


class RunPaused(KeyboardInterrupt):
    """A run stopped on purpose after a checkpoint (bench/advance_runs.py): resumable."""


@dataclass
class RunResult:
    global_weights: Weights
    final: EvalReport
    rows: list[dict[str, Any]]


class Coordinator:
    def __init__(
        self,
        cfg: ExperimentConfig,
        algorithm: Algorithm,
        model: BlockModel,
        data: FederatedData,
        pool: ClientPool,
        run_dir: RunDir | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ):
        self.cfg = cfg
        self.alg = algorithm
        self.model = model
        self.data = data
        self.pool = pool
        self.run_dir = run_dir
        self.on_round = on_round or (lambda row: None)
        self.on_progress = on_progress or (lambda done, total: None)  # fine-tuning: clients done
        self.global_weights = get_blocks(model, model.spec.blocks)
        #: stop (resumably, after its checkpoint) once this many rounds are complete
        self.pause_after: int | None = None
        if isinstance(algorithm, FedReG):
            algorithm.set_train_sizes([len(c.train) for c in data.clients])
        # Version 0 of every block is the seed-derived initial model, which every client can
        # build itself; a block is sent to a client only when its version there is stale.
        self.version = dict.fromkeys(model.spec.blocks, 0)
        self.client_version = {c.client: dict(self.version) for c in data.clients}
        self._frame_sizes: dict[tuple[str, int], int] = {}
        self._last_report: EvalReport | None = None
        # client -> (correct, total) of its most recent locally trained model (FedReG's testbed)
        self.local_scores: dict[int, tuple[int, int]] = {}
        self.flop_cache: FlopCache = {}

    def _block_bytes(self, block: str) -> int:
        key = (block, self.version[block])
        if key not in self._frame_sizes:
            self._frame_sizes[key] = frame_size(
                {k: v for k, v in self.global_weights.items() if block_of(k) == block}
            )
        return self._frame_sizes[key]

    def _bytes_down(self, client: int, blocks: list[str]) -> int:
        total = 0
        held = self.client_version[client]
        for b in blocks:
            if held[b] != self.version[b]:
                total += self._block_bytes(b)
                held[b] = self.version[b]
        return total

    def run_round(self, t: int) -> dict[str, Any]:
        start = time.perf_counter()
        per_round = self.cfg.clients_per_round()
        selected = select_clients(self.cfg.seed, t, self.cfg.data.num_clients, per_round)
        plan = self.alg.plan(t)
        needed = [b for b in plan.uses if b not in plan.personal]
        send = {k: v for k, v in self.global_weights.items() if block_of(k) in needed}
        # A real transport counts what crossed the wire; only the in-process pool is estimated.
        wire = getattr(self.pool, "round_bytes", None)
        bytes_down = 0 if wire is not None else sum(self._bytes_down(c, needed) for c in selected)
        contract = round_contract(t, selected, plan.upload, self.global_weights, self.data,
                                  plan.rebalance_threshold, self.cfg.aggregation.max_abs_delta)
        acc = make_aggregator(self.cfg.aggregation)
        reported, flops, bytes_up = [], 0, 0
        fresh: dict[int, tuple[int, int]] = {}
        rejected: dict[int, str] = {}
        norms: dict[int, float] = {}

        def check(update: ClientUpdate) -> str | None:
            reason = contract.check(update)
            if reason is not None:
                log.warning("round %d: rejected update of client %d: %s", t, update.client, reason)
                rejected[update.client] = reason
            return reason

        # Pools yield only updates that passed `check`, at most one per client; `rejected` keeps
        # every refusal, also of a client whose valid update came later and counted.
        for update in self.pool.train(t, selected, plan, send, check):
            acc.add(update.deltas, self.alg.aggregation_weights(update), update.client)
            norms[update.client] = update_norm(update.deltas)
            reported.append(update.client)
            if update.local_score is not None:
                fresh[update.client] = update.local_score
            flops += plan_flops(self.model, plan, self.data, self.data.clients[update.client],
                                self.flop_cache)
            bytes_up += update.bytes_up
        if "quorum_failed" in (getattr(self.pool, "round_info", None) or {}):
            # too few valid updates: what was folded in as it arrived is discarded, the global
            # model stays as it was (the FLOPs were spent all the same)
            acc = make_aggregator(self.cfg.aggregation)
            reported, fresh, norms = [], {}, {}
        outliers, median = _outliers(norms, self.cfg.aggregation.outlier_factor)
        for c in outliers:
            log.warning("round %d: update of client %d has norm %.4g, > %g x the round's median %.4g",
                        t, c, norms[c], self.cfg.aggregation.outlier_factor, median)
        new = acc.apply(self.global_weights)
        for b in {block_of(k) for k, v in new.items() if v is not self.global_weights[k]}:
            self.version[b] += 1
        self.global_weights = new
        self.local_scores.update(fresh)
        last = t == self.cfg.rounds - 1
        report = None
        if (t + 1) % self.cfg.train.eval_every == 0 or last:
            report = self.pool.evaluate(self.global_weights, self.alg.eval_heads())
        if wire is not None:
            bytes_down, bytes_up = wire()
        row = {
            "round": t,
            "phase": "train",
            "global_acc": report.global_acc if report else None,
            "personal_acc": report.personal_acc if report else None,
            "local_acc": self._local_acc(report) if report else None,
            "round_local_acc": pooled_accuracy(fresh.values()),
            "clients": selected,
            "reported": reported,
            "status": "ok" if reported else "failed",
            "failed": sorted(set(selected) - set(reported)),
            "rejected": {str(c): r for c, r in sorted(rejected.items())},
            "outliers": outliers,
            "bytes_down": bytes_down,
            "bytes_up": bytes_up,
            "trainable_params": count_params(self.model, plan.trainable),
            "uploaded_blocks": list(plan.upload),
            "train_flops": flops,
            "seconds": round(time.perf_counter() - start, 3),
        }
        if self.alg.global_model_note:
            row["global_model"] = self.alg.global_model_note
        info = getattr(self.pool, "round_info", None)
        if info:  # the MQTT pool's record: deadline, who reported, device failures, quorum
            row.update(info)
            if "quorum_failed" in info:
                row["status"] = "failed"
        self._last_report = report
        return row

    def _local_acc(self, report: EvalReport) -> float | None:
        """FedReG's testbed personalized accuracy: every client's most recent locally trained
        model on its own test rows; a client that has not trained yet holds what it was sent."""
        return pooled_accuracy(self.local_scores.get(c, r) for c, r in report.per_client.items())

    def run(self, resume: Checkpoint | None = None) -> RunResult:
        rows = []
        first = self._restore(resume) if resume is not None else 0
        for t in range(first, self.cfg.rounds):
            row = self.run_round(t)
            rows.append(row)
            self._emit(row)
            if self.run_dir is not None:
                save_checkpoint(self.run_dir.path, self._checkpoint(t + 1))
            if self.pause_after is not None and t + 1 >= self.pause_after and t + 1 < self.cfg.rounds:
                raise RunPaused(f"paused after round {t} (resume to continue)")
        final = self._last_report
        assert final is not None
        ft_plan = self.alg.finetune_plan()
        if ft_plan is not None:
            start = time.perf_counter()
            if hasattr(self.pool, "progress"):
                self.pool.progress = self.on_progress
            tuned = self.pool.finetune(ft_plan, self.global_weights, (self.model.spec.head,))
            final = EvalReport(final.global_correct, final.global_total, tuned.per_client)
            row = {
                "round": self.cfg.rounds,
                "phase": "finetune",
                "global_acc": final.global_acc,
                "personal_acc": final.personal_acc,
                "local_acc": final.personal_acc,  # the fine-tuned models are the local ones
                "clients": sorted(tuned.per_client),
                "finetune_epochs": self.cfg.algorithm.finetune_epochs,
                "trainable_params": count_params(self.model, ft_plan.trainable),
                "seconds": round(time.perf_counter() - start, 3),
            }
            rows.append(row)
            self._emit(row)
        if self.run_dir is not None:
            self._write_outputs(final)
        return RunResult(self.global_weights, final, rows)

    def _checkpoint(self, next_round: int) -> Checkpoint:
        rep = self._last_report
        state: dict[str, Any] = {
            "version": self.version,
            "client_version": {str(c): v for c, v in self.client_version.items()},
            "local_scores": {str(c): list(r) for c, r in self.local_scores.items()},
            "last_report": None if rep is None else [
                rep.global_correct, rep.global_total,
                {str(c): list(r) for c, r in rep.per_client.items()}],
        }
        pool_state = getattr(self.pool, "checkpoint_state", None)
        if pool_state is not None:
            state["pool"] = pool_state()
        personal = getattr(self.pool, "personal", {})
        return Checkpoint(next_round, self.global_weights, state, personal)

    def _restore(self, ckpt: Checkpoint) -> int:
        """Continue after the checkpoint's last complete round; returns the next round."""
        self.global_weights = {k: ckpt.global_weights[k].to(v.dtype) for k, v in
                               self.global_weights.items()}
        self.version = {b: int(v) for b, v in ckpt.state["version"].items()}
        self.client_version = {int(c): v for c, v in ckpt.state["client_version"].items()}
        self.local_scores = {int(c): (r[0], r[1])
                             for c, r in ckpt.state.get("local_scores", {}).items()}
        rep = ckpt.state.get("last_report")
        if rep is not None:
            self._last_report = EvalReport(rep[0], rep[1],
                                           {int(c): (r[0], r[1]) for c, r in rep[2].items()})
        if ckpt.personal and hasattr(self.pool, "personal"):
            self.pool.personal.update(ckpt.personal)
        return ckpt.next_round

    def _emit(self, row: dict[str, Any]) -> None:
        if self.run_dir is not None:
            self.run_dir.log_round(row)
        self.on_round(row)

    def _write_outputs(self, final: EvalReport) -> None:
        assert self.run_dir is not None
        clients = []
        for shard in self.data.clients:
            correct, total = final.per_client.get(shard.client, (0, 0))
            clients.append({
                "client": shard.client,
                "train_samples": len(shard.train),
                "test_samples": len(shard.test),
                "correct": correct,
                "total": total,
                "accuracy": round(correct / total, 6) if total else "",
                "classes": int(np.count_nonzero(
                    shard.train_class_counts(self.data.y, self.data.num_classes).numpy())),
            })
        self.run_dir.write_clients(clients)
        self.run_dir.write_model(self.global_weights, {
            "algorithm": self.cfg.algorithm.name, "rounds": str(self.cfg.rounds),
            "seed": str(self.cfg.seed)})
