"""from_dict({"pipeline": 5}) (a TOML file with `pipeline = 5`): a bare TypeError."""
import asyncio
import aio_keuss
from aio_keuss.pipeline import from_dict


async def main() -> None:
    async with aio_keuss.connect("memory") as factory:
        for bad in (5, None):
            try:
                from_dict(factory, {"pipeline": bad})
            except Exception as exc:
                print(f"{{'pipeline': {bad!r}}}: {type(exc).__module__}.{type(exc).__name__}: {exc}")

asyncio.run(main())
