"""PlanCache against a real Redis, a closed port, and no Redis at all."""

from __future__ import annotations

import hashlib
import json
import time

import redis

from remat.client.plan_key import MAX_INPUTS_CHARS, PlanKey
from remat.service.cache import NAME_TEXT_CHARS, PlanCache
from remat.service.config import ServiceSettings
from tests.service.factories import REDIS_URL, closed_port_url

KEY = PlanKey(model_hash="arch-1", input_shape=(8, 3, 32, 32), dtype="float32", device="cpu")


def _cache(redis_url: str | None, prefix: str = "remat-test-unused:", **overrides: object) -> PlanCache:
    return PlanCache(ServiceSettings(database_url="sqlite://", redis_url=redis_url, cache_prefix=prefix,
                                     **overrides))


def test_miss_set_hit_invalidate(redis_prefix: str, redis_client: redis.Redis) -> None:
    cache = _cache(REDIS_URL, redis_prefix, cache_ttl_s=60)
    name = cache.key_name(KEY, "linear", None)
    assert cache.get(name) is None
    cache.set(name, b'{"plan": 1}')
    assert cache.get(name) == b'{"plan": 1}'
    assert json.loads(redis_client.get(name)) == {"plan": 1}  # JSON on the wire, never pickle
    assert 0 < redis_client.ttl(name) <= 60
    any_torch = cache.key_name(PlanKey(**{**KEY.to_dict(), "torch_version": "unknown"}), "linear", None)
    cache.set(any_torch, b'{"plan": 1}')
    cache.delete_plans(KEY, [("linear", None), ("cubic", 1024)])
    assert cache.get(name) is None
    assert cache.get(any_torch) is None  # a read for any torch version may now be answered by another plan
    assert cache.ping() is None
    cache.close()


def test_key_names_separate_every_component() -> None:
    cache = _cache(None)
    names = {cache.key_name(KEY, "linear", None), cache.key_name(KEY, "cubic", None),
             cache.key_name(KEY, "linear", 1024),
             cache.key_name(PlanKey(**{**KEY.to_dict(), "mode": "eval"}), "linear", None),
             cache.key_name(PlanKey(**{**KEY.to_dict(), "grads": "kept"}), "linear", None),
             cache.key_name(PlanKey(**{**KEY.to_dict(), "input_shape": [8, 3, 32]}), "linear", None),
             cache.key_name(PlanKey(**{**KEY.to_dict(), "torch_version": "unknown"}), "linear", None),
             cache.key_name(PlanKey(**{**KEY.to_dict(), "inputs": "x: float32[8, 3, 32, 32]"}), "linear", None)}
    assert len(names) == 8
    assert cache.key_name(KEY, "linear", None) == cache.key_name(KEY, "linear", 0)


def test_key_names_follow_every_field_of_the_plan_key() -> None:
    """key_name is built from the key's fields: a new field separates names with no change to the cache."""
    cache = _cache(None)
    parts = json.loads(cache.key_name(KEY, "linear", 1024).removeprefix(cache.prefix))
    assert parts == [*KEY.to_dict().values(), "linear", 1024]


def test_a_long_call_signature_is_named_by_its_digest_and_names_stay_distinct() -> None:
    """A call's signature (up to 2000 characters of ``;``, ``:``, ``[``, ``,``, quotes, backslashes…) is one
    JSON string in the name, or its digest when long: never able to pass for another field or another key."""
    cache = _cache(None)
    long_inputs = "; ".join(f"input_{i}: int64[2, 256]" for i in range(60))
    assert len(long_inputs) > NAME_TEXT_CHARS
    variants = [long_inputs, long_inputs + " ", long_inputs[:-1],
                "a: int64[2]; b=\"x\",\"float32\"", "a: int64[2]; b=\\", "a: int64[2]",
                "sha256:" + hashlib.sha256(long_inputs.encode()).hexdigest()[:NAME_TEXT_CHARS - 7], ""]
    names = {cache.key_name(PlanKey(**{**KEY.to_dict(), "inputs": v}), "linear", None) for v in variants}
    assert len(names) == len(variants)
    name = cache.key_name(PlanKey(**{**KEY.to_dict(), "inputs": "x" * MAX_INPUTS_CHARS}), "linear", None)
    assert len(name) < 400
    parts = json.loads(name.removeprefix(cache.prefix))
    assert parts[2] == "sha256:" + hashlib.sha256(b"x" * MAX_INPUTS_CHARS).hexdigest()
    short = "input_ids: int64[2, 256]; use_cache=False"
    assert json.loads(cache.key_name(PlanKey(**{**KEY.to_dict(), "inputs": short}), "linear", None)
                      .removeprefix(cache.prefix))[2] == short  # a short signature stays readable


def test_redis_down_is_a_miss_and_is_not_retried_per_request() -> None:
    cache = _cache(closed_port_url(), redis_retry_after_s=60)
    name = cache.key_name(KEY, "linear", None)
    start = time.perf_counter()
    assert cache.get(name) is None
    cache.set(name, b"{}")
    cache.delete([name])
    assert cache.last_error is not None and "ConnectionError" in cache.last_error
    for _ in range(100):  # skipped entirely during the retry window
        assert cache.get(name) is None
    assert time.perf_counter() - start < 2.0
    assert cache.ping() is not None  # health checks always ask


def test_no_redis_configured() -> None:
    cache = _cache(None)
    assert not cache.enabled
    assert cache.get("x") is None and cache.ping() is None
    cache.set("x", b"1")
    cache.delete(["x"])
