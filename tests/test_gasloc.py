"""GASLoC and plain gossip (algorithms/gasloc.py): identities, mixing (one round against a
hand-built mixing matrix), ledger, bad input. Resume is in tests/test_resume.py.

Identity tests run the real training loop (bench.run.train.Trainer) on 4 gloo ranks through
tests/distributed.py and compare parameters with a plain-torch DiLoCo reference written
here (replicas of a group start from the group's weights, run their inner steps, and
the group applies SGD(nesterov) to the mean pseudo-gradient). Every multi-process test
has a timeout.
"""

import copy
import os
from pathlib import Path

import pytest
import torch

from algorithms.base import TrainSetup
from algorithms.comm import Communicator
from algorithms.gasloc import GASLoC, GASLoCConfig, gossip_mix, mixing_weights, round_peers
from bench.config import load_config
from bench.data import load_corpus
from bench.data.batches import BatchStream
from bench.data.tokenizers import get_tokenizer
from bench.model import GPT, gpt_config
from bench.run.files import read_jsonl
from bench.run.records import RunDir
from bench.run.train import TRAIN_PHASES, Trainer, lr_at, make_optimizer_factory
from tests.distributed import run_distributed
from tests.helpers import assert_bad_config, assert_same_params, max_change
from tests.local_updates import Regression, regression_batch

TINY = "configs/gasloc-tiny.yaml"
# 6 steps in rounds of 2: three gossip rounds, so the outer momentum is exercised.
COMMON = ["run.steps=6", "run.log_every=2", "run.val_every=3", "run.val_sequences=2",
          "optim.warmup_steps=2", "checkpoint.final=false", "data.batch_size=2",
          "strategy.inner_steps=2"]


def train_and_collect(rank, world_size, overrides, run_dir, config=TINY):
    """Run the loop on this rank; return its worker's weights, ledger rows and summary."""
    cfg = load_config(config, [f"parallel.world_size={world_size}", *overrides])
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, run_dir, torch.device("cpu"), "gloo", keep_records=True)
    summary = trainer.run()
    trainer.strategy.close()
    params = {k: v.detach().clone() for k, v in trainer.strategy.model.state_dict().items()}
    ledger = [(r.phase, r.op, r.step, r.nbytes, r.peers) for r in trainer.ledger.records]
    return params, ledger, summary


def reference_diloco(rank, world_size, overrides, groups, outer_lr, momentum, config=TINY):
    """Plain-torch DiLoCo run by each group of `groups` on the same data as the Trainer.

    Returns each worker's final weights and the initial weights. Worker i trains on the
    first inner_steps[i] steps of every round of max(inner_steps) steps.
    """
    cfg = load_config(config, ["parallel.world_size=4", *overrides])
    n, steps = cfg.parallel.world_size, cfg.strategy.inner_steps
    local = steps if isinstance(steps, list) else [steps] * n
    round_steps = max(local)
    torch.manual_seed(cfg.run.seed)  # the Trainer's order: seed, corpus, model
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    splits = load_corpus(cfg.data.corpus, cfg.data.tokenizer,
                         os.path.expanduser(cfg.data.cache_dir), cfg.data.val_fraction)
    init = GPT(gpt_config(cfg.model.preset, tokenizer.vocab_size, cfg.model.seq_len))
    workers = [copy.deepcopy(init) for _ in range(n)]
    inner = [make_optimizer_factory(cfg)(w) for w in workers]
    streams = [BatchStream(splits.train, cfg.model.seq_len, cfg.data.batch_size, i, n,
                           cfg.run.seed) for i in range(n)]
    anchors = [copy.deepcopy(init) for _ in groups]
    outer = [torch.optim.SGD(a.parameters(), lr=outer_lr, momentum=momentum,
                             nesterov=momentum > 0) for a in anchors]
    for step in range(cfg.run.steps):
        for i in range(n):
            if step % round_steps >= local[i]:
                continue
            for group in inner[i].param_groups:
                group["lr"] = lr_at(step, cfg)
            inner[i].zero_grad()
            _, loss = workers[i](*streams[i].batch(step))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(workers[i].parameters(), cfg.optim.grad_clip)
            inner[i].step()
        if (step + 1) % round_steps:
            continue
        for members, anchor, opt in zip(groups, anchors, outer, strict=True):
            with torch.no_grad():
                for name, p in anchor.named_parameters():
                    replicas = [workers[i].get_parameter(name) for i in members]
                    p.grad = torch.stack([p - r for r in replicas]).mean(0)
            opt.step()
            for i in members:
                workers[i].load_state_dict(anchor.state_dict())
    return [w.state_dict() for w in workers], init.state_dict()


