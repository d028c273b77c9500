"""What a request migrator takes and reports: the request as sent (`GenerateRequest`:
its `/generate` body, its budget, the rest of it after some tokens), the pieces it ran
as (`Segment`), a live move's copies (`Stage`), what one move did (`MoveReport`) and the
whole output however often the request moved (`RequestOutput`), each with `to_dict()`
where a caller writes it out."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from sglang_kv_migration.client.results import MigrationResult
from sglang_kv_migration.rollout.cost_model import CostEstimate

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams.max_new_tokens in SGLang 0.5.12

SegmentKind = Literal["original", "migrated", "reprefill", "resumed_on_source", "restarted"]
MoveOutcome = Literal["migrated", "recomputed", "fell_back", "finished_before_move", "restarted"]
FailureTarget = Literal["target", "source"]
# "auto": the cost model decides; "migrate": always migrate; "recompute": never (abort and
# re-prefill on the target: the baseline every RL framework uses today).
MoveMode = Literal["auto", "migrate", "recompute"]


def new_rid() -> str:
    return uuid.uuid4().hex


@dataclass
class GenerateRequest:
    """One non-streaming `/generate` call, in the fields a move needs to know.

    `priority` is SGLang's request priority: servers order their queue by it with
    ``--enable-priority-scheduling`` (larger first unless
    ``--schedule-low-priority-values-first``); a server without it ignores the field, or
    refuses the request with ``--abort-on-priority-when-disabled``.
    """

    input_ids: list[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    extra_key: str | None = None  # radix-cache namespace, passed to /generate and migrate
    extra_body: dict[str, Any] = field(default_factory=dict)  # other /generate fields, as is
    rid: str = field(default_factory=new_rid)

    @property
    def max_new_tokens(self) -> int:
        return int(self.sampling_params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS))

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            **self.extra_body,
            "input_ids": self.input_ids,
            "sampling_params": self.sampling_params,
            "rid": self.rid,
        }
        if self.priority is not None:
            body["priority"] = self.priority
        if self.extra_key is not None:
            body["extra_key"] = self.extra_key
        return body

    def finished_by(self, generated: list[int], eos_token_ids: frozenset[int]) -> dict | None:
        """The finish reason `generated` already reached, if any. SGLang reports an abort
        even when the aborted step hit the budget or a stop token, so a move checks."""
        if len(generated) >= self.max_new_tokens:
            return {"type": "length", "length": self.max_new_tokens}
        stops = set(self.sampling_params.get("stop_token_ids") or [])
        if not self.sampling_params.get("ignore_eos"):
            stops |= eos_token_ids
        if generated and generated[-1] in stops:
            return {"type": "stop", "matched": generated[-1]}
        return None

    def continuation(self, generated: list[int]) -> GenerateRequest:
        """The rest of this request after `generated`: same parameters, smaller budget."""
        params = dict(self.sampling_params)
        params["max_new_tokens"] = max(0, self.max_new_tokens - len(generated))
        if "min_new_tokens" in params:
            params["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - len(generated))
        return dataclasses.replace(
            self, input_ids=self.input_ids + list(generated), sampling_params=params, rid=new_rid()
        )


@dataclass(frozen=True)
class Segment:
    """One piece of a request: where it ran and what it produced there."""

    server_url: str
    rid: str
    kind: SegmentKind
    output_ids: list[int]
    finish_reason: dict[str, Any] | None
    cached_tokens: int | None  # the server's meta_info.cached_tokens, if it said
    meta_info: dict[str, Any] = field(default_factory=dict)  # that piece's, as returned


StageDecision = Literal["migrate", "recompute", "failed"]


@dataclass(frozen=True)
class Stage:
    """One copy of a live move (``move_request(live=True)``). Stages while decoding copy
    what the source already holds as the request keeps running there; the one after the
    stop copies the delta (or, `decision="recompute"`, leaves it to the target)."""

    index: int  # 1, 2, ... in the order they ran
    while_decoding: bool  # True: the request kept running on the source meanwhile
    generated: int  # tokens the request had generated on the source when it began
    held_tokens: int  # page-aligned prefix the source held (0: not asked)
    migrated_tokens: int  # what moved (the target kept what it held already)
    seconds: float
    decision: StageDecision = "migrate"
    failure: str = ""
    path: str = ""  # the data path that moved the pages ("" when none moved)


@dataclass(frozen=True)
class MoveReport:
    """What one `move_request` did. `seconds`: abort (source stop), migrate, total, and
    for a live move `live` (the stages while decoding); `last_token_to_stop` (from the
    source's last streamed token to its call's return: the part of the stall the abort
    causes) when the call is the migrator's; `stall` is added once the resumed piece's
    first token arrives (see `stall_s`). `moments`: when each step happened, by
    `time.time()` (SGLang's `meta_info` clock): ``stop_sent``, ``last_source_token``,
    ``stop_returned``, ``last_copy_done`` (a live move's last copy while decoding), and
    once the resumed piece's first token arrives ``resume_sent`` and ``first_token``."""

    rid: str  # the request's original rid
    source_url: str
    target_url: str
    outcome: MoveOutcome
    resumed_on: str  # "" when the request had already finished
    generated_before_move: int
    estimate: CostEstimate | None = None
    migration: MigrationResult | None = None
    failure: str = ""  # why a migration did not happen as planned
    seconds: dict[str, float] = field(default_factory=dict)
    live: bool = False  # asked for a live move (`stages` says what each copy did)
    stages: list[Stage] = field(default_factory=list)
    moments: dict[str, float] = field(default_factory=dict)

    @property
    def stall_s(self) -> float | None:
        """Seconds the request produced nothing: from the last token the source streamed
        (the move's start when that piece streamed none, or its call is adopted) to the
        first token of the resumed piece; 0.0 when the request never stopped; None until
        that first token arrives."""
        return self.seconds.get("stall")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["migration"] = self.migration.to_dict() if self.migration else None
        d["estimate"] = self.estimate.to_dict() if self.estimate else None
        return d


@dataclass(frozen=True)
class RequestOutput:
    """The output one uninterrupted request would have given, plus where it ran."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: dict[str, Any] | None
    meta_info: dict[str, Any]  # the last piece's meta_info
    segments: list[Segment]
    moves: list[MoveReport]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "finish_reason": self.finish_reason,
            "meta_info": self.meta_info,
            "segments": [dataclasses.asdict(s) for s in self.segments],
            "moves": [m.to_dict() for m in self.moves],
        }
