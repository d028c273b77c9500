"""The pure parts of `bench_live_move.py` (tested on CPU by `test/unit/test_bench_live_move.py`):
which rows run in which order, how large the servers' KV pools must be, a decode step
from streamed token times, medians with their range, the targets' checks, each move's
breakdown and the tables.

The targets, per row (context × generated tokens, the median over the repeats):
the stall ≤ SGLang's own cached resume of the same request on the same target (its
time to first token, `baseline`) + 10 ms + one decode step of the target, and at 4K
context or less the stall ≤ 40 ms.

A move's breakdown (`breakdown`) lays three clocks on one line, all `time.time()`: the
migrator's `MoveReport.moments`, SGLang's own `meta_info` timestamps (servers with
``--enable-metrics``) and the servers' request moments (`SGLANG_KV_MIGRATION_MOMENTS_DIR`,
`server/diag/request_moments.py`), in ms:

    stop.http         abort sent -> the source's tokenizer manager has it
    stop.to_scheduler -> the source's scheduler reads it
    stop.in_batch     -> the request leaves the batch (its release starts; the decode
                         steps it still ran are `stop.steps`)
    stop.release      the release (SGLang's cache_finished_req: insert, host backup, frees)
    stop.out          release end -> the tokenizer manager has the finish
    stop.to_client    -> the migrator has the source's last chunk
    tail_to_stop      the last streamed token -> the migrator has the last chunk  } the
    to_resume         the last chunk -> the resumed piece's /generate is sent     } stall
    resume.http_in    -> the target's tokenizer manager has it (HTTP, JSON, checks)  } is
    resume.tokenizer  -> sent to the scheduler                                       } these
    resume.to_scheduler -> the scheduler reads it                                    } from
    resume.schedule   -> it enters a batch (match, allocate, build)                  } here
    resume.prefill    -> its prefill's result is read (launch, device, next launch)  } on
    resume.prefill_launch / resume.prefill_result  the prefill batch's launch / result
    resume.out        -> the tokenizer manager sends the first chunk
    resume.to_client  -> the migrator has the first token

`baseline` has the same ``resume.*`` phases for SGLang's own cached resume.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

STALL_CAP_S = 0.040  # the stall's absolute target, at 4K context or less
STALL_CAP_MAX_CONTEXT = 4096
STALL_SLACK_S = 0.010  # what the move may add beyond SGLang's own resume and one step
META_STAMPS = (
    "request_received_ts",
    "api_server_dispatch_finish_ts",
    "forward_entry_time",
    "prefill_finished_time",
    "response_sent_to_client_ts",
    "request_finished_ts",
)
STOP_PHASES = ("stop.http", "stop.to_scheduler", "stop.in_batch", "stop.release",
               "stop.out", "stop.to_client")  # fmt: skip
RESUME_PHASES = ("resume.http_in", "resume.tokenizer", "resume.to_scheduler",
                 "resume.schedule", "resume.prefill", "resume.prefill_launch",
                 "resume.prefill_result", "resume.out", "resume.to_client")  # fmt: skip
STALL_PHASES = ("tail_to_stop", "to_resume", *RESUME_PHASES)


def plan_rows(contexts: list[int], gens: list[int]) -> list[tuple[int, int]]:
    """(context, generated) per row, the shortest runs first: a job cut at its time limit
    keeps the rows it finished (the result file is rewritten after each)."""
    return sorted(((c, g) for g in gens for c in contexts), key=lambda cg: (cg[1], cg[0]))


def pool_tokens(contexts: list[int], gens: list[int], repeats: int, tail: int, page: int) -> int:
    """The KV pool (tokens) a server needs: the repeats of the largest row decode at
    once on the source and finish on the target, each in whole pages, plus one page per
    request of slack (the page being written) and SGLang's own reserve (a page per
    request again)."""
    per_request = max(contexts) + max(gens) + tail
    per_request = -(-per_request // page) * page + 2 * page
    return repeats * per_request


def predicted_row_s(
    rows: list[dict[str, Any]], context: int, generated: int, args: Any
) -> float | None:
    """Seconds a row should take, from the row already run at the same context with the
    fewest tokens generated: its time per token the repeats decode (the last repeat
    starts `stagger` tokens after the one before, so a row decodes about
    generated + stagger × (repeats - 1) + tail tokens), a quarter more (the longer a
    request, the slower each step); None when no such row ran."""
    done = [r for r in rows if r["context"] == context and r["generated"] < generated]
    if not done:
        return None
    base = min(done, key=lambda r: r["generated"])

    def tokens(n: int) -> int:
        return n + args.stagger * (args.repeats - 1) + args.tail

    return base["seconds"] * tokens(generated) / tokens(base["generated"]) * 1.25


def decode_step_s(token_times: list[float]) -> float | None:
    """The median time between consecutive streamed tokens (one decode step each);
    None with fewer than two tokens."""
    gaps = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def spread(values: list[float | None]) -> dict[str, Any]:
    """Median, min and max of the values present (None: a repeat that did not measure
    it), and how many there were."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def meta_stamps(meta: dict[str, Any]) -> dict[str, float]:
    """SGLang's own timestamps of a reply's `meta_info` (``--enable-metrics``)."""
    return {k: float(meta[k]) for k in META_STAMPS if isinstance(meta.get(k), (int, float))}


