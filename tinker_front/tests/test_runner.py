"""A model's runner alone: calls run in seq_id order whatever order they
arrive in, an identical resend gets the first future, another body under a
used seq_id is refused, a restarted runner starts from the smallest seq_id
that arrives together, and a gap never filled is skipped after its timeout."""
import asyncio

import pytest

from ampd_tinker.runner import Replay, Runner


async def run_blocking(work):
    work()


async def until(condition, timeout=30.0):
    """Wait for condition() on the event loop, failing after timeout s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def let_the_loop_run():
    """Yield to the runner's task until it has nothing left it could do now."""
    for _ in range(50):
        await asyncio.sleep(0)


def submit_all(runner, ran, seqs, digest="d"):
    return [runner.submit(s, digest + str(s), "future-%s" % s, lambda s=s: ran.append(s))
            for s in seqs]


def test_in_seq_id_order_and_replays():
    async def main():
        runner, ran = Runner(run_blocking), []
        submit_all(runner, ran, [3, 2, 5, 4])
        await let_the_loop_run()
        assert ran == []  # 1 has not come: nothing runs
        submit_all(runner, ran, [1])
        await until(lambda: len(ran) == 5)
        assert ran == [1, 2, 3, 4, 5]
        assert runner.submit(3, "d3", "again", lambda: ran.append("x")) == "future-3"
        with pytest.raises(Replay):
            runner.submit(3, "other", "again", lambda: ran.append("x"))
        with pytest.raises(Replay):
            runner.submit(0, "d0", "old", lambda: None)
        runner.close()
        assert ran == [1, 2, 3, 4, 5]
    asyncio.run(main())


def test_a_restarted_runner_and_a_gap():
    async def main():
        runner, ran = Runner(run_blocking, gap_timeout=0.3, next_seq=None), []
        submit_all(runner, ran, [8, 7, 10])
        await until(lambda: len(ran) >= 2)
        assert ran == [7, 8]  # 9 never comes: 10 waits for the gap's timeout
        await until(lambda: len(ran) >= 3)
        assert ran == [7, 8, 10]
        assert runner.close() == []
    asyncio.run(main())
