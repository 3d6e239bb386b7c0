"""Flower SecAgg+ timed with Flower's own code, beside ours (benchmarks/secagg.py): a client's masked-input
stage and the server's unmask stage.

Runs in an environment of its own with `flwr` installed, never the project's (flwr is no dependency of
fedlt):

    python3 -m venv .flwr && .flwr/bin/pip install flwr==1.42.0
    .flwr/bin/python benchmarks/flower_secaggplus.py --silos 30 --shares 11 --threshold 8 \
        --shapes '[[1229131]]' --repeats 1

Each repeat runs Flower's server workflow, `SecAggPlusWorkflow`'s four stages (setup, share keys, collect
masked vectors, unmask), over an in-process grid that answers every request with Flower's client mod
functions (`_setup`, `_share_keys`, `_collect_masked_vectors`, `_unmask`), for every client. The workflow
draws the neighbourhoods itself: node ids shuffled onto a ring, each node with the `num_shares` nodes
centred on it, itself included, so `--shares` is Flower's `num_shares` (n: every client; our SecAgg+ degree
k corresponds to k + 1) and `--threshold` its `reconstruction_threshold` (shares per secret, held ones
included). The quantization is the workflow's default (clip 8.0, 2^22 levels, mod 2^32); each client trains
nothing and reports its own float32 parameters, 1e-3 · N(0, 1) at `--shapes`, with 100 examples.

Timed, per repeat:
- masked input: each client's `_collect_masked_vectors` (opening its neighbours' share ciphertexts,
  weighting and quantizing its parameters, the private mask and a pairwise mask, with its key agreement, per
  neighbour), median over clients;
- unmask: the server's `unmask_stage` (rebuilding every secret from the shares, regenerating each private
  mask and each dropped client's pairwise masks, dequantizing) less the time spent inside the grid (the
  clients answering), in three cases as ours: no dropout; one client gone after its masked input (it does not
  answer the unmask request); one gone before (it does not answer the masked-vector request, so the server
  rebuilds its key and removes its pairwise masks). Each case is a whole workflow run of its own.
Every run must end with Flower's aggregate within a quantization step of the survivors' mean parameters,
or the script stops. Flower's workflow refuses a threshold of `num_shares` or more (t = 3 of 3, our
threshold at n = 3). Prints one JSON object: the seconds of each repeat, the masked input from the first
case's runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace

import flwr
import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import FedAvg
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import (
    SecAggPlusWorkflow,
    WorkflowState,
)
from flwr.supercore.task_identity import TaskIdentity

mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")  # the package re-exports a
# function under the module's name

EXAMPLES = 100  # each client's weight; below the workflow's max_weight of 1000
SCENARIOS = {"none": "", "after_masked": Stage.UNMASK, "before_masked": Stage.COLLECT_MASKED_VECTORS}
STAGES = (Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK)


def client_parameters(nid: int, shapes: list[list[int]], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, nid])
    return [rng.standard_normal(shape).astype(np.float32) * 1e-3 for shape in shapes]


@dataclass
class Grid:
    """Flower's grid in one process: each request answered by Flower's client mod functions for its node, and
    nothing from `dropped` from its first unanswered stage on. Records the seconds spent answering (the
    clients' work, not the server's) and each client's `_collect_masked_vectors`."""

    shapes: list[list[int]]
    seed: int
    dropped: dict[int, str] = field(default_factory=dict)
    states: dict[int, object] = field(default_factory=dict)
    answering_s: float = 0.0
    masked_s: dict[int, float] = field(default_factory=dict)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        started = time.perf_counter()
        replies = [reply for message in messages if (reply := self._answer(message)) is not None]
        self.answering_s += time.perf_counter() - started
        return replies

    def _answer(self, message: Message) -> Message | None:
        nid = message.metadata.dst_node_id
        record = message.content.config_records[RECORD_KEY_CONFIGS]
        stage = record[Key.STAGE]
        # a client's own copy, less the stage, as the mod reads it (the setup request is one shared object)
        configs = {key: value for key, value in record.items() if key != Key.STAGE}
        if nid in self.dropped and STAGES.index(stage) >= STAGES.index(self.dropped[nid]):
            return None
        state = self.states.setdefault(nid, mod.SecAggPlusState(nid=nid))
        content = RecordDict()
        if stage == Stage.SETUP:
            out = mod._setup(state, configs)
        elif stage == Stage.SHARE_KEYS:
            out = mod._share_keys(state, configs)
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            parameters = ndarrays_to_parameters(client_parameters(nid, self.shapes, self.seed))
            started = time.perf_counter()
            out = mod._collect_masked_vectors(state, configs, EXAMPLES, parameters)
            self.masked_s[nid] = time.perf_counter() - started
            # what the mod replies: the fit result, its arrays cleared, beside the masked vectors
            content = compat.fitres_to_recorddict(
                FitRes(Status(Code.OK, ""), Parameters([], ""), EXAMPLES, {}), keep_input=False
            )
        else:
            out = mod._unmask(state, configs)
        content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(out, False)
        return Message(content, reply_to=message)


