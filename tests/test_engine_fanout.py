"""The engine process's side of several API servers (core/engine_fanout.py), over real pipes and
no model: requests renamed per server so that two servers may use one id, outputs routed back
to the server that sent them under its own id, statistics published once, and a server that
leaves has its requests aborted. Also the shared admission count (core/shared_count.py)."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

import msgspec

from core.engine_fanout import Fanout
from core.engine_messages import (
    AbortRequest,
    AddRequest,
    EngineReady,
    EngineReply,
    SetHold,
    Shutdown,
    StepOutputs,
)
from core.request import EngineRequest, RequestOutput
from core.sampling import SamplingParams
from core.shared_count import SharedCounts
from core.stats import FinishedStats, StepStats

encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(EngineReply).decode


def pair():
    """(the engine's command and reply ends, the other side's command and reply ends)."""
    cmd_r, cmd_w = os.pipe()
    rep_r, rep_w = os.pipe()
    engine = (Connection(cmd_r, writable=False), Connection(rep_w, readable=False))
    other = (Connection(cmd_w, readable=False), Connection(rep_r, writable=False))
    return engine, other


def request(rid: str, leader: str | None = None) -> AddRequest:
    return AddRequest(EngineRequest(rid, [1, 2, 3], SamplingParams(), leader_id=leader))


def setup(n: int = 2):
    control, supervisor = pair()
    links = [pair() for _ in range(n)]
    fanout = Fanout(control, [engine for engine, _ in links])
    return fanout, supervisor, [other for _, other in links]


def drain(fanout: Fanout) -> list:
    got = []
    while (cmd := fanout.take(False)) is not None:
        got.append(cmd)
    return got


def test_two_servers_may_use_one_id_and_each_gets_its_own_outputs():
    fanout, _, servers = setup()
    servers[0][0].send_bytes(encode(request("x")))
    servers[1][0].send_bytes(encode(request("x")))
    servers[1][0].send_bytes(encode(request("x-1", leader="x")))
    cmds = drain(fanout)
    ids = sorted(c.request.request_id for c in cmds)
    assert ids == ["0:x", "1:x", "1:x-1"]
    assert [c.request.leader_id for c in cmds if c.request.request_id == "1:x-1"] == ["1:x"]

    stats = StepStats(
        num_running=3,
        num_waiting=1,
        num_adds_seen=3,
        generation_tokens=3,
        ttft=[0.1, 0.2, 0.3],
        finished=[FinishedStats("stop", 1, 0, 0, 0, 3, 1)],
    )
    outs = [
        RequestOutput("0:x", new_text="a"),
        RequestOutput("1:x", new_text="b", finished=True, finish_reason="stop"),
        RequestOutput("1:x-1", new_text="c"),
    ]
    assert fanout.publish(outs, stats)
    first = decode(servers[0][1].recv_bytes())
    second = decode(servers[1][1].recv_bytes())
    assert [(o.request_id, o.new_text) for o in first.outputs] == [("x", "a")]
    assert [(o.request_id, o.new_text) for o in second.outputs] == [("x", "b"), ("x-1", "c")]
    # API server 0 publishes the engine's statistics; the other gets the gauges alone.
    assert first.stats == stats
    assert second.stats.num_running == 3 and second.stats.num_adds_seen == 3
    assert second.stats.generation_tokens == 0 and second.stats.finished == []
    assert second.stats.ttft == []
    # A finished request is forgotten: a late abort of it reaches nothing.
    servers[1][0].send_bytes(encode(AbortRequest("x")))
    servers[0][0].send_bytes(encode(AbortRequest("x")))
    assert [c.request_id for c in drain(fanout)] == ["0:x"]


def test_a_server_with_nothing_this_step_still_hears_of_it():
    fanout, _, servers = setup()
    fanout.publish([], StepStats(num_waiting=5))
    for _, replies in servers:
        step = decode(replies.recv_bytes())
        assert isinstance(step, StepOutputs) and step.outputs == []
        assert step.stats.num_waiting == 5


def test_a_server_that_leaves_has_its_requests_aborted_and_hears_no_more():
    fanout, _, servers = setup()
    servers[0][0].send_bytes(encode(request("a")))
    servers[1][0].send_bytes(encode(request("b")))
    servers[1][0].send_bytes(encode(request("c")))
    assert len(drain(fanout)) == 3
    servers[1][0].close()  # it exited: end of file on its command pipe
    cmds = drain(fanout)
    assert sorted(c.request_id for c in cmds if isinstance(c, AbortRequest)) == ["1:b", "1:c"]
    assert fanout.open == {0}
    # Its outputs are dropped; the other server is served as before.
    fanout.publish([RequestOutput("0:a", new_text="z"), RequestOutput("1:b")], StepStats())
    assert [o.request_id for o in decode(servers[0][1].recv_bytes()).outputs] == ["a"]


def test_hold_passes_and_only_the_supervisor_stops_the_engine():
    fanout, supervisor, servers = setup()
    servers[0][0].send_bytes(encode(SetHold(None)))
    servers[1][0].send_bytes(encode(Shutdown()))  # an API server leaves; the engine stays
    cmds = drain(fanout)
    assert [type(c) for c in cmds] == [SetHold]
    assert fanout.open == {0}
    supervisor[0].send_bytes(encode(Shutdown()))
    assert isinstance(fanout.take(True), Shutdown)
    supervisor[0].close()  # the supervisor gone: the same
    assert isinstance(fanout.take(True), Shutdown)


def test_ready_reaches_the_supervisor_and_every_server():
    fanout, supervisor, servers = setup(3)
    fanout.send_all(EngineReady("m", ["m"], 64, 100, 10, {}))
    for replies in [supervisor[1]] + [r for _, r in servers]:
        assert isinstance(decode(replies.recv_bytes()), EngineReady)


def test_refused_add_goes_back_to_its_server_under_its_id():
    fanout, _, servers = setup()
    servers[1][0].send_bytes(encode(request("q")))
    (cmd,) = drain(fanout)
    fanout.refuse(RequestOutput(cmd.request.request_id, finished=True, error="no"))
    step = decode(servers[1][1].recv_bytes())
    assert step.outputs[0].request_id == "q" and step.outputs[0].error == "no"


def test_shared_counts_sum_every_slot(tmp_path):
    path = str(tmp_path / "adds")
    SharedCounts.create(path, 3)
    a, b = SharedCounts(path, 3, 0), SharedCounts(path, 3, 2)
    a.add()
    b.add(4)
    assert a.total() == b.total() == 5
