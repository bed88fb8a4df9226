"""Spark hands a data source its options as strings: connect options that are flags or
counts (postgres history / durable_acks / max_pool_size, Redis cluster, redis-sharded shards)
reach aio_keuss.connect as text and are refused, so no Spark read or write can set them."""
import asyncio
import asyncpg
import aio_keuss
from aio_keuss.spark.source import KeussDataSource

URL = "postgresql://postgres@127.0.0.1:5432/test"
base = {"backend": "postgres", "queue": "jobs", "url": URL, "schema": "hunt9_typed"}
for option, text in [("history", "true"), ("durable_acks", "false"), ("max_pool_size", "4")]:
    source = KeussDataSource({**base, option: text})
    for what, make in (("read", source.reader), ("readStream", source.streamReader)):
        try:
            make(None)
            print(f"{option}={text} {what}: accepted")
        except aio_keuss.KeussError as exc:
            print(f"{option}={text} {what}: {type(exc).__name__}: {exc}")
source = KeussDataSource({"backend": "redis-sharded", "queue": "jobs", "prefix": "hunt9-typed",
                          "url": "redis://127.0.0.1:6379/0", "shards": "4"})
try:
    source.reader(None)
    print("shards=4 read: accepted")
except aio_keuss.KeussError as exc:
    print(f"shards=4 read: {type(exc).__name__}: {exc}")


async def drop() -> None:
    c = await asyncpg.connect(URL)
    await c.execute('DROP SCHEMA IF EXISTS "hunt9_typed" CASCADE')
    await c.close()

asyncio.run(drop())
