"""The in-process app behind a blocking httpx transport, for tests that check raw REST
answers (status and JSON body) without a served daemon."""

from __future__ import annotations

import httpx

from branchbox.sdk._portal import portal


def blocking_transport(harness) -> httpx.BaseTransport:
    """Each request runs on the portal loop, where the harness's engine lives."""

    class Portal(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            async def send() -> httpx.Response:
                async with httpx.AsyncClient(transport=harness.transport(),
                                             base_url="http://t") as client:
                    reply = await client.send(request)
                    await reply.aread()
                    return reply

            reply = portal.run(send())
            return httpx.Response(reply.status_code, headers=reply.headers,
                                  content=reply.content)

    return Portal()
