"""Can a system user reach the model and run the interpreter? Decided from modes, owners and the user's groups the
way the kernel decides it (the owner bits for the owner, else the group bits for a member, else the other bits;
search permission on every directory a path walks through, symlinks followed to their targets), so a model the
service could not read is caught before `systemctl start` finds out. POSIX ACLs are not read: a path only an ACL
opens is still reported, and the chmod fixes are harmless there."""

from __future__ import annotations

import errno
import os
import pwd
import shlex
import stat
import sys
from collections import deque
from dataclasses import dataclass

from ..errors import ModelError, ServiceError

# need -> (permission bit, chmod letter, what is wrong)
_NEEDS = {
    "read": (4, "r", "file not readable"),
    "list": (4, "r", "directory not listable"),
    "search": (1, "x", "directory not searchable"),
    "execute": (1, "x", "not executable"),
}
_SHIFT = {"u": 6, "g": 3, "o": 0}
_MAX_LINKS = 40  # the kernel's limit on symlinks followed in one lookup


@dataclass(frozen=True)
class AccessProblem:
    """One path that keeps the user out: `need` is "read" (a file), "search" (x on a directory), "list" (r on a
    directory) or "execute"; `who` is the permission class that applies to the user (u, g or o)."""

    path: str
    need: str
    who: str = "o"

    def describe(self) -> str:
        _bit, letter, what = _NEEDS[self.need]
        return f"{self.path}: {what} (needs {self.who}+{letter})"


@dataclass(frozen=True)
class Identity:
    """Who the kernel sees: `uid` None is a user that does not exist yet and so owns nothing."""

    name: str
    uid: int | None
    gids: frozenset[int]


# What `useradd --system --user-group` makes: a new uid and a new group, neither owning anything yet, so only the
# "other" bits count for it.
NEW_SYSTEM_USER = Identity(name="(new system user)", uid=None, gids=frozenset())


def identity_of(user: str) -> Identity:
    """The user's uid, primary group and supplementary groups; ServiceError when there is no such user."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ServiceError(f"user {user!r} does not exist: create it (useradd --system {user}) or pick another") from None
    return Identity(name=user, uid=entry.pw_uid, gids=frozenset(os.getgrouplist(user, entry.pw_gid)))


def _identity_or_new(user: str) -> Identity:
    try:
        return identity_of(user)
    except ServiceError:
        return NEW_SYSTEM_USER


def _class(st: os.stat_result, who: Identity) -> str:
    if who.uid is not None and st.st_uid == who.uid:
        return "u"
    if st.st_gid in who.gids:
        return "g"
    return "o"


def _allowed(st: os.stat_result, who: Identity, need: str) -> bool:
    if who.uid == 0:
        # Root reads and searches everything; it executes a file only when some x bit is set.
        return need != "execute" or bool(st.st_mode & 0o111)
    return bool(st.st_mode >> _SHIFT[_class(st, who)] & _NEEDS[need][0])


class _Check:
    def __init__(self, who: Identity):
        self.who = who
        self.found: dict[tuple[str, str], AccessProblem] = {}

    def need(self, path: str, st: os.stat_result, need: str) -> None:
        if not _allowed(st, self.who, need):
            self.found.setdefault((path, need), AccessProblem(path, need, _class(st, self.who)))

    def resolve(self, path: str) -> str:
        """Walk `path` component by component as a lookup does, needing search on every directory passed
        through, including those a symlink's target passes through; return where it ends."""
        # Not os.path.abspath: collapsing "a/.." before looking "a" up is wrong when "a" is a symlink.
        parts = deque(os.path.join(os.getcwd(), path).split("/")[1:])
        current = "/"
        links = 0
        while parts:
            name = parts.popleft()
            if name in ("", "."):
                continue
            self.need(current, os.stat(current), "search")
            if name == "..":
                current = os.path.dirname(current)
                continue
            candidate = os.path.join(current, name)
            st = os.lstat(candidate)
            if not stat.S_ISLNK(st.st_mode):
                current = candidate
                continue
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = "/"
            parts.extendleft(reversed(target.split("/")))
        return current

    def tree(self, top: str) -> None:
        """Every directory under `top` listable and searchable, every file readable, symlinks followed."""
        seen: set[tuple[int, int]] = set()
        stack = [top]
        while stack:
            directory = stack.pop()
            st = os.stat(directory)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            self.need(directory, st, "list")
            self.need(directory, st, "search")
            subdirs = []
            for entry in sorted(os.scandir(directory), key=lambda e: e.name):
                path = entry.path
                if entry.is_symlink():
                    try:
                        path = self.resolve(path)
                    except OSError:
                        continue  # a dangling link is no permission problem
                entry_st = os.stat(path)
                if stat.S_ISDIR(entry_st.st_mode):
                    subdirs.append(path)
                elif stat.S_ISREG(entry_st.st_mode):
                    self.need(path, entry_st, "read")
            stack.extend(reversed(subdirs))


