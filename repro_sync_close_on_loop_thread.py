"""sync.connect() / SyncFactory.close() called on the shim's loop thread (from a coroutine
given to SyncFactory.call): anyio's bare RuntimeError, and close leaves the factory marked
closed but never closed, and the loop thread running after the last factory closed."""
import threading
from aio_keuss import sync


def portals():
    return [t.name for t in threading.enumerate() if "portal" in t.name]


f = sync.connect("memory")
q = f.queue("jobs")
q.push({"a": 1})


async def nested_connect():
    return sync.connect("memory")


async def nested_close():
    f.close()


for nested in (nested_connect, nested_close):
    try:
        f.call(nested)
    except Exception as exc:
        print(f"{nested.__name__}: {type(exc).__module__}.{type(exc).__name__}: {exc}")
print("factory closed?", f.closed)
try:
    print("size after the failed close:", q.size())
except Exception as exc:
    print("size after the failed close:", type(exc).__name__, exc)
f.close()
print("portal threads after every factory closed:", portals())
