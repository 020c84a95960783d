"""The futures store alone: bounded (429 past max_pending unfinished, the
oldest finished evicted past max_done), owned (another key's id is unknown),
and durable where asked: journalled results survive a new store on the same
directory, a torn last line is ignored, and the journal stays bounded."""
import os

import pytest

from ampd_tinker import futures as F


def test_bounded_and_owned(tmp_path):
    store = F.FutureStore(str(tmp_path), max_pending=3, max_done=2)
    pending = [store.create("a") for _ in range(3)]
    with pytest.raises(F.Full):
        store.create("a")
    for i, f in enumerate(pending):
        store.finish(f, {"i": i})
    assert store.get(pending[0].request_id, "a") is None  # evicted: the oldest finished
    assert store.get(pending[2].request_id, "a").result == {"i": 2}
    assert store.get(pending[2].request_id, "b") is None  # another key's
    assert store.counts() == (0, 2) and store.evicted == 1
    failed = store.create("a")
    store.fail(failed, "no", "user")
    assert store.get(failed.request_id, "a").state == F.FAILED


def test_durable_results_survive_and_the_journal_stays_bounded(tmp_path):
    store = F.FutureStore(str(tmp_path), max_pending=8, max_done=4)
    ids = []
    for i in range(25):
        f = store.create("a")
        store.finish(f, {"i": i}, durable=True)
        ids.append(f.request_id)
    volatile = store.create("a")
    store.finish(volatile, {"v": 1})
    journal = os.path.join(str(tmp_path), "futures.jsonl")
    assert len(open(journal).read().splitlines()) <= 2 * 4
    with open(journal, "a") as f:
        f.write('{"request_id": "torn", "ow')  # a write the crash cut short
    again = F.FutureStore(str(tmp_path), max_pending=8, max_done=4)
    assert [again.get(i, "a").result["i"] for i in ids[-4:]] == [21, 22, 23, 24]
    assert again.get(ids[0], "a") is None and again.get(volatile.request_id, "a") is None
    assert again.get("torn", "a") is None