def access_problems(model_dir, who: Identity, interpreter: str | None = None) -> list[AccessProblem]:
    """What keeps `who` from reading every file of `model_dir` and executing `interpreter` (None: this one)."""
    check = _Check(who)
    try:
        top = check.resolve(os.fspath(model_dir))
    except OSError as exc:
        raise ModelError(f"model directory {model_dir} cannot be opened ({exc.strerror}): check the path") from exc
    if not os.path.isdir(top):
        raise ModelError(f"model directory {model_dir} is not a directory: pass the checkpoint directory")
    exe = interpreter or sys.executable
    try:
        check.tree(top)
        try:
            target = check.resolve(exe)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ServiceError(f"interpreter {exe} does not exist ({exc.strerror})") from exc
        check.need(target, os.stat(target), "execute")
    except PermissionError as exc:
        raise ServiceError(
            f"cannot look at {exc.filename} to check what user {who.name} can read ({exc.strerror}): run as root"
        ) from exc
    return list(check.found.values())


def model_access_problems(model_dir, user: str, interpreter: str | None = None) -> list[AccessProblem]:
    """What keeps system user `user` from reading every file of `model_dir` and executing `interpreter` (None:
    sys.executable). Empty when nothing does. ServiceError when the user does not exist."""
    return access_problems(model_dir, identity_of(user), interpreter)


def _fixes(model_dir, user: str, problems) -> tuple[str | None, dict[str, tuple[str, str]]]:
    """(the model directory to open recursively, or None; {other path: (class, letters)}). A user that does not
    exist yet is taken as the system user install-service creates, for whom only the "other" bits count."""
    top = os.path.realpath(model_dir)
    who = _identity_or_new(user)
    recursive = None
    single: dict[str, tuple[str, str]] = {}
    for problem in problems:
        if problem.path == top or problem.path.startswith(top.rstrip("/") + "/"):
            recursive = top
            continue
        cls = _class(os.stat(problem.path), who)
        letter = _NEEDS[problem.need][1]
        _cls, letters = single.get(problem.path, (cls, ""))
        if letter not in letters:
            letters = "".join(sorted(letters + letter, key="rx".index))
        single[problem.path] = (cls, letters)
    return recursive, single


def access_fix_commands(model_dir, user: str, problems) -> list[str]:
    """The shell commands (run as root) that fix `problems`: `chmod -R a+rX` on the model directory when anything
    inside it is closed, and the one missing bit of the user's class on each path outside it (an ancestor, the
    interpreter, a symlink's target)."""
    recursive, single = _fixes(model_dir, user, problems)
    commands = [f"chmod -R a+rX {shlex.quote(recursive)}"] if recursive else []
    commands += [f"chmod {cls}+{letters} {shlex.quote(path)}" for path, (cls, letters) in single.items()]
    return commands


def fix_access(model_dir, user: str, problems) -> None:
    """Apply what access_fix_commands prints, with os.chmod."""
    recursive, single = _fixes(model_dir, user, problems)
    if recursive:
        # Like chmod -R: symlinks inside are not followed (their targets outside are fixed one by one below).
        for directory, dirs, files in os.walk(recursive):
            _add_bits(directory, 0o555)
            for name in (*dirs, *files):
                path = os.path.join(directory, name)
                if not os.path.islink(path) and not os.path.isdir(path):
                    mode = os.stat(path).st_mode
                    _add_bits(path, 0o555 if mode & 0o111 else 0o444)
    for path, (cls, letters) in single.items():
        bits = sum(_NEEDS["read" if letter == "r" else "execute"][0] for letter in letters)
        _add_bits(path, bits << _SHIFT[cls])


def _add_bits(path: str, bits: int) -> None:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode | bits != mode:
        os.chmod(path, mode | bits)
