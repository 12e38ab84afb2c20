"""The install record: what install-service wrote for a service name (files with their sha256, directories it
created, the user it created), so that uninstall-service removes exactly that, and nothing an edited record names."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from ..errors import ServiceError
from .unit import CONFIG_DIR, UNIT_DIR, under_root


def record_path(name: str) -> str:
    return f"{CONFIG_DIR}/{name}.installed.json"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record_text(name: str, files: Iterable[tuple[str, str]], created_dirs: Iterable[str],
                user_created: str | None) -> str:
    """The record of an install writing `files` ((path, content) pairs) for service `name`."""
    record = {
        "name": name,
        "files": [{"path": path, "sha256": digest(content.encode("utf-8"))} for path, content in files],
        "created_dirs": list(created_dirs),
        "user_created": user_created,
    }
    return json.dumps(record, indent=2) + "\n"


def read_record(root: str, name: str) -> dict | None:
    """The record under `root` for service `name`, None where there is none."""
    path = under_root(root, record_path(name))
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ServiceError(f"install record {path} is unreadable ({exc}): fix or delete it, then rerun") from exc


def trusted_entries(record: object, root: str, name: str) -> tuple[list[dict], list[str]]:
    """The record's (file entries, created directories), refused unless they name only what install-service
    writes for `name`: an edited record must not turn uninstall into `rm` of arbitrary paths."""
    ours = {f"{UNIT_DIR}/{name}.service", f"{CONFIG_DIR}/{name}.env"}
    ancestors = {str(parent) for path in (*ours, record_path(name)) for parent in Path(path).parents} - {"/"}
    entries = record.get("files", []) if isinstance(record, dict) else None
    dirs = record.get("created_dirs", []) if isinstance(record, dict) else None
    if (
        not isinstance(entries, list)
        or not isinstance(dirs, list)
        or not all(isinstance(e, dict) and e.get("path") in ours for e in entries)
        or not set(dirs) <= ancestors
    ):
        raise ServiceError(
            f"install record {under_root(root, record_path(name))} lists paths install-service never writes: "
            "it was edited; remove the service's files by hand"
        )
    return entries, dirs
