"""readStream + trigger(availableNow=True): one batch read, never acknowledged."""
import os, sys, tempfile
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
from pyspark.sql import SparkSession
from aio_keuss import spark as ks, sync

spark = (SparkSession.builder.master("local[2]").appName("hunt9-repro")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
ks.register(spark)
opts = {"url": "redis://127.0.0.1:6379/0", "prefix": "hunt9-repro-an"}
with sync.connect("redis-oq", **opts) as f:
    f.queue("in").push_many([{"n": n} for n in range(50)])
tmp = tempfile.mkdtemp()

def run():
    r = spark.readStream.format("aio_keuss")
    for k, v in {"backend": "redis-oq", "queue": "in", "max_rows_per_batch": 20,
                 "reserve_delay": 600, **opts}.items():
        r = r.option(k, str(v))
    q = (r.load().writeStream.format("parquet").option("path", tmp + "/out")
         .option("checkpointLocation", tmp + "/ckpt").trigger(availableNow=True).start())
    q.awaitTermination(120)
    return sum(p["numInputRows"] for p in q.recentProgress)

for attempt in (1, 2):
    rows = run()
    with sync.connect("redis-oq", **opts) as f:
        print(f"run {attempt}: rows read {rows}; queue now {f.queue('in').sizes()}")
spark.stop()
ks.close_executor_factories()
with sync.connect("redis-oq", **opts) as f:
    f.queue("in").purge()
import redis
r = redis.Redis.from_url(opts["url"])
for key in r.scan_iter(match=opts["prefix"] + ":*"):
    r.delete(key)
