"""``python -m bench.instructions`` without valgrind: its options, reading a callgrind dump
and its table, so that a broken command shows up in the suite rather than at the next count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.instructions import Count, callgrind_total, format_table, parse_args, with_ratios


def test_options_default_to_the_documented_shape_and_refuse_unknown_names() -> None:
    args = parse_args([])
    assert (args.backend, args.messages, args.clients, args.runs) == ("memory", 2000, 3, 2)
    assert args.rows == "push,pop,reserve+ok,consume"
    assert args.base is None and args.tree is None
    with pytest.raises(SystemExit):
        parse_args(["--backend", "memory,nosuch"])
    with pytest.raises(SystemExit):
        parse_args(["--rows", "pop,peek"])
    with pytest.raises(SystemExit):
        parse_args(["--base", "HEAD", "--tree", "."])


def test_the_count_is_the_dumps_totals_line(tmp_path: Path) -> None:
    dump = tmp_path / "out.cg.1"
    dump.write_text("# callgrind format\nevents: Ir\nsummary: 0\nfn=x\n1 5\ntotals: 123456\n")
    assert callgrind_total(dump) == 123456


def test_the_table_gives_each_run_the_mean_and_head_over_base() -> None:
    counts = with_ratios(
        [
            Count("redis-oq", "pop", "base", 2000, 3, [50_000.0, 50_200.0]),
            Count("redis-oq", "pop", "head", 2000, 3, [45_000.0, 45_180.0]),
        ]
    )
    assert counts[0].ratio is None
    assert counts[1].ratio == pytest.approx(45_090 / 50_100)
    lines = format_table(counts, runs=2).splitlines()
    assert [cell.strip() for cell in lines[0].strip("|").split("|")] == [
        "backend",
        "row",
        "tree",
        "run 1",
        "run 2",
        "mean",
        "head/base",
    ]
    assert "50,100" in lines[2] and "45,090" in lines[3] and "0.9000" in lines[3]
    alone = format_table([Count("memory", "push", "head", 10, 3, [1_234.4])], runs=1)
    assert "tree" not in alone and "1,234" in alone
