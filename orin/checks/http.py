"""One HTTP exchange for smoke's checks (stdlib only: a smoke run needs no client library): the status and body
of any answer, error statuses included, or Unreachable when no answer came."""

from __future__ import annotations

import urllib.error
import urllib.request

from ..errors import OrinError


class Unreachable(OrinError):
    """No HTTP answer: refused, timed out, an unknown host."""


def exchange(url: str, method: str, data: bytes | None, headers: dict[str, str], api_key: str | None,
             timeout_s: float) -> tuple[int, bytes]:
    if api_key:
        headers = {**headers, "Authorization": f"Bearer {api_key}"}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise Unreachable(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from exc
