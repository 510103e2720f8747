"""`--scheduling-policy priority` behind the API: the request field `priority` (vLLM's; lower runs
first) orders the queue of a real server, asked through the official openai client."""
from __future__ import annotations

import asyncio
import time

from tests.server.server_process import server_fixture

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

server = server_fixture("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--max-num-seqs", "1",
                        "--scheduling-policy", "priority")


async def _until_waiting(server, n: int) -> None:
    deadline = time.monotonic() + 30
    while (await asyncio.to_thread(server.metrics))["vllm:num_requests_waiting"] != n:
        assert time.monotonic() < deadline, f"never {n} waiting"
        await asyncio.sleep(0.05)


def test_the_urgent_request_overtakes_the_queue(server):
    """One sequence at a time: while a long request streams, a background request (priority 5) and
    then an urgent one (-1) queue up; once the long one is dropped, the urgent one is served first,
    though it came later."""
    client = server.client(asynchronous=True)
    finished: list[str] = []

    async def ask(name: str, priority: int) -> None:
        r = await client.completions.create(model=MODEL, prompt=f"Tell me about {name}.", max_tokens=4,
                                            temperature=0, extra_body={"priority": priority, "ignore_eos": True})
        assert r.usage.completion_tokens == 4
        finished.append(name)

    async def main() -> None:
        long = await client.completions.create(model=MODEL, prompt="Count to a thousand.", max_tokens=400,
                                               stream=True, extra_body={"ignore_eos": True})
        await long.__anext__()   # running, and holding the one sequence
        background = asyncio.create_task(ask("background", 5))
        await _until_waiting(server, 1)
        urgent = asyncio.create_task(ask("urgent", -1))
        await _until_waiting(server, 2)
        await long.close()   # aborts it: the queue moves
        await asyncio.gather(background, urgent)

    asyncio.run(main())
    assert finished == ["urgent", "background"]
    assert server.wait_idle()["vllm:num_preemptions_total"] == 0
    france = [{"role": "user", "content": "What is the capital of France?"}]
    chat = server.client().chat.completions.create(model=MODEL, messages=france, max_tokens=8, temperature=0,
                                                   extra_body={"priority": 3})
    assert "Paris" in chat.choices[0].message.content
