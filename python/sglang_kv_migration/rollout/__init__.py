"""What a rollout manager imports: moving live requests (`request_migration.py`), the
migrate-or-recompute cost model (`cost_model.py`) and the rebalancer that decides which
requests move where (`rebalancer.py`; its CLI is `integrations/rebalance_cli.py`). Built
on `client/`."""

from sglang_kv_migration.rollout.cost_model import CostModel
from sglang_kv_migration.rollout.rebalancer import RebalancePolicy, Rebalancer
from sglang_kv_migration.rollout.request_migration import (
    AsyncRequestMigrator,
    GenerateRequest,
    MoveReport,
    RequestMigrator,
    RequestOutput,
)

__all__ = [
    "AsyncRequestMigrator",
    "CostModel",
    "GenerateRequest",
    "MoveReport",
    "RebalancePolicy",
    "Rebalancer",
    "RequestMigrator",
    "RequestOutput",
]