# --------------------------------------------------------------------------- the checks


def checks(
    context: int, stalls: list[float | None], baselines: list[float | None], step: float | None
) -> dict[str, Any]:
    """The row's targets on the medians, and how many repeats met them on their own
    (each against its own baseline)."""
    cap = STALL_CAP_S if context <= STALL_CAP_MAX_CONTEXT else None
    stall, base = spread(stalls)["median"], spread(baselines)["median"]
    out: dict[str, Any] = {"stall_cap_s": cap, "bound_s": None, "met": False}
    if stall is None or base is None or step is None:
        return out
    out["bound_s"] = base + STALL_SLACK_S + step
    out["added_s"] = spread(
        [s - b for s, b in zip(stalls, baselines, strict=True) if s is not None and b is not None]
    )["median"]
    out["under_bound"] = stall <= out["bound_s"]
    out["under_cap"] = cap is None or stall <= cap
    out["met"] = out["under_bound"] and out["under_cap"]
    out["repeats_met"] = sum(
        1
        for s, b in zip(stalls, baselines, strict=True)
        if s is not None
        and b is not None
        and s <= b + STALL_SLACK_S + step
        and (cap is None or s <= cap)
    )
    return out


# --------------------------------------------------------------------------- moments


def read_moments(directory: Path, rids: list[str]) -> list[dict[str, Any]]:
    """The servers' request moments under `directory` (one file per process) that name
    one of `rids`, by time."""
    events = []
    for path in sorted(directory.glob("moments-*.jsonl")):
        for line in path.read_text().splitlines():
            if any(rid in line for rid in rids):
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e["t"])