class Strategy(FedAvg):
    """Samples every client with empty fit instructions (each reports its own parameters) and keeps the
    aggregate the unmask stage hands it, as it comes (read after the timing)."""

    def __init__(self, nids: list[int]) -> None:
        super().__init__()
        self.nids = nids
        self.aggregate = Parameters([], "")

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: object
    ) -> list[tuple[SimpleNamespace, FitIns]]:
        return [(SimpleNamespace(node_id=nid), FitIns(Parameters([], ""), {})) for nid in self.nids]

    def aggregate_fit(
        self, server_round: int, results: list[tuple[object, FitRes]], failures: list[object]
    ) -> tuple[None, dict]:
        self.aggregate = results[0][1].parameters
        return None, {}


def run(silos: int, shares: int, threshold: int, shapes: list[list[int]], seed: int, dropped: str) -> dict:
    """One workflow run; `dropped` is the first stage the last client does not answer ("" for none)."""
    nids = list(range(1, silos + 1))
    workflow = SecAggPlusWorkflow(shares, threshold)
    grid = Grid(shapes, seed, {nids[-1]: dropped} if dropped else {})
    strategy = Strategy(nids)
    state = RecordDict(
        {
            MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: 1}),
            MAIN_PARAMS_RECORD: compat.parameters_to_arrayrecord(Parameters([], ""), True),
        }
    )
    context = LegacyContext(Context(0, 0, {}, state, {}), strategy=strategy)
    flow = WorkflowState()
    stages = (workflow.setup_stage, workflow.share_keys_stage, workflow.collect_masked_vectors_stage)
    if not all(stage(grid, context, flow) for stage in stages):
        raise SystemExit(
            f"Flower's workflow halted before its unmask stage (n = {silos}, {dropped or 'none'})"
        )
    survivors = sorted(flow.active_node_ids)
    grid.answering_s = 0.0
    started = time.perf_counter()
    completed = workflow.unmask_stage(grid, context, flow)
    unmask = time.perf_counter() - started - grid.answering_s
    if not completed:
        raise SystemExit(f"Flower's unmask stage halted (n = {silos}, {dropped or 'none'})")
    check_aggregate(parameters_to_ndarrays(strategy.aggregate), mean_parameters(survivors, shapes, seed))
    return {"unmask_s": unmask, "masked_input_s": statistics.median(grid.masked_s.values())}


def mean_parameters(nids: list[int], shapes: list[list[int]], seed: int) -> list[np.ndarray]:
    total = [np.zeros(shape) for shape in shapes]
    for nid in nids:
        for into, part in zip(total, client_parameters(nid, shapes, seed), strict=True):
            into += part
    return [part / len(nids) for part in total]


def check_aggregate(aggregate: list[np.ndarray], mean: list[np.ndarray]) -> None:
    """Flower's aggregate is the survivors' mean parameters to within one quantization step a value (2 · 8 /
    2^22, over the weighting of 100 / 1000 examples): the run removed every mask."""
    step = 2 * 8.0 / 2**22 / (EXAMPLES / 1000)
    if any(np.abs(got - wanted).max() > step for got, wanted in zip(aggregate, mean, strict=True)):
        raise SystemExit("Flower's aggregate is not the survivors' mean: a mask was left in")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--silos", type=int, required=True)
    parser.add_argument("--shares", type=int, required=True, help="Flower's num_shares (n: every client)")
    parser.add_argument("--threshold", type=int, required=True, help="Flower's reconstruction_threshold")
    parser.add_argument("--shapes", required=True, help="JSON list of the parameter arrays' shapes")
    parser.add_argument("--cases", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    # who sends the messages the workflow builds: a ServerApp's run sets these
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    shapes = json.loads(args.shapes)
    runs = {
        case: [
            run(args.silos, args.shares, args.threshold, shapes, seed, SCENARIOS[case])
            for seed in range(args.repeats)
        ]
        for case in args.cases
    }
    print(
        json.dumps(
            {
                "flwr": flwr.__version__,
                "masked_input_s": [r["masked_input_s"] for r in runs[args.cases[0]]],
                "unmask_s": {case: [r["unmask_s"] for r in case_runs] for case, case_runs in runs.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
