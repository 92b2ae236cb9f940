"""The parser-session cache: LRU, TTL and token bounds, and take-once semantics."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest

from serve_app.derender.sessions import SessionCache, prompt_key, state_digest


def test_take_removes_so_a_duplicated_chunk_misses():
    cache: SessionCache[str] = SessionCache(max_sessions=4, ttl_s=60, max_tokens=1000)
    cache.put(b"k", "session", tokens=10)
    assert cache.take(b"k") == "session"
    assert cache.take(b"k") is None
    assert len(cache) == 0 and cache.tokens == 0


def test_least_recently_used_is_evicted_beyond_max_sessions():
    cache: SessionCache[int] = SessionCache(max_sessions=2, ttl_s=60, max_tokens=1000)
    cache.put(b"a", 1, tokens=1)
    cache.put(b"b", 2, tokens=1)
    cache.put(b"a", cache.take(b"a"), tokens=1)  # a stream's next chunk refreshes its session
    cache.put(b"c", 3, tokens=1)
    assert cache.take(b"b") is None
    assert cache.take(b"a") == 1 and cache.take(b"c") == 3
    assert cache.stats.evictions == 1


def test_token_budget_bounds_memory():
    cache: SessionCache[int] = SessionCache(max_sessions=100, ttl_s=60, max_tokens=100)
    for i in range(10):
        cache.put(bytes([i]), i, tokens=30)
    assert cache.tokens <= 100 and len(cache) == 3
    cache.put(b"huge", 99, tokens=101)  # larger than the whole budget: never cached
    assert cache.take(b"huge") is None and cache.tokens <= 100


def test_expired_sessions_are_not_returned(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    cache: SessionCache[int] = SessionCache(max_sessions=10, ttl_s=5, max_tokens=100)
    cache.put(b"old", 1, tokens=1)
    now[0] += 6
    assert cache.take(b"old") is None
    assert cache.stats.expirations == 1
    cache.put(b"x", 2, tokens=1)
    cache.put(b"y", 3, tokens=1)
    now[0] += 6
    cache.put(b"z", 4, tokens=1)  # putting sweeps what expired meanwhile
    assert len(cache) == 1 and cache.tokens == 1


def test_get_leaves_the_entry_and_makes_it_most_recently_used(monkeypatch):
    """The request cache reads with ``get``: many streams share one entry, so reading keeps it,
    refreshes its place in the LRU order and its clock; an expired one is gone."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    cache: SessionCache[int] = SessionCache(max_sessions=2, ttl_s=5, max_tokens=100)
    cache.put(b"a", 1, tokens=10)
    cache.put(b"b", 2, tokens=10)
    now[0] += 4
    assert cache.get(b"a") == 1 and cache.get(b"a") == 1 and len(cache) == 2
    cache.put(b"c", 3, tokens=10)  # evicts b, the least recently used
    assert cache.values() == [1, 3] and cache.tokens == 20
    now[0] += 4  # a was read 4 s ago: still fresh
    assert cache.get(b"a") == 1
    now[0] += 6
    assert cache.get(b"a") is None and cache.stats.expirations == 1 and cache.tokens == 10


def test_peek_changes_nothing(monkeypatch):
    """The parser service looks a session up with ``peek`` before it knows the chunk is the session's
    (serve_app/derender/parser_service.py ``_open_hit``): order, clock, counts and an expired entry
    stay for ``take`` to deal with."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    cache: SessionCache[int] = SessionCache(max_sessions=2, ttl_s=5, max_tokens=100)
    cache.put(b"a", 1, tokens=10)
    cache.put(b"b", 2, tokens=10)
    assert cache.peek(b"a") == 1 and cache.peek(b"missing") is None
    cache.put(b"c", 3, tokens=10)  # a was only peeked at: still the least recently used, evicted
    assert cache.values() == [2, 3]
    now[0] += 6
    assert cache.peek(b"b") is None and len(cache) == 2 and cache.stats.expirations == 0
    assert cache.take(b"b") is None and cache.stats.expirations == 1


def test_zero_sessions_turns_the_cache_off():
    cache: SessionCache[int] = SessionCache(max_sessions=0, ttl_s=5, max_tokens=100)
    cache.put(b"k", 1, tokens=1)
    assert cache.take(b"k") is None


BASE = (b"cfg", prompt_key([1, 2]), [3, 4], [2], (True,))


@pytest.mark.parametrize(
    "other",
    [
        (b"cfg2", prompt_key([1, 2]), [3, 4], [2], (True,)),  # another request configuration
        (b"cfg", prompt_key([1, 2, 0]), [3, 4], [2], (True,)),  # another prompt
        (b"cfg", prompt_key([2, 1]), [3, 4], [2], (True,)),  # the same ids in another order
        (b"cfg", prompt_key([1, 2]), [3, 5], [2], (True,)),  # another output
        (b"cfg", prompt_key([1, 2]), [3, 4], [1, 1], (True,)),  # same output, other chunk boundaries
        (b"cfg", prompt_key([1, 2]), [3, 4], [2], (False,)),  # another flag
        (b"cfg", prompt_key([1]), [2, 3, 4], [3], (True,)),  # same ids, moved between prompt and output
    ],
)
def test_digest_covers_every_part_of_the_state(other):
    assert state_digest(*BASE) == state_digest(*BASE)
    assert state_digest(*other) != state_digest(*BASE)


def race_in_two_threads(target: Callable[[int], None]) -> None:
    """``target(0)`` and ``target(1)`` in two threads at once, CPython switching between them as
    often as it can (races show up quickly); returns when both are done."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=target, args=(n,)) for n in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)


def test_the_loop_and_the_worker_thread_can_share_the_cache():
    """ParserDerenderService takes and files sessions from the event loop (hits) and from its worker
    thread (long replays) at once: the token count and the bounds stay exact."""
    cache: SessionCache[int] = SessionCache(max_sessions=50, ttl_s=60, max_tokens=400)

    def churn(offset: int) -> None:
        for i in range(20_000):
            key = bytes([offset, i % 97])
            if cache.take(key) is None:
                cache.put(key, i, tokens=1 + i % 13)
            if i % 5 == 0:
                cache.put(bytes([2, i % 7]), i, tokens=3)  # keys both threads use

    race_in_two_threads(churn)
    held = [cache._entries[k][1] for k in cache._entries]
    assert cache.tokens == sum(held) <= 400 and len(held) <= 50
