"""A MongoDB store's copies refused, for the tests of a move without transactions (which
claims the held message, copies it to the other queue, then deletes it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def copies_refused(store: Any) -> Iterator[None]:
    """While it lasts, the server refuses every insert ``store`` sends to a collection
    other than its own (a move's copy); its own inserts go through. Imported late: the
    tests skip when pymongo is missing."""
    import pymongo.errors

    insert_docs = store._insert_docs

    async def refused_there(coll: Any, *args: Any, **kwargs: Any) -> Any:
        if coll.name != store._coll.name:
            raise pymongo.errors.OperationFailure("copy refused", 2)
        return await insert_docs(coll, *args, **kwargs)

    store._insert_docs = refused_there
    try:
        yield
    finally:
        store._insert_docs = insert_docs
