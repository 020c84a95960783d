"""One model's calls, one at a time, in the order of their seq_id.

The SDK numbers a training client's calls (seq_id 1, 2, ...) and sends the
chunks of one forward_backward at once, the first chunk last; the model must
see them in seq_id order. A call is queued under its seq_id and runs when
every smaller one has; a seq_id seen before is a replay, answered with the
first call's future when the body is the same (the SDK resent it) and
refused otherwise. A gap that stays open gap_timeout seconds (a call the SDK
never sent) is skipped so that one lost request cannot stall the model. After
a restart of the front the smallest seq_id to arrive within half a second
starts the count.
"""
import asyncio
import collections
import time


class Replay(ValueError):
    """A seq_id already used, with another body."""


class Runner:
    RESTART_GRACE_S = 0.5
    MAX_AHEAD = 1 << 16  # calls queued past the next: the SDK never runs this far ahead
    def __init__(self, run_blocking, gap_timeout=120.0, next_seq=1, remember=1024):
        self._run_blocking = run_blocking  # fn -> awaitable running fn() in a thread
        self._gap_timeout = gap_timeout
        self.next_seq = next_seq  # None: the next arrival's seq_id
        self._queued = {}  # seq_id -> (digest, future, work)
        self._seen = collections.OrderedDict()  # seq_id -> (digest, future), bounded
        self._remember = remember
        self._unnumbered = collections.deque()
        self._wake = asyncio.Event()
        self._task = None
        self.closed = False

    def submit(self, seq_id, digest, future, work):
        """Queue work (a blocking callable) under seq_id; returns the future
        that answers it (an earlier one for an identical replay)."""
        if self.closed:
            raise Replay("the model was unloaded")
        if seq_id is None:  # not numbered: runs when no numbered call is ready
            self._unnumbered.append(work)
            self._start()
            return future
        known = self._queued.get(seq_id) or self._seen.get(seq_id)
        if known is not None:
            if known[0] == digest:
                return known[1]
            raise Replay("seq_id %s was already used by another request" % seq_id)
        if self.next_seq is not None and seq_id < self.next_seq:
            raise Replay("seq_id %s is behind the model's next (%s)" % (seq_id, self.next_seq))
        if self.next_seq is not None and seq_id >= self.next_seq + self.MAX_AHEAD:
            raise Replay("seq_id %s is more than %d ahead of the model's next (%s)"
                         % (seq_id, self.MAX_AHEAD, self.next_seq))
        self._queued[seq_id] = (digest, future, work)
        self._start()
        return future

    def _start(self):
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def queued(self):
        return len(self._queued) + len(self._unnumbered)

    async def _loop(self):
        waiting_since = None
        while not self.closed:
            if self.next_seq is None and self._queued:
                # After a restart: the chunks of one call arrive together,
                # the first last; start from the smallest after a moment.
                await asyncio.sleep(self.RESTART_GRACE_S)
                self.next_seq = min(self._queued)
            if self.next_seq in self._queued:
                seq_id = self.next_seq
                digest, future, work = self._queued.pop(seq_id)
                self._seen[seq_id] = (digest, future)
                while len(self._seen) > self._remember:
                    self._seen.popitem(last=False)
                self.next_seq = seq_id + 1
                await self._run_blocking(work)
                waiting_since = None
                continue
            if self._unnumbered:
                await self._run_blocking(self._unnumbered.popleft())
                continue
            if self._queued:
                waiting_since = waiting_since or time.monotonic()
                if time.monotonic() - waiting_since > self._gap_timeout:
                    self.next_seq = min(self._queued)  # skip a call never sent
                    waiting_since = None
                    continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0 if self._queued else None)
            except asyncio.TimeoutError:
                pass

    def close(self):
        """Stop; returns the futures of the calls that will never run."""
        self.closed = True
        self._wake.set()
        dropped = [future for _, future, _ in self._queued.values()]
        self._queued.clear()
        self._unnumbered.clear()
        return dropped