# ------------------------------------------------------------------ identities


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, outer_lr, momentum", [
    ("gasloc", 0.7, 0.9), pytest.param("gossip", 1.0, 0.0, marks=pytest.mark.slow)])
def test_complete_graph_equals_diloco(tmp_path, name, outer_lr, momentum):
    """GASLoC on the complete graph with uniform weights == DiLoCo(eta, gamma); plain
    gossip on it == Local SGD (DiLoCo with outer lr 1, no momentum). Checked against the
    plain-torch reference and algorithms/diloco.py. Also its ledger: p2p only, |theta| to
    each of the 3 peers per round."""
    config = f"configs/{name}-tiny.yaml"
    overrides = [*COMMON, "strategy.topology=complete"]
    if name == "gasloc":
        overrides += [f"strategy.outer_lr={outer_lr}", f"strategy.outer_momentum={momentum}"]
    results = run_distributed(train_and_collect, 4, overrides, str(tmp_path), config,
                              timeout=200)
    expected, init = run_distributed(reference_diloco, 1, overrides, [(0, 1, 2, 3)],
                                     outer_lr, momentum, config, timeout=120)[0]
    diloco = run_distributed(train_and_collect, 4, [
        *COMMON, f"strategy.outer_lr={outer_lr}", f"strategy.outer_momentum={momentum}"],
        str(tmp_path / "diloco"), "configs/diloco-tiny.yaml", timeout=200)
    for rank, (params, ledger, summary) in enumerate(results):
        assert_same_params(params, expected[rank])
        assert_same_params(params, diloco[rank][0], atol=5e-6, rtol=1e-5)
        param_bytes = summary["num_params"] * 4
        train = [row for row in ledger if row[0] in TRAIN_PHASES]
        assert [(op, step, nbytes) for _, op, step, nbytes, _ in train] == [
            ("exchange", s, 3 * param_bytes) for s in (1, 3, 5)]
        assert {row[4] for row in train} == {tuple(r for r in range(4) if r != rank)}
    assert max_change(expected[0], init) > 1e-3  # training really changed the weights


@pytest.mark.timeout(240)
def test_no_mixing_equals_independent_runs_with_per_worker_inner_steps(tmp_path):
    """alpha = 0: every worker is a single-worker DiLoCo on its own shard, and sends
    nothing; inner_steps [2, 1, 2, 2]: worker 1 trains 1 step a round, idles 1."""
    overrides = [*COMMON, "strategy.mixing=0", "strategy.inner_steps=[2, 1, 2, 2]",
                 "strategy.outer_lr=0.7", "strategy.outer_momentum=0.9"]
    results = run_distributed(train_and_collect, 4, overrides, str(tmp_path), timeout=200)
    expected, init = run_distributed(reference_diloco, 1, overrides, [(0,), (1,), (2,), (3,)],
                                     0.7, 0.9, timeout=120)[0]
    for rank, (params, ledger, _) in enumerate(results):
        assert_same_params(params, expected[rank])
        assert not [row for row in ledger if row[0] in TRAIN_PHASES]
    assert max_change(results[0][0], results[1][0]) > 1e-3  # the workers really differ


