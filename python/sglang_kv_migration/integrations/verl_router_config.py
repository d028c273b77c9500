"""The router YAML of `KVMigrationLoadBalancer` (verl's `rollout.router_config_path`):
its keys, their types and ranges, checked whole as it is read.

verl 0.9.1 reads the YAML in its driver and hands it, as one dict, to the balancer's
constructor inside a Ray actor; nothing of ours runs in the driver between the two, and
a constructor that raises kills the actor, which verl reports only as `ActorDiedError`
on the first rollout call. So the check runs in two places:

- before the run, on the file verl will read:

      python -m sglang_kv_migration.integrations.verl_router_config kv_migration_router.yaml

  prints the settings, or exits 2 with one line naming the key;
- in the actor: a file that fails the check does not kill it; every call of verl's
  raises `RouterConfigError` with the same line, and the actor logs it at start-up.

Nothing here imports SGLang, verl or Ray (the YAML parser only in `main`).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Mapping
from typing import Any

from sglang_kv_migration.rollout.cost_model import CostModel, PrefillCosts

DEFAULT_ROUTING_CACHE_SIZE = 10_000  # verl's default sticky-map size
# The key verl itself reads (the class to load); every other key is ours.
ROUTER_CLASS_KEY = "router_class"


class RouterConfigError(ValueError):
    """A router YAML key this balancer does not have, or a value of the wrong type or
    out of range; the message names the key."""


@dataclasses.dataclass(frozen=True)
class BalancerConfig:
    """The router YAML's keys (besides `router_class`)."""

    # Re-pin a session only when its server has more than this many requests in flight
    # beyond the least-loaded server's (and moving it pays: `verl_balancer.py`).
    repin_margin: int = 2
    max_cache_size: int = DEFAULT_ROUTING_CACHE_SIZE
    # Longest a move may take before the request goes to the new server without it.
    move_timeout_s: float = 30.0
    # The servers' --api-key / --admin-api-key, if set (the migration routes are admin
    # routes).
    api_key: str | None = None
    admin_api_key: str | None = None
    # Migrate only when it is this much cheaper than re-prefill (`CostModel.margin`).
    cost_margin: float = 1.0
    # Re-prefill seconds per token on the rollout servers (None: the cost model's prior).
    # It also prices a load gain: the tokens in flight a move takes a turn away from.
    prefill_seconds_per_token: float | None = None

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> BalancerConfig:
        """The settings of a router YAML read as a dict; `RouterConfigError` naming the
        first key that is unknown, of the wrong type or out of range."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in config:
            if key != ROUTER_CLASS_KEY and key not in known:
                raise RouterConfigError(_unknown_key(str(key), known))
        values = {k: v for k, v in config.items() if k in known}
        for key, value in values.items():
            _check_value(key, value)
        return cls(**values)

    def cost_model(self) -> CostModel:
        prefill = PrefillCosts()
        if self.prefill_seconds_per_token is not None:
            prefill = PrefillCosts(seconds_per_token=self.prefill_seconds_per_token)
        return CostModel(prefill=prefill, margin=self.cost_margin)


# key -> (accepted types, whether None is allowed, the range check and its wording)
_INT, _NUMBER, _TEXT = (int,), (int, float), (str,)
_RULES: dict[str, tuple[tuple[type, ...], bool, Any, str]] = {
    "repin_margin": (_INT, False, lambda v: v >= 0, "an integer >= 0"),
    "max_cache_size": (_INT, False, lambda v: v >= 1, "an integer >= 1"),
    "move_timeout_s": (_NUMBER, False, lambda v: v > 0, "a number of seconds > 0"),
    "api_key": (_TEXT, True, None, "a string"),
    "admin_api_key": (_TEXT, True, None, "a string"),
    "cost_margin": (_NUMBER, False, lambda v: v > 0, "a number > 0"),
    "prefill_seconds_per_token": (_NUMBER, True, lambda v: v > 0, "a number of seconds > 0"),
}


def _check_value(key: str, value: Any) -> None:
    types, nullable, in_range, wording = _RULES[key]
    if value is None and nullable:
        return
    ok = isinstance(value, types) and not isinstance(value, bool)
    if not ok or (in_range is not None and not in_range(value)):
        raise RouterConfigError(f"router config key {key!r} must be {wording}, got {value!r}")


def _unknown_key(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    listed = ", ".join([ROUTER_CLASS_KEY, *sorted(known)])
    return f"unknown router config key {key!r}{hint}; the keys are: {listed}"


def main(argv: list[str] | None = None) -> int:
    """Check a router YAML before the run: 0 and its settings, or 2 and the problem."""
    import yaml

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {__spec__.name if __spec__ else __name__} ROUTER_YAML")
        return 2
    try:
        with open(args[0]) as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise RouterConfigError(f"a router config is a mapping of keys, got {raw!r:.80}")
        if not raw.get(ROUTER_CLASS_KEY):
            raise RouterConfigError(f"{ROUTER_CLASS_KEY!r} is missing: verl loads that class")
        config = BalancerConfig.from_mapping(raw)
    except (OSError, yaml.YAMLError, RouterConfigError) as e:
        print(f"{args[0]}: {e}", file=sys.stderr)
        return 2
    print(f"{args[0]}: {ROUTER_CLASS_KEY}={raw.get(ROUTER_CLASS_KEY)!r} {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
