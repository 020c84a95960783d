"""The futures every Tinker call returns at once, and retrieve_future's answers.

Bounded: at most max_pending unfinished (past it a call is refused with 429,
which the SDK retries) and max_done finished, the oldest finished evicted
first; an evicted or unknown id is answered 410, on which the SDK sends its
request again. Durable where it matters: a finished optim_step (and
save_state) is appended to a journal in the state directory before its
result is served, and loaded again at start, so a restart of the front
loses no acknowledged update.
"""
import collections
import json
import os
import threading
import time
import uuid

PENDING, DONE, FAILED = "pending", "done", "failed"


class Future:
    __slots__ = ("request_id", "owner", "kind", "state", "result", "error", "category", "created")

    def __init__(self, request_id, owner, kind):
        self.request_id = request_id
        self.owner = owner
        self.kind = kind  # "json", "forward_backward" or "sample"
        self.state = PENDING
        self.result = None  # JSON dict, or (protobuf bytes, JSON dict)
        self.error = None
        self.category = None
        self.created = time.time()


class Full(Exception):
    """Too many unfinished futures."""


class FutureStore:
    def __init__(self, state_dir, max_pending=4096, max_done=16384):
        self._lock = threading.Lock()
        self._futures = collections.OrderedDict()  # request_id -> Future, oldest first
        self._pending = 0
        self.max_pending = max_pending
        self.max_done = max_done
        self.evicted = 0
        self._journal_path = os.path.join(state_dir, "futures.jsonl") if state_dir else None
        self._journal_lock = threading.Lock()  # one writer at a time
        self._journalled = collections.deque(maxlen=max_done)  # the entries worth keeping
        self._journal_lines = 0
        if self._journal_path and os.path.exists(self._journal_path):
            self._load_journal()
        self._journal = open(self._journal_path, "a", encoding="utf-8") if self._journal_path else None

    def _load_journal(self):
        with open(self._journal_path, encoding="utf-8") as f:
            for line in f:
                try:
                    self._journalled.append(json.loads(line))
                except ValueError:
                    break  # a torn last line: what follows never reached the disk
        for entry in self._journalled:
            future = Future(entry["request_id"], entry["owner"], "json")
            future.state, future.result = DONE, entry["result"]
            self._futures[future.request_id] = future
        self._rewrite_journal()

    def _rewrite_journal(self):
        """The journal as the entries kept (at most max_done): it stays bounded."""
        tmp = self._journal_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for entry in self._journalled:
                f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._journal_path)
        self._journal_lines = len(self._journalled)

    def create(self, owner, kind="json"):
        with self._lock:
            if self._pending >= self.max_pending:
                raise Full("%d requests unfinished; retry later" % self._pending)
            future = Future(uuid.uuid4().hex, owner, kind)
            self._futures[future.request_id] = future
            self._pending += 1
            return future

    def finish(self, future, result, durable=False):
        """The result; durable: journalled (fsync) before anyone can read it."""
        if durable and self._journal is not None:
            entry = {"request_id": future.request_id, "owner": future.owner, "result": result}
            with self._journal_lock:
                self._journal.write(json.dumps(entry) + "\n")
                self._journal.flush()
                os.fsync(self._journal.fileno())
                self._journalled.append(entry)
                self._journal_lines += 1
                if self._journal_lines > 2 * self.max_done:
                    self._journal.close()
                    self._rewrite_journal()
                    self._journal = open(self._journal_path, "a", encoding="utf-8")
        with self._lock:
            future.result, future.state = result, DONE
            self._settle()

    def fail(self, future, message, category="user"):
        with self._lock:
            future.error, future.category, future.state = message, category, FAILED
            self._settle()

    def _settle(self):
        self._pending -= 1
        done = len(self._futures) - self._pending
        while done > self.max_done:
            for request_id, f in self._futures.items():
                if f.state != PENDING:
                    del self._futures[request_id]
                    self.evicted += 1
                    break
            done -= 1

    def get(self, request_id, owner):
        """The future, or None when unknown, evicted or another key's."""
        with self._lock:
            future = self._futures.get(request_id)
            if future is None or future.owner != owner:
                return None
            return future

    def counts(self):
        with self._lock:
            return self._pending, len(self._futures) - self._pending
