"""SGLang's two API keys as a client holds them: which routes take the admin key
(`ADMIN_ROUTES`), which key a call carries (`ApiKeys`) and what to do about a refusal
(`auth_hint`)."""

from __future__ import annotations

from dataclasses import dataclass

# SGLang 0.5.12's auth levels (sglang/srt/utils/auth.py) for the routes this package
# calls: these are ADMIN_OPTIONAL (with --admin-api-key set, only the admin key opens them;
# with only --api-key, the API key does); /generate, /v1/loads and /get_load are NORMAL
# (only the API key, when set); /metrics and /health are always open.
ADMIN_ROUTES = frozenset(
    {
        "/get_transfer_session_info",
        "/get_request_extra_token_size",
        "/allocate_token_for_transfer",
        "/transfer_request_kvcache",
        "/commit",
        "/abort_transfer",
        "/abort_request",
        "/flush_cache",
    }
)


@dataclass(frozen=True)
class ApiKeys:
    """SGLang's two keys as a client holds them: `api_key` for /generate and the load
    routes, `admin_api_key` for the admin routes (`ADMIN_ROUTES`). One key alone is sent
    everywhere, which is what a server with one key set accepts."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def key_for(self, path: str) -> str | None:
        if route_of(path) in ADMIN_ROUTES:
            return self.admin_api_key or self.api_key
        return self.api_key or self.admin_api_key

    def headers(self, path: str) -> dict[str, str]:
        key = self.key_for(path)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def sent(self, path: str) -> str:
        """Which key a call to `path` carries, in words (for error messages)."""
        key = self.key_for(path)
        if not key:
            return "no key"
        if key == self.admin_api_key:
            return "the admin API key (admin_api_key / --admin-api-key)"
        return "the API key (api_key / --api-key)"


def route_of(path: str) -> str:
    return "/" + path.split("?", 1)[0].strip("/")


def auth_hint(path: str) -> str:
    """What to do about a 401/403 from `path` (SGLang's rules, see `ADMIN_ROUTES`)."""
    route = route_of(path)
    if route in ADMIN_ROUTES:
        return (
            f"{route} takes the admin API key when the server sets --admin-api-key (else "
            "its --api-key): pass admin_api_key= / --admin-api-key"
        )
    return f"{route} takes the server's --api-key: pass api_key= / --api-key"