def _tokens_per_step(rank, world_size):
    torch.manual_seed(0)
    setup = TrainSetup(model=Regression(), comm=Communicator(rank, world_size, "cpu"),
                       total_steps=4,
                       make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    strategy = GASLoC(GASLoCConfig(inner_steps=[2, 1], topology="random-matching"), setup)
    return [strategy.train_step(regression_batch(rank, step)).tokens for step in range(4)]


@pytest.mark.timeout(60)
def test_idle_steps_report_no_tokens():
    """Worker 1 (H_1 = 1 in rounds of 2) idles every second step: it consumed nothing."""
    tokens = run_distributed(_tokens_per_step, 2, timeout=50)
    batch = regression_batch(0, 0)[1].numel()
    assert tokens == [[batch] * 4, [batch, 0, batch, 0]]


# ------------------------------------------------------------------ mixing and ledger


def _mix_on_rank(rank, world_size, cases):
    comm = Communicator(rank, world_size, "cpu")
    out = []
    for topology, alpha, round_index in cases:
        z = torch.randn(1000, generator=torch.Generator().manual_seed(100 + rank))
        peers = round_peers(topology, world_size, 0, round_index)
        out.append((z, gossip_mix(comm, z, mixing_weights(peers, rank, alpha)), peers))
    return out, [(r.phase, r.op, r.nbytes, r.peers) for r in comm.ledger.records]


def hand_built_mixing_matrix(topology: str, alpha: float, peers: list[list[int]]):
    """W for 4 workers, written from the rule W = I - alpha (I - M) worked out by hand
    per topology (not through mixing_weights): a matched pair weighs its partner alpha/2;
    every worker of a 2-regular graph (ring, random ring) weighs each neighbour alpha/3;
    the complete graph weighs everyone 1/4 at alpha = 1."""
    n = 4
    if topology == "complete":
        assert alpha == 1.0
        return torch.full((n, n), 0.25, dtype=torch.float64)
    neighbour = {"random-matching": alpha / 2, "ring": alpha / 3, "random-2peer": alpha / 3}
    adjacency = torch.zeros(n, n, dtype=torch.float64)
    for i, mine in enumerate(peers):
        adjacency[i, mine] = 1.0
    degree = 1 if topology == "random-matching" else 2
    return (1 - degree * neighbour[topology]) * torch.eye(n, dtype=torch.float64) \
        + neighbour[topology] * adjacency


@pytest.mark.timeout(120)
def test_gossip_round_equals_the_hand_built_mixing_matrix(tmp_path):
    cases = [("random-matching", 1.0, 0), ("random-matching", 1.0, 1),
             ("random-matching", 0.5, 2), ("ring", 1.0, 0), ("ring", 0.4, 1),
             ("random-2peer", 0.7, 3), ("complete", 1.0, 0)]
    results = run_distributed(_mix_on_rank, 4, cases, timeout=100)
    for c, (topology, alpha, _) in enumerate(cases):
        z = torch.stack([res[0][c][0] for res in results])
        mixed = torch.stack([res[0][c][1] for res in results])
        peers = results[0][0][c][2]
        if topology == "ring":
            assert peers == [[1, 3], [0, 2], [1, 3], [0, 2]]
        expected = hand_built_mixing_matrix(topology, alpha, peers) @ z.double()
        torch.testing.assert_close(mixed.double(), expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(mixed.mean(0), z.mean(0), atol=1e-6, rtol=0)
        assert (mixed - z).abs().max() > 1e-2  # it really mixed
        if topology == "random-matching" and alpha == 1.0:
            for a, (b,) in enumerate(peers):  # a pair holds its exact average, bit for bit
                assert torch.equal(mixed[a], mixed[b])
                assert torch.equal(mixed[a] * 2, z[a] + z[b])
        if topology == "complete":
            assert all(torch.equal(mixed[0], m) for m in mixed)
    for rank, (_, ledger) in enumerate(results):  # p2p only, |z| to each peer
        expected = [("train", "exchange", 4000 * len(res[2][rank]), tuple(res[2][rank]))
                    for res in results[rank][0]]
        assert ledger == expected


@pytest.mark.timeout(240)
def test_random_matching_ledger_and_metrics(tmp_path):
    """One random peer per round from the shared seed; during training nothing but the
    exchange; evaluation and consensus traffic are tagged eval/metrics and not counted.
    5 steps in rounds of 2: the last, shorter round closes at the final step."""
    results = run_distributed(train_and_collect, 4, [*COMMON, "strategy.seed=3", "run.steps=5"],
                              str(tmp_path), timeout=200)
    train_bytes = 0
    for rank, (_, ledger, summary) in enumerate(results):
        param_bytes = summary["num_params"] * 4
        train = [row for row in ledger if row[0] in TRAIN_PHASES]
        assert [(phase, op, step, nbytes) for phase, op, step, nbytes, _ in train] == [
            ("gossip", "exchange", s, param_bytes) for s in (1, 3, 4)]
        assert [peers for *_, peers in train] == [
            tuple(round_peers("random-matching", 4, 3, t)[rank]) for t in range(3)]
        assert {(phase, op) for phase, op, *_ in ledger if phase not in TRAIN_PHASES} == {
            ("eval", "all_reduce"), ("eval", "broadcast"), ("metrics", "all_reduce")}
        train_bytes += sum(row[3] for row in train)
    summary = results[0][2]
    assert summary["comm_bytes_total"] == train_bytes == 4 * 3 * param_bytes
    assert "final_val_loss_worker0" in summary
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    consensus = [r["consensus"] for r in rows if "loss" in r]
    assert len(consensus) == 3 and all(0 < c < 1 for c in consensus)
    assert all("val_loss_worker0" in r for r in rows if "val_loss" in r)


# ------------------------------------------------------------------ graphs


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_round_peers_symmetric_and_seeded(n):
    for topology, degree in [("complete", n - 1), ("ring", min(2, n - 1)),
                             ("random-matching", 1), ("random-2peer", min(2, n - 1))]:
        for t in range(5):
            peers = round_peers(topology, n, 0, t)
            for i, mine in enumerate(peers):
                assert i not in mine and all(i in peers[j] for j in mine)
            degrees = sorted(len(p) for p in peers)
            if topology == "random-matching" and n % 2:
                assert degrees == [0] + [1] * (n - 1)  # one worker sits the round out
            else:
                assert degrees == [degree] * n
            for i in range(n):
                row = mixing_weights(peers, i, 1.0)
                assert sum(row.values()) == pytest.approx(1.0)
                assert all(row[j] == mixing_weights(peers, j, 1.0)[i] for j in peers[i])
    rounds = {tuple(map(tuple, round_peers("random-matching", 8, 0, t))) for t in range(10)}
    assert len(rounds) > 5  # the matching changes from round to round
    assert round_peers("random-matching", 8, 0, 0) != round_peers("random-matching", 8, 1, 0)


def test_mixing_weights_by_hand():
    assert mixing_weights([[1], [0]], 0, 1.0) == {1: 0.5, 0: 0.5}
    assert mixing_weights([[1], [0]], 0, 0.5) == {1: 0.25, 0: 0.75}
    assert mixing_weights([[1], [0]], 0, 0.0) == {0: 1.0}
    complete = round_peers("complete", 4, 0, 0)
    assert mixing_weights(complete, 2, 1.0) == {0: 0.25, 1: 0.25, 3: 0.25, 2: 0.25}
    ring = round_peers("ring", 5, 0, 0)
    assert ring[0] == [1, 4]
    assert mixing_weights(ring, 0, 1.0) == pytest.approx({1: 1 / 3, 4: 1 / 3, 0: 1 / 3})


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy.topology=star"], "strategy.topology must be one of ['complete', 'ring', "
                                     "'random-matching', 'random-2peer'], got 'star'"),
        (["strategy.topology=random-2peer", "parallel.world_size=2"],
         "strategy.topology='random-2peer' gives each worker 2 peer(s) but "
         "parallel.world_size=2 leaves 1 other worker(s)"),
        (["parallel.world_size=1"], "strategy.topology='random-matching' gives each worker 1"),
        (["strategy.inner_steps=[10, 10, 5]"],
         "strategy.inner_steps has 3 values but there are 4 workers"),
        (["strategy.inner_steps=[10, 0, 5, 5]"], "strategy.inner_steps must be an integer >= 1"),
        (["strategy.inner_steps=0"], "strategy.inner_steps must be an integer >= 1"),
        (["strategy.inner_steps=ten"], "strategy.inner_steps must be an integer, got 'ten'"),
        (["strategy.mixing=1.5"], "strategy.mixing must be in [0, 1], got 1.5"),
        (["strategy.mixing=-0.1"], "strategy.mixing must be in [0, 1], got -0.1"),
        (["strategy.outer_momentum=1.0"], "strategy.outer_momentum must be in [0, 1), got 1.0"),
        (["strategy.outer_lr=0"], "strategy.outer_lr must be > 0"),
        (["parallel.group_size=2"],
         "runs one worker per rank: parallel.group_size must be 1, got 2"),
        (["parallel.num_stages=2"],
         "strategy gasloc is data parallel only: parallel.num_stages must be 1, got 2"),
        (["strategy.name=gossip", "strategy.outer_lr=1"], "unknown config key 'strategy.outer_lr'"),
    ],
)
def test_bad_input_fails_before_launch(overrides, message):
    assert_bad_config(TINY, overrides, message)


def test_configs_load():
    cfg = load_config(TINY, ["strategy.inner_steps=[10, 10, 5, 5]"])
    assert cfg.strategy.inner_steps == [10, 10, 5, 5]
    hetero = load_config("configs/gasloc-hetero-tiny.yaml")
    assert hetero.network.emulate == "two-sites" and "two-sites" in hetero.network.profiles
    assert load_config("configs/gossip-tiny.yaml").strategy.name == "gossip"


def test_final_model_is_the_workers_average(tmp_path):
    """final.pt holds the average of the workers (GASLoC's eval model, a collective: every
    rank must compute it, or the ranks deadlock while rank 0 writes the file)."""
    overrides = [*COMMON, "checkpoint.final=true", "parallel.timeout_s=30"]
    results = run_distributed(train_and_collect, 4, overrides, str(tmp_path), timeout=120)
    saved = torch.load(RunDir(tmp_path).final_checkpoint, weights_only=False)["model"]
    workers = [params for params, _, _ in results]
    average = {k: sum(w[k] for w in workers) / len(workers) for k in workers[0]}
    assert max(max_change(workers[0], w) for w in workers[1:]) > 1e-6  # the workers differ
    assert_same_params(saved, average, atol=1e-6, rtol=1e-5)
