"""A long prompt is tokenized on a thread while the server's event loop goes on: the daemons
serve peers' attend requests, heartbeats and the watchdog on that loop meanwhile."""

from __future__ import annotations

import asyncio
import time

from infinite_llm.engine.loader import Checkpoint

TICK_S = 0.01


def test_the_event_loop_runs_while_a_long_prompt_is_tokenized_on_a_thread(smollm2: Checkpoint):
    text = "word " * 200_000  # 1 MB: about 200,000 tokens
    expected_len = len(smollm2.tokenizer.encode("word " * 1000)) - 1000  # the BOS, where there is one

    async def scenario() -> tuple[int, float, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(TICK_S)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(3 * TICK_S)
        before, started = ticks, time.monotonic()
        ids = await asyncio.to_thread(smollm2.tokenizer.encode, text)
        took = time.monotonic() - started
        task.cancel()
        return ticks - before, took, len(ids)

    ticks, took, num_ids = asyncio.run(scenario())
    assert num_ids == 200_000 + expected_len
    # A tokenizer that held the GIL let the loop tick a handful of times whatever the length
    # (6 ticks over 1.9 s for 3 MB); one that lets go ticks throughout. A tenth of the ticks
    # the time allows leaves room for a loaded machine.
    assert ticks >= took / TICK_S / 10, (ticks, took)
