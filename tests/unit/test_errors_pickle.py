"""Every error of the library survives pickling (a process pool's task, a Spark executor's
failure sent to its driver): an exception unpickles by calling its class with its ``args``,
which for a class with its own ``__init__`` are not its arguments unless it says so."""

from __future__ import annotations

import pickle

from aio_keuss import errors


def test_the_errors_with_their_own_arguments_pickle() -> None:
    made = [
        errors.RateLimited(2.5),
        errors.RateLimited(1, "slow down"),
        errors.MissingDependencyError("redis", "redis.asyncio"),
        errors.MissingDependencyError("spark", "pyspark", needed_by="the Spark source"),
        errors.JobFailedError("id-1", "boom"),
        errors.ResultTimeoutError("id-2", 3.0),
        errors.ResultMissingError("id-3"),
    ]
    for error in made:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)
        assert vars(copy) == vars(error)


def test_every_other_error_pickles_with_its_text() -> None:
    own_init = {
        "RateLimited",
        "MissingDependencyError",
        "JobFailedError",
        "ResultTimeoutError",
        "ResultMissingError",
    }
    for name in dir(errors):
        kind = getattr(errors, name)
        if not (isinstance(kind, type) and issubclass(kind, errors.KeussError)):
            continue
        if name in own_init:
            continue
        copy = pickle.loads(pickle.dumps(kind("why")))
        assert type(copy) is kind and str(copy) == "why"
