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
