"""`docs/benchmarks.md`'s generated tables are what `benchmark/results.py` computes from
the raw records under `docs/gpu-runs/` (a figure edited by hand, or a record moved,
fails here)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmark"
sys.path.insert(0, str(BENCHMARK))

import results  # noqa: E402


def test_every_record_the_page_quotes_is_there():
    missing = [rel for rel in results.RUNS.values() if not (results.RUNS_DIR / rel).is_file()]
    assert missing == []


def test_the_pages_tables_are_computed_from_the_records():
    page = results.PAGE.read_text()
    assert results.render(page) == page


def test_a_figure_edited_by_hand_is_caught():
    page = results.PAGE.read_text()
    start = page.index("<!-- results:targets -->")
    edited = page[:start] + page[start:].replace("5.39 ms", "4.40 ms", 1)
    assert edited != page
    assert results.render(edited) != edited


def test_spread_gives_the_median_and_the_range_and_says_when_there_is_one_value():
    assert results.spread([3.0, 1.0, 2.0], " ms") == "2.00 ms (1.00–3.00, n=3)"
    assert results.spread([2.5], "%", 1) == "2.5% (one run)"
    assert results.verdict([5.39], 5.0, " ms") == "**missed by 0.39 ms**"
    assert results.verdict([48.2], 45.0, " GB/s", below=False) == "met"


def test_the_live_block_reads_a_record_with_sglangs_own_resume(monkeypatch):
    """A `bench_live_move.py` record with the baseline (SGLang's own cached resume)
    renders its columns: the stall, the resume, what the move added, the bound, the cap
    at 4K only, and the verdict against the tighter of the two."""

    def repeat(stall: float, base: float) -> dict:
        return {"complete": True, "stall_s": stall, "baseline_s": base}

    rows = [
        {"context": 4096, "generated": 1024, "decode_step_s": 0.0066,
         "repeats": [repeat(0.030, 0.020), repeat(0.035, 0.024), repeat(0.032, 0.021)],
         "baseline": {}, "checks": {"bound_s": 0.0376, "stall_cap_s": 0.040,
                                    "added_s": 0.011}},
        {"context": 32768, "generated": 1024, "decode_step_s": 0.0172,
         "repeats": [repeat(0.120, 0.090), repeat(0.130, 0.095), repeat(0.125, 0.092)],
         "baseline": {}, "checks": {"bound_s": 0.1192, "stall_cap_s": None,
                                    "added_s": 0.033}},
    ]  # fmt: skip
    monkeypatch.setattr(results, "load", lambda name: {"rows": rows})
    lines = results.block_live().splitlines()
    assert lines[0].startswith("| context | generated | stall | SGLang's own cached resume |")
    assert lines[2] == (
        "| 4,096 | 1,024 | 32.0 ms (30.0–35.0, n=3) | 21.0 ms (20.0–24.0, n=3) | 11.0 ms "
        "| 6.6 ms | 37.6 ms | 40 ms | met |"
    )
    assert lines[3].endswith("| 119.2 ms | — | **missed by 5.8 ms** (the bound) |")
    rows[0]["repeats"] = [repeat(0.050, 0.070)] * 3  # under the bound, over the 40 ms cap
    rows[0]["checks"]["bound_s"] = 0.0868
    rows[0]["quiet_resume"] = {"ttft_s": 0.0391}
    lines = results.block_live().splitlines()
    assert lines[2].endswith("| 86.8 ms | 40 ms | **missed by 10.0 ms** (the cap) |")
    assert lines[-1].endswith("(`quiet_resume`, one per row): 4K 39.1 ms.")


# ------------------------------------------------- results_adoption.py's blocks

import json  # noqa: E402

import pytest  # noqa: E402
import results_adoption as adoption  # noqa: E402


def _flag_record() -> dict:
    def rnd(i: int, stock: float, hicache: float, flag: float) -> dict:
        cell = {"stock": {"value": stock}, "hicache": {"value": hicache}, "flag": {"value": flag}}
        return {"round": i, "cells": {"ttft_fresh_17": cell}}

    return {
        "config": {"card": {"name": "NVIDIA H100 80GB HBM3"}, "kv_tokens": 57344},
        "servers": [{"name": n, "startup_s": s} for n, s in
                    (("stock", 151.0), ("hicache", 66.0), ("flag", 71.0))],
        "rounds": [rnd(0, 20.0, 21.0, 21.1), rnd(1, 20.2, 21.2, 21.2), rnd(2, 19.8, 20.8, 21.0)],
    }  # fmt: skip


def _verl_record(makespans: dict[str, float]) -> dict:
    steps = {
        arm: [{"makespan_s": m, "turns": [{"latency_s": m / 10}], "moves": {}, "repeat": 0}]
        for arm, m in makespans.items()
    }
    config = {"sessions": 64, "skewed": 48, "turns": 4, "card": {"name": "NVIDIA H200"}}
    return {"config": config, "steps": steps, "mismatched_turns": {"0": []}}


def _scene_record(migrate_high: float) -> dict:
    seconds = {
        "none": {"0": {"high": [10.0], "low": [20.0]}},
        "recompute": {"0": {"high": [5.0], "low": [20.0]}},
        "migrate": {"0": {"high": [migrate_high], "low": [20.5]}},
    }
    move = {"outcome": "migrated", "path": "device", "landing_tier": "host"}
    return {
        "variants": {"full": {"turn_seconds": seconds}},
        "turns": {"full:0:migrate": [{"moves": [move]}, {"moves": []}]},
    }


def test_adoption_blocks_stay_off_the_page_until_their_records_are_named() -> None:
    for name, records in adoption.RUNS.items():
        assert (name in results.BLOCKS) == bool(records)
        for entry in records:  # rl-scenes: "<context>=<path>"
            assert (results.RUNS_DIR / entry.partition("=")[2 if "=" in entry else 0]).is_file()
    # A block without records (one not named in RUNS yet) cannot be on the page.
    unnamed = next((n for n, records in adoption.RUNS.items() if not records), "no-such-block")
    marker = f"\n<!-- results:{unnamed} -->\n<!-- /results:{unnamed} -->\n"
    with pytest.raises(SystemExit, match=f"no records for block.*{unnamed}"):
        results.render(results.PAGE.read_text() + marker)


def test_adoption_blocks_are_computed_from_the_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "flag.json").write_text(json.dumps(_flag_record()))
    arms = {"default": 30.0, "repin_reprefill": 25.0, "repin_migrate": 19.0,
            "balanced_bound": 17.0}  # fmt: skip
    (tmp_path / "verl_a.json").write_text(json.dumps(_verl_record(arms)))
    later = {arm: m + 1.0 for arm, m in arms.items()}
    (tmp_path / "verl_b.json").write_text(json.dumps(_verl_record(later)))
    (tmp_path / "scene_r0.json").write_text(json.dumps(_scene_record(1.0)))
    (tmp_path / "scene_r1.json").write_text(json.dumps(_scene_record(3.0)))
    monkeypatch.setattr(adoption, "RUNS", {
        "flag-cost": ["flag.json"],
        "verl-scale": ["verl_a.json", "verl_b.json"],
        "rl-scenes": ["8192=scene_r0.json", "8192=scene_r1.json"],
    })  # fmt: skip
    blocks = adoption.ready_blocks(tmp_path)
    assert set(blocks) == {"flag-cost", "verl-scale", "rl-scenes"}

    flag = blocks["flag-cost"]()
    assert "| TTFT, fresh 17-token prompt (ms) | 20.00 (19.80–20.20, n=3) |" in flag
    assert "+5.00%" in flag and "+0.48%" in flag and "| met |" in flag
    assert "NVIDIA H100 80GB HBM3, 3 interleaved rounds" in flag and "stock 151 s" in flag

    verl = blocks["verl-scale"]()
    assert "| repin_migrate | 2 | 19.50 (19.00–20.00) |" in verl
    # Per repeat 19/25 and 20/26 over re-prefill: median 0.765, met (<= 0.8).
    assert "makespan migrate over reprefill ≤ 0.8: 0.765 (0.760–0.769, n=2) per repeat" in verl
    assert "(medians' ratio 0.7647) — met" in verl
    assert "makespan migrate over bound: 1.114 (1.111–1.118, n=2)" in verl

    scene = blocks["rl-scenes"]()
    # Pooled p99 of migrate's high turns over none's: 2.98 / 10 = 0.298 (missed by 0.148).
    assert "| 8K | full | 2 | " in scene
    assert "0.298; per repeat 0.200 (0.100–0.300, n=2) (**missed by 0.148**)" in scene
    assert "device → host 2" in scene
    assert adoption.show("rl-scenes", [f"8192={tmp_path / 'scene_r0.json'}"]).count("| 8K |") == 1
    with pytest.raises(SystemExit):
        adoption.show("bogus", [])


# ------------------------------------------------- results_concurrency.py's blocks

import results_concurrency as concurrency  # noqa: E402

FULL = (
    "allocate failed (HTTP 503): http://127.0.0.1:30920/allocate_token_for_transfer: "
    "device KV pool is full: 8176 token slots needed, 3216 free and 0 evictable; nothing"
)


def _conc_move(wall: float, start: float = 1.6, copy_wait: float = 0.8) -> dict:
    steps = {"polls": 1, "first_poll": 5, "target_iteration": 9, "start": start,
             "copy_wait": copy_wait, "route": wall - 2.0}  # fmt: skip
    return {"wall_ms": wall, "whole": True, "tier": "gpu", "copy_ms": 0.75, "polls": 1,
            "first_poll": 5, "target_iteration": 9, "steps_ms": {"transfer": steps}}  # fmt: skip


def _conc_round(state: str, one: float, six: float, refused: int = 0) -> dict:
    moves = [_conc_move(six - i, copy_wait=4.0) for i in range(6 - refused)]
    moves += [{"failed": FULL, "whole": False, "wall_ms": six} for _ in range(refused)]
    return {"state": state, "one": _conc_move(one), "threads": {"wall_ms": six, "moves": moves},
            "one_call": {"wall_ms": six + 1.0, "moves": [_conc_move(six + 1.0)] * 6}}  # fmt: skip


def test_the_concurrency_block_judges_only_rounds_whose_six_all_moved() -> None:
    """Each round's own six / one, median (min–max, n); a verdict where every move of
    every round moved, none (with the ratio as recorded and why moves failed) where
    some were refused; the source iterations per move."""
    record = {"rounds": [_conc_round("idle", 10.0, 14.0), _conc_round("idle", 10.0, 20.0),
                         _conc_round("busy", 20.0, 70.0, refused=3)]}  # fmt: skip
    lines = concurrency.block_concurrency(record).splitlines()
    assert lines[2] == (
        "| idle | six from threads | 10.0 ms (10.0–10.0, n=2) | 17.0 ms (14.0–20.0, n=2) "
        "| 1.70× (1.40–2.00, n=2) | 12 of 12 | 1; 1 | ≤ 1.5× | **missed by 0.20×** |"
    )
    assert lines[3].startswith("| idle | six in one call |") and lines[3].endswith(
        "| 1.80× (1.50–2.10, n=2) | 12 of 12 | 1; 1 | ≤ 1.5× | **missed by 0.30×** |"
    )
    assert lines[4].endswith(
        "| 3.50× (one run) | 3 of 6 | 1; 1 | ≤ 2.0× | "
        "not measured (3 of 6 moves did not move); as recorded 1.50× over |"
    )
    assert lines[5].endswith("| 3.55× (one run) | 6 of 6 | 1; 1 | ≤ 2.0× | **missed by 1.55×** |")
    assert (
        "Moves that did not move (3, every way and state): allocate failed (HTTP 503): "
        "device KV pool is full: 8176 token slots needed, 3216 free and 0 evictable."
    ) in lines
    assert lines[-1] == (
        "The refused moves from threads, busy source, took 70.0 ms (70.0–70.0, n=3) each."
    )


def test_the_concurrency_steps_block_gives_each_steps_median_over_the_moves_that_moved() -> None:
    record = {"rounds": [_conc_round("busy", 20.0, 70.0, refused=3)]}
    table = concurrency.block_concurrency_steps(record).splitlines()
    assert table[0] == (
        "| step | busy, one (n=1) | busy, six: threads (n=3) | busy, six: one call (n=6) |"
    )
    rows = {line.split(" | ")[0]: line for line in table[2:]}
    assert rows["| `copy_wait`: source: launch until the copy is seen done"].endswith(
        "| 0.80 | 4.00 | 0.80 |"
    )
    # The moves from threads took 70, 69 and 68 ms: median 69; their routes 2 ms less.
    assert rows["| `wall_ms`: the move's wall time (client)"].endswith("| 20.00 | 69.00 | 71.00 |")
    assert rows["| `route`: the whole route (server side)"].endswith("| 18.00 | 67.00 | 69.00 |")
    assert "`allocate_ahead`" not in "\n".join(table)  # a step no move reported: no row
    assert concurrency.short_reason(FULL) == (
        "allocate failed (HTTP 503): device KV pool is full: 8176 token slots needed, "
        "3216 free and 0 evictable"
    )
