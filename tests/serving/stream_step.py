"""Reading a StreamStep's answers as a gateway does: speech sent ahead of the tick, then the tick's own answer."""

from __future__ import annotations

import grpc

from metronome.serving.proto import worker_pb2 as pb


async def answers(call) -> tuple[list[pb.StepResponse], pb.StepResponse]:
    """(the speech-only answers, in order; the tick's own answer, which comes last)."""
    ahead = []
    while (response := await call.read()) is not grpc.aio.EOF:
        if not response.speech_only:
            return ahead, response
        ahead.append(response)
    raise AssertionError("the StreamStep ended without the tick's answer")


async def tick_answer(call) -> pb.StepResponse:
    return (await answers(call))[1]
