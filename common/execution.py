"""Running logical clients' plans: the one executor of the in-process pool, of the `--workers`
ranks and of a device.

A `ClientExecutor` holds one model and the rows of its process's clients, and runs for one
client at a time a training round, a fine-tuning, or (for several) an evaluation, from the
shared blocks it is given (in the run's downlink codec: decoded here) and the client's personal
state. Personal state lives where the client
lives, behind `PersonalState`: in memory for the in-process pool and a worker's step
(`InMemory`), on the device's disk there (client/executor.py). The transports only choose the
clients, loop over them, and move what comes out. Runs on the device floor (Python 3.8, torch
1.12).
"""

from __future__ import annotations

from typing import Dict, Optional, Protocol, Sequence, Tuple

from fedseq.common.algorithms.aggregate import ClientUpdate
from fedseq.common.algorithms.hooks import client_side_of
from fedseq.common.algorithms.plan import ClientPlan
from fedseq.common.codecs import decode
from fedseq.common.data.federated import FederatedData
from fedseq.common.evaluation import EvalReport, evaluate
from fedseq.common.models import BlockModel, Weights
from fedseq.common.training import finetune_and_score, run_client_round


class PersonalState(Protocol):
    """Where a client's personal blocks live between its rounds."""

    def load(self, client: int, names: Sequence[str], before: Optional[int] = None) -> Weights:
        """The client's personal blocks (`names`: the algorithm's; the state may hold more, e.g.
        FedBN's normalization layers) as of its last round before `before` (None: its last)."""
        ...

    def save(self, client: int, blocks: Weights, round: int) -> None:
        """The client's new personal blocks after `round` (not called for a diverged round)."""
        ...


class InMemory(PersonalState):
    """Personal blocks in a dict, client -> blocks, which this object changes in place."""

    def __init__(self, blocks: Dict[int, Weights]):
        self.blocks = blocks

    def load(self, client: int, names: Sequence[str], before: Optional[int] = None) -> Weights:
        """The client's personal blocks (all of them: the dict holds no older versions)."""
        return self.blocks[client]

    def save(self, client: int, blocks: Weights, round: int) -> None:
        """Keep the client's new personal blocks."""
        self.blocks[client] = blocks


class ClientExecutor:
    """Runs one client's plan at a time on `model` over `data` (this process's clients' rows),
    with the run's training seed and evaluation batch, personal state in `personal`; `algorithm`:
    the run's (algorithm.name), whose client side says how its clients are evaluated."""

    def __init__(self, model: BlockModel, data: FederatedData, seed: int, eval_batch: int,
                 personal: PersonalState, algorithm: str):
        self.model = model
        self.side = client_side_of(algorithm)
        self.data = data
        self.seed = seed
        self.eval_batch = eval_batch
        self.personal = personal

    def train(self, client: int, round: int, plan: ClientPlan, shared: Weights) -> ClientUpdate:
        """One training round of `client` from `shared` and its personal blocks: its update (the
        round loop's check decides whether it counts); its new personal blocks are kept unless
        its training diverged (then it keeps its previous ones)."""
        held = self.personal.load(client, plan.personal, before=round)
        update, blocks = run_client_round(self.model, {**decode(shared), **held}, plan,
                                          self.data, self.data.clients[client], self.seed, round)
        if update.diverged_at is None:
            # state the round did not touch (a residual of a block not uploaded) is kept
            self.personal.save(client, {**held, **blocks}, round)
        return update

    def finetune(self, client: int, plan: ClientPlan, shared: Weights, personal: Sequence[str],
                 eval_heads: Tuple[str, ...]) -> Tuple[Tuple[int, int], Optional[int]]:
        """The final fine-tuning of `client` from `shared` and its personal blocks (`personal`:
        their names): its (correct, total) on its own test rows and the batch where the
        fine-tuning diverged (None: it did not). Nothing is kept."""
        start = {**decode(shared), **self.personal.load(client, personal)}
        return finetune_and_score(self.model, start, plan, self.data, self.data.clients[client],
                                  self.seed, eval_heads, self.eval_batch)

    def evaluate(self, shared: Weights, personal: Sequence[str], eval_heads: Tuple[str, ...],
                 clients: Optional[Sequence[int]] = None, with_global: bool = True) -> EvalReport:
        """Each client's personalized model (`shared` overridden by its personal blocks,
        `eval_heads` summed) on its own test rows, and (`with_global`) the global model on the
        union of those rows; `clients`: these (None: every client of `data`)."""
        chosen = list(range(len(self.data.clients))) if clients is None else list(clients)
        # the model's tensors of each client's state (not its control variates: SCAFFOLD's),
        # its own whole model where it keeps one (Ditto's)
        blocks = {c: self.side.view(self.personal.load(c, personal)) for c in chosen}
        return evaluate(self.model, self.data, decode(shared), blocks, eval_heads,
                        clients=None if clients is None else chosen, batch=self.eval_batch,
                        with_global=with_global, side=self.side)