def events_of(events: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    """The moments that name `rid` (its own, or a batch that ran it)."""
    return [e for e in events if e.get("rid") == rid or rid in e.get("rids", ())]


def _first(events: list[dict[str, Any]], event: str, **match: Any) -> dict[str, Any] | None:
    for e in events:
        if e["event"] == event and all(e.get(k) in v for k, v in match.items()):
            return e
    return None


def _ms(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else (end - start) * 1e3


def resume_phases(
    sent: float | None,
    first_token: float | None,
    meta: dict[str, float],
    events: list[dict[str, Any]],
) -> dict[str, float | None]:
    """The ``resume.*`` phases of one request the migrator sent at `sent` and whose first
    token it read at `first_token` (its `meta_stamps`, the target's moments of its rid)."""
    received = _first(events, "received")
    extend = ("extend", "mixed")
    launched = _first(events, "launched", mode=extend)
    processed = _first(events, "processed", mode=extend)
    return {
        "resume.http_in": _ms(sent, meta.get("request_received_ts")),
        "resume.tokenizer": _ms(
            meta.get("request_received_ts"), meta.get("api_server_dispatch_finish_ts")
        ),
        "resume.to_scheduler": _ms(
            meta.get("api_server_dispatch_finish_ts"), received and received["t"]
        ),
        "resume.schedule": _ms(received and received["t"], meta.get("forward_entry_time")),
        "resume.prefill": _ms(meta.get("forward_entry_time"), meta.get("prefill_finished_time")),
        "resume.prefill_launch": launched["ms"] if launched else None,
        "resume.prefill_result": processed["ms"] if processed else None,
        "resume.out": _ms(
            meta.get("prefill_finished_time"), meta.get("response_sent_to_client_ts")
        ),
        "resume.to_client": _ms(meta.get("response_sent_to_client_ts"), first_token),
    }


def stop_phases(
    moments: dict[str, float], source_meta: dict[str, float], events: list[dict[str, Any]]
) -> dict[str, float | None]:
    """The ``stop.*`` phases of a move (`events`: the source's moments of its rid)."""
    tm = _first(events, "tm_abort")
    seen = _first(events, "abort_seen")
    released = _first(events, "released")
    release_end = released["t"] + released["ms"] / 1e3 if released else None
    steps = None
    if seen and released:
        steps = sum(
            1
            for e in events
            if e["event"] == "launched" and e["mode"] == "decode"
            and seen["t"] <= e["t"] <= released["t"]
        )  # fmt: skip
    return {
        "stop.http": _ms(moments.get("stop_sent"), tm and tm["t"]),
        "stop.to_scheduler": _ms(tm and tm["t"], seen and seen["t"]),
        "stop.in_batch": _ms(seen and seen["t"], released and released["t"]),
        "stop.release": released["ms"] if released else None,
        "stop.out": _ms(release_end, source_meta.get("request_finished_ts")),
        "stop.to_client": _ms(source_meta.get("request_finished_ts"), moments.get("stop_returned")),
        "stop.steps": steps,
    }


def breakdown(repeat: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """One move's phases in ms (None where a clock did not say), and its baseline's."""
    moments = repeat["moments"]
    out: dict[str, Any] = stop_phases(
        moments, repeat["source_meta"], events_of(events, repeat["source_rid"])
    )
    out["tail_to_stop"] = _ms(moments.get("last_source_token"), moments.get("stop_returned"))
    out["to_resume"] = _ms(moments.get("stop_returned"), moments.get("resume_sent"))
    out.update(
        resume_phases(
            moments.get("resume_sent"),
            moments.get("first_token"),
            repeat["resumed_meta"],
            events_of(events, repeat["resumed_rid"]),
        )
    )
    base = repeat.get("baseline") or {}
    if base:
        out["baseline"] = resume_phases(
            base["sent"], base["first_token"], base["meta"], events_of(events, base["rid"])
        )
    return out


def phase_spreads(breakdowns: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, the spread over the repeats (`spread`, in ms); `baseline` the same."""
    names = [*STOP_PHASES, "stop.steps", *STALL_PHASES]
    out: dict[str, Any] = {n: spread([b.get(n) for b in breakdowns]) for n in names}
    out["baseline"] = {
        n: spread([(b.get("baseline") or {}).get(n) for b in breakdowns]) for n in RESUME_PHASES
    }
    return out


# --------------------------------------------------------------------------- tables


def cell(s: dict[str, Any], scale: float = 1e3, digits: int = 1) -> str:
    if s["median"] is None:
        return "—"
    f = f"{{:.{digits}f}}"
    return (
        f"{f.format(s['median'] * scale)} "
        f"[{f.format(s['min'] * scale)}–{f.format(s['max'] * scale)}]"
    )


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table: medians with [min–max] in ms."""
    head = ["context", "generated", "repeats", "stall ms", "SGLang cached resume ms",
            "added ms", "abort ms", "target decode step ms", "bound ms", "rounds",
            "met"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        step, c = row["decode_step_s"], row["checks"]
        cells = [
            f"{row['context']:,}",
            f"{row['generated']:,}",
            str(row["stall"]["n"]),
            cell(row["stall"]),
            cell(row["baseline"]),
            "—" if c.get("added_s") is None else f"{c['added_s'] * 1e3:.1f}",
            cell(row["abort"]),
            "—" if step is None else f"{step * 1e3:.1f}",
            "—" if c.get("bound_s") is None else f"{c['bound_s'] * 1e3:.1f}",
            cell(row["rounds"], scale=1.0, digits=0),
            str(c["met"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_breakdown(rows: list[dict[str, Any]]) -> str:
    """Per row, each phase's median [min–max] in ms: the move's, then SGLang's own
    cached resume's (`baseline`) beside the resume's."""
    names = [*STOP_PHASES, "stop.steps", *STALL_PHASES]
    head = ["phase", *(f"{r['context'] // 1024}K × {r['generated'] // 1024}K" for r in rows)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        cells = [cell(r["phases"][name], 1.0, 0 if name == "stop.steps" else 1) for r in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name in RESUME_PHASES:
        cells = [cell(r["phases"]["baseline"][name], 1.0) for r in rows]
        lines.append(f"| baseline {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
