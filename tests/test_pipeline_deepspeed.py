"""DeepSpeed's pipeline engine's ledger and traffic description, without a run
(algorithms/pipeline_deepspeed.py; the runs: tests/test_whatif.py -m slow -k deepspeed)."""

import pytest

from algorithms.pipeline_deepspeed import deepspeed_pipe_traffic, match_logged

OPS = [("all_reduce", 100, (0, 1), "tied"), ("all_reduce", 4, (0, 2), "clip"),
       ("broadcast", 8, (0, 1), "loss"), ("all_reduce", 4, (0, 1), "clip")]


def test_each_tapped_op_gets_the_logged_seconds_of_its_own_call():
    """The logger lists a name's calls in call order (per_op_seconds): the k-th logged
    all_reduce is the k-th tapped one, whatever their sizes."""
    logged = [("all_reduce", 100, 0.1), ("all_reduce", 4, 0.2), ("all_reduce", 4, 0.3),
              ("broadcast", 8, 0.4)]
    assert match_logged(OPS, logged) == [0.1, 0.2, 0.4, 0.3]


@pytest.mark.parametrize("logged", [
    [("all_reduce", 100, 0.1), ("all_reduce", 4, 0.2), ("broadcast", 8, 0.4)],  # one short
    [("all_reduce", 100, 0.1), ("all_reduce", 4, 0.2), ("all_reduce", 4, 0.3),
     ("broadcast", 8, 0.4), ("all_gather_into_tensor", 64, 0.5)],  # an op not tapped
])
def test_a_logged_op_the_tap_missed_stops_the_run(logged):
    with pytest.raises(RuntimeError, match="cannot give groups to"):
        match_logged(OPS, logged)


def test_stage_gradients_go_in_buckets_closed_once_past_5e8_elements():
    """8 blocks of 2e8 elements on 2 stages (4 each): DeepSpeed's allreduce_no_retain
    closes a bucket once it is past 5e8, so each stage sends 6e8 then 2e8 elements; the
    clipping norm and the loss go over the replica's pipe and the stage's replicas."""
    from bench.config import load_config
    from bench.study.whatif.engine import synthetic_facts

    cfg = load_config("configs/deepspeed-pp-tiny.yaml", ["run.steps=3"])  # 2 x 2 ranks
    traffic = deepspeed_pipe_traffic(cfg, synthetic_facts(8 * 200_000_000, 8))
    last = {(t.phase, t.op): t for t in traffic.transfers(3, 1)}
    assert last["dp", "all_reduce"].sizes == (600_000_000 * 4, 200_000_000 * 4)
    assert last["dp", "all_reduce"].group == (1, 3)
    assert ("tied", "all_reduce") not in last  # the synthetic model is untied
    assert last["loss", "all_reduce"].group == (1, 3)
    assert last["loss", "broadcast"].group == (2, 3)
    assert [t.group for t in traffic.transfers(3, 1) if t.phase == "clip"] == [(2, 3), (1, 3)]
    sends = [t for t in traffic.transfers(2, 0) if t.op == "send"]
    assert [t.sizes for t in sends][:2] == [(1024,), (0,)]  # synthetic: no boundary size
    assert len(sends) == 1 + 4 and len([t for t in traffic.transfers(2, 1)
                                        if t.op == "send"]) == 4  # the metadata once

