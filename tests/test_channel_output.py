"""The daemon's end of a sandbox's control channel: output that waits together."""

from __future__ import annotations

import asyncio
import socket

from branchbox.agent import protocol
from branchbox.runtime.channel import AgentChannel


def test_output_waiting_together_goes_to_the_caller_as_one_event() -> None:
    """200 lines printed one at a time were 200 events, each written to the client (32 us
    of the daemon's CPU a line): what is queued together of one stream now reaches the
    caller as one event, in order, nothing lost, never across the other stream."""
    async def scenario() -> list[dict]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        channel = AgentChannel(ours)
        try:
            rid, queue = channel.open_request("run_code", {})
            for i in range(200):
                protocol.send(theirs, {"rid": rid, "ev": "stdout", "data": f"{i}\n"})
            protocol.send(theirs, {"rid": rid, "ev": "stderr", "data": "between\n"})
            protocol.send(theirs, {"rid": rid, "ev": "stdout", "data": "last\n"})
            protocol.send(theirs, {"rid": rid, "ev": "done", "result": {}})
            return [header async for header, _ in channel.events(rid, queue)]
        finally:
            await channel.close()
            theirs.close()

    events = asyncio.run(scenario())
    kinds = [e["ev"] for e in events]
    assert kinds[-3:] == ["stderr", "stdout", "done"] and set(kinds[:-3]) == {"stdout"}
    assert "".join(e["data"] for e in events[:-3]) == "".join(f"{i}\n" for i in range(200))
    assert events[-3]["data"] == "between\n" and events[-2]["data"] == "last\n"
    assert len(events) - 3 < 200  # merged (each its own event before)


def test_blobs_are_held_only_while_their_request_waits_for_them() -> None:
    """Blobs (long strings sent ahead of their header) are held per request: released
    when their header comes, and when the request is given up (then what still comes is
    counted, not kept, and its header dropped, not put together); the channel goes on."""
    async def scenario() -> tuple[list, int, int, dict]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.setblocking(False)
        channel = AgentChannel(ours)

        async def send(header: dict, payload: bytes = b"") -> None:  # as the agent would
            await asyncio.get_running_loop().sock_sendall(theirs,
                                                          protocol.encode(header, payload))

        try:
            rid, _ = channel.open_request("run_code", {})
            await send({"rid": rid, "ev": "blob"}, b"x" * 300_000)
            await send({"rid": rid, "ev": "blob"}, b"y" * 1000)
            await asyncio.sleep(0.2)
            held = channel._spilled
            channel.close_request(rid)  # given up: what it held goes
            released = channel._spilled
            await send({"rid": rid, "ev": "blob"}, b"z" * 5000)
            await send({"rid": rid, "ev": "done", "result": {"t": None},
                                   "blobs": [[["result", "t"], 301_000]]})
            other, second = channel.open_request("run_code", {})
            await send({"rid": other, "ev": "blob"}, "é".encode() * 200)
            await send({"rid": other, "ev": "done", "result": {"t": None},
                                   "blobs": [[["result", "t"], 400]]})
            answers = [header async for header, _ in channel.events(other, second)]
            return answers, held, released, {"spilled": channel._spilled,
                                             "violation": channel.violation}
        finally:
            await channel.close()
            theirs.close()

    answers, held, released, after = asyncio.run(scenario())
    assert (held, released) == (301_000, 0)
    assert answers == [{"rid": answers[0]["rid"], "ev": "done", "result": {"t": "é" * 200}}]
    assert after == {"spilled": 0, "violation": None}
