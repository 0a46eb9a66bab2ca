"""The server's errors: an HTTP status and a body in OpenAI's shape; a client gone."""

from __future__ import annotations

from . import limits


class APIError(Exception):
    """An OpenAI-shaped error response: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        # a message may quote what the client sent: a lone surrogate ("\ud800") cannot be written as
        # UTF-8, so it is shown escaped rather than failing the response (a 500)
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = dict(headers or {})
        if status == 503:
            self.headers.setdefault("Retry-After", str(limits.RETRY_AFTER_SECONDS))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Disconnected(Exception):
    """The client went away: nothing more is sent to it."""


def internal_error(e: Exception) -> APIError:
    """What a client sees of an unexpected exception: its type only (the log has the traceback)."""
    return APIError(
        500,
        f"internal server error ({type(e).__name__}); the server's log has the details",
        kind="server_error",
        code="internal_error",
    )
