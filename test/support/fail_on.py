"""An httpx transport for the migration client: real HTTP, except one route answers 503."""

from __future__ import annotations

import httpx

# Routes whose trip a wire feature saves, and that feature (features.SOURCE_COMMIT,
# features.SOURCE_ALLOCATE; no package import here).
SAVED_BY = {"/commit": "source_commit", "/allocate_token_for_transfer": "source_allocate"}


class FailOn(httpx.BaseTransport):
    """Real HTTP, except `path` answers 503 ("injected failure"). Failing `/commit` also
    hides feature "source_commit" from session info (servers that commit through the
    mailbox need no commit trip), and failing the allocate hides "source_allocate" (a
    source that allocates on the target itself needs no allocate trip): the client must
    be made to send the one that fails."""

    def __init__(self, path: str):
        self.path = path
        self.hits = 0
        self.paths: list[str] = []
        self._real = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path == self.path:
            self.hits += 1
            return httpx.Response(503, json={"success": False, "message": "injected failure"})
        response = self._real.handle_request(request)
        hidden = SAVED_BY.get(self.path)
        if hidden and request.url.path == "/get_transfer_session_info":
            response.read()
            info = response.json()
            info["features"] = [f for f in info.get("features", []) if f != hidden]
            return httpx.Response(response.status_code, json=info)
        return response

    def close(self) -> None:
        self._real.close()
