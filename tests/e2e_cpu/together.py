"""Independent expensive runs of one test module, started together by a module fixture.

Each run (a train.py, a rank process, a converter) is mostly single-threaded start-up: two at a time keep
the two cores of a CI machine busy where one leaves one idle. A run's outcome (its result, or the exception
it raised: a failed assert, pytest.fail) is kept under its key and handed to that key's own test, so every
test still passes or fails on its own run only."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def run_together(fn, keys, workers: int = 2) -> dict:
    """fn(key) for every key, `workers` at a time: key -> its result or the exception it raised."""

    def call(key):
        try:
            return fn(key)
        except BaseException as e:  # noqa: BLE001 - re-raised by result_of in the key's test
            return e

    keys = list(keys)
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(keys, pool.map(call, keys)))


def result_of(results: dict, key):
    """The run's result; its exception re-raised (the run's own test fails with it)."""
    r = results[key]
    if isinstance(r, BaseException):
        raise r
    return r
