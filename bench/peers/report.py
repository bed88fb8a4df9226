"""The sitting's tables: absolute medians per system and row, and ratios.

A ratio is computed inside each repetition (aio-keuss's rate over the other system's, both
measured minutes apart under the same load) and the median of those per-repetition ratios is
printed: on a shared machine the load drifts between repetitions, and a ratio taken within one
repetition cancels most of that drift, which a ratio of two medians would not.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterator

from bench.peers.systems import KEUSS_FOR, OUR_BACKENDS, PEER_BACKENDS, Row

Key = tuple[str, str, str, int]  # system, backend, scenario, clients


def key(row: Row) -> Key:
    return (row["system"], row["backend"], row["scenario"], int(row["clients"]))


def by_rep(rows: list[Row]) -> dict[Key, dict[int, float]]:
    table: dict[Key, dict[int, float]] = defaultdict(dict)
    for row in rows:
        table[key(row)][row["rep"]] = float(row["rate"])
    return table


def comparisons(clients: list[int]) -> Iterator[tuple[str, Key, Key]]:
    """(label, aio-keuss row, other row) for every pair the sitting compares."""
    for backend in OUR_BACKENDS:
        keuss = KEUSS_FOR[backend]
        for scenario in ("push", "pop", "reserve+ok"):
            if backend == "redis-list" and scenario == "reserve+ok":
                continue
            for c in clients:
                label = f"{backend} {scenario} / Keuss {keuss}"
                yield label, ("aio-keuss", backend, scenario, c), ("keuss", keuss, scenario, c)
        if backend != "redis-list":  # consume() against Keuss's reserve + ok loop
            for c in clients:
                label = f"{backend} {CONSUME} / Keuss {keuss} reserve+ok"
                yield label, ("aio-keuss", backend, CONSUME, c), ("keuss", keuss, "reserve+ok", c)
    for peer, backends in PEER_BACKENDS.items():
        for backend in backends:
            ours = "redis-oq" if backend == "redis" else "postgres"
            pairs = (("push", "enqueue"), ("reserve+ok", "process"), (CONSUME, "process"))
            for scenario, theirs in pairs:
                for c in clients:
                    label = f"{ours} {scenario} / {peer} {backend} {theirs}"
                    yield label, ("aio-keuss", ours, scenario, c), (peer, backend, theirs, c)
    server = {
        "redis-list": ("redis", "LPUSH", "RPOP"),
        "redis-oq": ("redis", "LPUSH", "RPOP"),
        "postgres": ("postgres", "INSERT", "DELETE…RETURNING"),
    }
    for backend, (server_backend, push, pop) in server.items():
        for scenario, limit in (("push", push), ("pop", pop)):
            label = f"{backend} {scenario} / server {limit}"
            yield label, ("aio-keuss", backend, scenario, 3), ("server", server_backend, limit, 3)


def ratio_rows(rows: list[Row], clients: list[int]) -> list[tuple[str, int, float, list[float]]]:
    table = by_rep(rows)
    out = []
    for label, ours, other in comparisons(clients):
        reps = sorted(set(table.get(ours, {})) & set(table.get(other, {})))
        ratios = [table[ours][r] / table[other][r] for r in reps if table[other][r] > 0]
        if ratios:
            out.append((label, ours[3], statistics.median(ratios), ratios))
    return out


def print_tables(rows: list[Row], clients: list[int]) -> None:
    table = by_rep(rows)
    print("\nAbsolute rates, msgs/s: median over repetitions (min - max)")
    header = f"| {'system':<13} | {'backend':<14} | {'row':<19} | {'clients':>7} | "
    header += f"{'median':>8} | {'min - max':>17} | {'reps':>4} |"
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for (system, backend, scenario, c), reps in sorted(table.items(), key=_order):
        rates = list(reps.values())
        spread = f"{min(rates):,.0f} - {max(rates):,.0f}"
        print(
            f"| {system:<13} | {backend:<14} | {scenario:<19} | {c:>7} | "
            f"{statistics.median(rates):>8,.0f} | {spread:>17} | {len(rates):>4} |"
        )
    print("\nRatios, aio-keuss ÷ other: median of the per-repetition ratios (each repetition's)")
    header = f"| {'aio-keuss row / other row':<64} | {'clients':>7} | {'ratio':>6} | per rep"
    print(header)
    print("|" + "-" * 66 + "|" + "-" * 9 + "|" + "-" * 8 + "|" + "-" * 20)
    for label, c, median, ratios in ratio_rows(rows, clients):
        each = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"| {label:<64} | {c:>7} | {median:>5.2f}x | {each}")


SYSTEM_ORDER = ["aio-keuss", "keuss", "saq", "arq", "procrastinate", "server"]
CONSUME = "consume prefetch=10"
"""Our worker loop (``consume`` with a prefetch), the closest to a peer's worker."""
SCENARIO_ORDER = ["push", "pop", "reserve+ok", CONSUME, "enqueue", "process"]


def _order(item: tuple[Key, dict[int, float]]) -> tuple[int, str, int, int]:
    system, backend, scenario, c = item[0]
    s = SYSTEM_ORDER.index(system) if system in SYSTEM_ORDER else 99
    n = SCENARIO_ORDER.index(scenario) if scenario in SCENARIO_ORDER else 99
    return (s, backend, c, n)
