"""The named cross-rank agreement steps of `RankContext`, on a stage of three TP ranks
whose gather is scripted (each step is one collective; its answer is the same on every
rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_kv_migration.server.rank.context import RankContext


@dataclass
class _Out:
    success: bool
    message: str = ""


class _ScriptedStage(RankContext):
    """This rank's value first, then the other ranks' (scripted) values."""

    def __init__(self, others: list[Any]):
        super().__init__(None, 0, 3, 0, 1, None, "m", lambda _o, _r: None)
        self.others = others
        self.gathers = 0

    def all_gather(self, obj: Any) -> list[Any]:
        self.gathers += 1
        return [obj, *self.others]

    def all_gather_world(self, obj: Any) -> list[Any]:
        return self.all_gather(obj)


def test_all_ranks_agree() -> None:
    assert _ScriptedStage([True, True]).all_ranks_agree(True)
    assert not _ScriptedStage([True, False]).all_ranks_agree(True)
    assert not _ScriptedStage([True, True]).all_ranks_agree(False)


def test_first_error_on_any_rank_in_tp_order() -> None:
    assert _ScriptedStage([None, None]).first_error_on_any_rank(None) is None
    assert _ScriptedStage(["b", "c"]).first_error_on_any_rank(None) == "b"
    assert _ScriptedStage(["b", "c"]).first_error_on_any_rank("a") == "a"


def test_first_error_and_any_flag_is_one_collective() -> None:
    stage = _ScriptedStage([(None, False), ("late", True)])
    assert stage.first_error_and_any_flag(None, False) == ("late", True)
    assert stage.gathers == 1
    assert _ScriptedStage([(None, False)] * 2).first_error_and_any_flag(None, False) == (
        None,
        False,
    )


def test_first_failure_on_any_rank() -> None:
    ok, bad = _Out(True), _Out(False, "no room")
    outputs, failed = _ScriptedStage([ok, ok]).first_failure_on_any_rank(ok)
    assert outputs == [ok, ok, ok] and failed is None
    outputs, failed = _ScriptedStage([bad, _Out(False, "other")]).first_failure_on_any_rank(ok)
    assert len(outputs) == 3 and failed is bad


def test_union_and_world_steps() -> None:
    assert _ScriptedStage([["c", "a"], []]).union_on_all_ranks(["b", "a"]) == ["a", "b", "c"]
    assert _ScriptedStage(["theirs", "x"]).first_rank_value_on_world("mine") == "mine"
    merged = _ScriptedStage([{"device": "no GPU"}, {}]).merged_on_world({})
    assert merged == {"device": "no GPU"}
