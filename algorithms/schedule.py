"""The 1F1B schedule of our pipeline executor (algorithms/pipedream.py) and its p2p plan.

Tested exhaustively by `pytest tests/test_gpu_path.py -k p2p` (every stage count and
microbatch count up to 8 x 12, both delays). Pure Python: no tensors, no process group.

`actions` is what stage s does in step k: ("F", j) forward and ("B", j) backward of
microbatch j (docs/algorithms.md, Pipelines; algorithms/pipedream.py's docstring).

`p2p_plan` says which messages go in a batched exchange. On NCCL a message must be sent
and received with the same kind of op: a batched isend/irecv (`Communicator.exchange`)
runs on the group's communicator, a plain send/recv on a two-rank one, so a message sent
batched and received plain never meets its receive (a hang). And two neighbours that
each send to the other before receiving from it must batch both messages, or both block
in their sends. So a send is held and batched with the receive that follows it on the
same stage from the same peer ("a crossing") only when the peer has the mirror crossing
(it sends exactly that received message, then receives exactly this one); every other
message is sent and received plain. With `delay: 1` the sequence runs on across steps:
the gradient of a step's last backward is held and batched with the next step's first
activation receive.
"""

from __future__ import annotations

from itertools import pairwise

Message = tuple[str, int, int]
"""("A" activation | "G" gradient, stage boundary b (between stages b and b + 1), microbatch)."""
Event = tuple[str, int, Message]
"""("send" | "recv", peer stage, message)."""


def actions(stage: int, num_stages: int, num_microbatches: int, step: int,
            delay: int) -> list[tuple[str, int]]:
    """Step `step`'s ("F"|"B", microbatch) sequence on `stage` (negative steps: none)."""
    if step < 0:
        return []
    M, warm = num_microbatches, num_stages - 1 - stage
    if delay:
        out = []
        for j in range(step * M, (step + 1) * M):
            out.append(("F", j))
            if j - warm >= 0:
                out.append(("B", j - warm))
        return out
    warm = min(warm, M)
    out = [("F", step * M + i) for i in range(warm)]
    for i in range(M - warm):
        out += [("F", step * M + warm + i), ("B", step * M + i)]
    return out + [("B", step * M + i) for i in range(M - warm, M)]


def events(stage: int, num_stages: int, steps: list[tuple[str, int]]) -> list[Event]:
    """The stage's point-to-point events, in order, for a sequence of actions."""
    out: list[Event] = []
    first, last = stage == 0, stage == num_stages - 1
    for kind, j in steps:
        if kind == "F":
            if not first:
                out.append(("recv", stage - 1, ("A", stage - 1, j)))
            if not last:
                out.append(("send", stage + 1, ("A", stage, j)))
        else:
            if not last:
                out.append(("recv", stage + 1, ("G", stage, j)))
            if not first:
                out.append(("send", stage - 1, ("G", stage - 1, j)))
    return out


def crossings(sequence: list[Event]) -> dict[Message, Message]:
    """Sent message -> the message received right after it from the same peer."""
    return {sent: received
            for (op, peer, sent), (next_op, next_peer, received) in pairwise(sequence)
            if op == "send" and next_op == "recv" and peer == next_peer}


def p2p_plan(stage: int, num_stages: int, num_microbatches: int, step: int,
             delay: int) -> tuple[set[Message], set[Message]]:
    """(messages this stage sends in `step` that are held for an exchange, messages it
    receives in `step` in an exchange) (module docstring). A held send's exchange is this
    step's or, with `delay: 1`, the next step's first receive."""
    S, M = num_stages, num_microbatches
    window = (step - 1, step, step + 1) if delay else (step,)

    def local(s: int) -> dict[Message, Message]:
        return crossings(events(s, S, [a for k in window for a in actions(s, S, M, k, delay)]))

    near = {s: local(s) for s in (stage - 1, stage, stage + 1) if 0 <= s < S}
    pairs = {}  # this stage's mutual crossings: sent -> received
    for sent, received in near[stage].items():
        peer = stage + 1 if sent[0] == "A" else stage - 1
        if near[peer].get(received) == sent:
            pairs[sent] = received
    mine = events(stage, S, actions(stage, S, M, step, delay))
    sent_now = {m for op, _, m in mine if op == "send"}
    received_now = {m for op, _, m in mine if op == "recv"}
    return ({m for m in pairs if m in sent_now},
            {r for m, r in pairs.items() if r in received_now})
