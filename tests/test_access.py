"""orin.service.access: whether a system user can read a model directory and run the interpreter, decided from modes,
owners and groups; the fixes it prints and applies; and, as root, the verdict checked against a real
unprivileged user running cat and an interpreter."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from orin.errors import ModelError, ServiceError
from orin.service.access import (
    NEW_SYSTEM_USER,
    AccessProblem,
    Identity,
    access_fix_commands,
    access_problems,
    fix_access,
    model_access_problems,
)

STRANGER = Identity(name="stranger", uid=54321, gids=frozenset({54321}))


@pytest.fixture
def base(searchable_tmp):
    return searchable_tmp


def make_model(base: Path) -> tuple[Path, Path, Path]:
    """base/locked (0700)/models/m with a 0644 config.json and a 0600 model.safetensors; an executable tool
    beside it. Returns (model dir, locked ancestor, unreadable file)."""
    locked = base / "locked"
    model = locked / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}\n")
    (model / "config.json").chmod(0o644)
    weights = model / "model.safetensors"
    weights.write_bytes(b"weights")
    weights.chmod(0o600)
    (locked / "models").chmod(0o755)
    model.chmod(0o755)
    locked.chmod(0o700)
    return model, locked, weights


def tool(base: Path) -> str:
    path = base / "bin" / "python"
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in (root, *root.rglob("*"))}


# ------------------------------------------------------------------------------------------ the decision


def test_reports_the_closed_ancestor_and_the_unreadable_file(base):
    model, locked, weights = make_model(base)
    assert access_problems(model, STRANGER, tool(base)) == [
        AccessProblem(str(locked), "search", "o"),
        AccessProblem(str(weights), "read", "o"),
    ]
    assert AccessProblem(str(locked), "search", "o").describe() == f"{locked}: directory not searchable (needs o+x)"
    assert AccessProblem(str(weights), "read", "o").describe() == f"{weights}: file not readable (needs o+r)"


def test_an_open_model_has_no_problems(base):
    model, locked, weights = make_model(base)
    locked.chmod(0o711)
    weights.chmod(0o644)
    assert access_problems(model, STRANGER, tool(base)) == []
    assert access_problems(model, NEW_SYSTEM_USER, tool(base)) == []


def test_the_class_that_applies_is_the_only_one_that_counts(base):
    """The kernel looks at the owner bits for the owner, else the group bits for a member, else the other bits:
    a member of a group denied r cannot read even when others can."""
    model, locked, weights = make_model(base)
    locked.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(weights, 54322, -1)  # an owner that is not root, whom nothing stops
    owner = Identity(name="owner", uid=weights.stat().st_uid, gids=frozenset())
    member = Identity(name="member", uid=54321, gids=frozenset({weights.stat().st_gid}))
    weights.chmod(0o066)
    assert access_problems(model, owner, tool(base)) == [AccessProblem(str(weights), "read", "u")]
    assert access_problems(model, member, tool(base)) == []
    weights.chmod(0o604)
    assert access_problems(model, member, tool(base)) == [AccessProblem(str(weights), "read", "g")]
    assert access_problems(model, STRANGER, tool(base)) == []


def test_root_reads_everything_but_executes_only_with_an_x_bit(base):
    model, _locked, weights = make_model(base)
    root = Identity(name="root", uid=0, gids=frozenset({0}))
    weights.chmod(0o000)
    exe = tool(base)
    assert access_problems(model, root, exe) == []
    Path(exe).chmod(0o644)
    assert access_problems(model, root, exe) == [AccessProblem(exe, "execute", "u")]


def test_a_closed_directory_inside_the_model_needs_list_and_search(base):
    model, locked, _ = make_model(base)
    locked.chmod(0o755)
    (model / "model.safetensors").chmod(0o644)
    sub = model / "thinker"
    sub.mkdir()
    (sub / "model.safetensors").write_bytes(b"w")
    (sub / "model.safetensors").chmod(0o644)
    sub.chmod(0o700)
    assert access_problems(model, STRANGER, tool(base)) == [
        AccessProblem(str(sub), "list", "o"),
        AccessProblem(str(sub), "search", "o"),
    ]


def test_symlinks_are_followed_to_their_targets_and_every_directory_on_the_way(base):
    """A venv's python links into pyenv or /usr, a model dir may be a link to a versioned one, weights may link
    into a blob store: the link's own directories and the target's all need search."""
    model, locked, weights = make_model(base)
    (base / "current").symlink_to(model)
    blobs = base / "private" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc").write_bytes(b"w")
    (blobs / "abc").chmod(0o644)
    (base / "private").chmod(0o700)
    (model / "extra.safetensors").symlink_to(blobs / "abc")
    (model / "dangling.json").symlink_to(base / "nowhere")
    pyenv = base / "pyenv" / "bin"
    pyenv.mkdir(parents=True)
    (pyenv / "python3.11").write_text("#!/bin/sh\n")
    (pyenv / "python3.11").chmod(0o700)
    (base / "pyenv").chmod(0o750)
    venv = base / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").symlink_to("../../pyenv/bin/python3.11")
    (venv / "python").symlink_to("python3")
    assert access_problems(base / "current", STRANGER, str(venv / "python")) == [
        AccessProblem(str(locked), "search", "o"),
        AccessProblem(str(base / "private"), "search", "o"),
        AccessProblem(str(weights), "read", "o"),
        AccessProblem(str(base / "pyenv"), "search", "o"),
        AccessProblem(str(pyenv / "python3.11"), "execute", "o"),
    ]


def test_unknown_user_missing_model_and_missing_interpreter_are_clear_errors(base):
    model, _, _ = make_model(base)
    with pytest.raises(ServiceError, match="user 'orin-no-such-user' does not exist"):
        model_access_problems(model, "orin-no-such-user")
    with pytest.raises(ModelError, match="model directory .*nope cannot be opened"):
        access_problems(base / "nope", STRANGER)
    (base / "file").write_text("")
    with pytest.raises(ModelError, match="is not a directory"):
        access_problems(base / "file", STRANGER)
    with pytest.raises(ServiceError, match="interpreter .*no-python does not exist"):
        access_problems(model, NEW_SYSTEM_USER, str(base / "no-python"))


def test_model_access_problems_looks_the_user_up(base):
    """The files are ours: as root everything is readable, as anyone else the open owner bits apply."""
    model, _, _ = make_model(base)
    assert model_access_problems(model, pwd.getpwuid(os.geteuid()).pw_name, tool(base)) == []


# ------------------------------------------------------------------------------------------------ fixes


def test_fix_commands_are_minimal_and_quoted(base):
    model, locked, weights = make_model(base)
    assert access_fix_commands(model, "orin-no-such-user", []) == []
    problems = access_problems(model, NEW_SYSTEM_USER, tool(base))
    assert access_fix_commands(model, "orin-no-such-user", problems) == [
        f"chmod -R a+rX {model}",
        f"chmod o+x {locked}",
    ]
    # Only the ancestor: no recursive chmod.
    weights.chmod(0o644)
    only_parent = access_problems(model, NEW_SYSTEM_USER, tool(base))
    assert access_fix_commands(model, "orin-no-such-user", only_parent) == [f"chmod o+x {locked}"]
    odd = base / "it's a dir"
    shutil.copytree(model, odd / "m")
    (odd / "m" / "model.safetensors").chmod(0o600)
    odd.chmod(0o700)
    problems = access_problems(odd / "m", NEW_SYSTEM_USER, tool(base))
    assert access_fix_commands(odd / "m", "orin-no-such-user", problems) == [
        f"chmod -R a+rX '{base}/it'\"'\"'s a dir/m'",
        f"chmod o+x '{base}/it'\"'\"'s a dir'",
    ]


def test_fix_commands_use_the_users_class(base):
    """A member of the directory's group needs g+x; o+x would not let it through."""
    model, locked, weights = make_model(base)
    weights.chmod(0o644)
    member = Identity(name="member", uid=54321, gids=frozenset({locked.stat().st_gid}))
    problems = access_problems(model, member, tool(base))
    assert problems == [AccessProblem(str(locked), "search", "g")]
    assert problems[0].describe().endswith("(needs g+x)")


def test_fix_access_does_what_the_commands_do(base):
    model, _, _ = make_model(base)
    (model / "sub").mkdir(mode=0o700)
    (model / "sub" / "tool").write_text("")
    (model / "sub" / "tool").chmod(0o700)
    (model / "link").symlink_to("sub/tool")
    twin = base / "twin"
    shutil.copytree(base / "locked", twin, symlinks=True)
    shutil.copystat(base / "locked", twin)
    twin_model = twin / "models" / "m"

    fix_access(model, "orin-no-such-user", access_problems(model, NEW_SYSTEM_USER, tool(base)))
    commands = access_fix_commands(twin_model, "orin-no-such-user",
                                   access_problems(twin_model, NEW_SYSTEM_USER, tool(base)))
    subprocess.run(["bash", "-ec", "\n".join(commands)], check=True)

    assert access_problems(model, NEW_SYSTEM_USER, tool(base)) == []
    assert modes(base / "locked") == modes(twin)
    assert modes(base / "locked")["models/m/sub/tool"] == 0o755
    assert modes(base / "locked")["models/m/config.json"] == 0o644
    assert modes(base / "locked")["."] == 0o701  # the ancestor gets search only, not list


# ------------------------------------------------------------------------ against a real unprivileged user


@pytest.fixture(scope="module")
def system_user():
    """A real system user (and its own group), removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a system user to compare the verdict with what the kernel does")
    useradd, userdel = shutil.which("useradd"), shutil.which("userdel")
    if not useradd or not userdel:
        pytest.skip("useradd/userdel not installed (Debian/Ubuntu package: passwd)")
    name = f"orin-acc-{os.getpid()}"
    subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run([userdel, name], check=False, capture_output=True)


def run_as(user: str, argv: list[str]) -> subprocess.CompletedProcess:
    """Run argv with exactly the user's credentials (its groups, not root's), as systemd's User= would."""
    entry = pwd.getpwnam(user)
    return subprocess.run(argv, user=entry.pw_uid, group=entry.pw_gid,
                          extra_groups=os.getgrouplist(user, entry.pw_gid), capture_output=True, text=True)


def can_read(user: str, path: Path) -> bool:
    return run_as(user, ["/bin/cat", str(path)]).returncode == 0


def test_the_verdict_matches_the_kernel_and_fix_access_opens_it(base, system_user):
    model, locked, weights = make_model(base)
    problems = model_access_problems(model, system_user, "/bin/cat")
    assert {(p.path, p.need) for p in problems} == {(str(locked), "search"), (str(weights), "read")}
    denied = run_as(system_user, ["/bin/cat", str(weights)])
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    assert not can_read(system_user, model / "config.json")  # readable itself, but behind the locked ancestor

    fix_access(model, system_user, problems)
    assert model_access_problems(model, system_user, "/bin/cat") == []
    assert can_read(system_user, weights) and can_read(system_user, model / "config.json")


def test_the_printed_commands_open_it_too(base, system_user):
    model, _locked, weights = make_model(base)
    commands = access_fix_commands(model, system_user, model_access_problems(model, system_user, "/bin/cat"))
    assert not can_read(system_user, weights)
    subprocess.run(["bash", "-ec", "\n".join(commands)], check=True)
    assert model_access_problems(model, system_user, "/bin/cat") == []
    assert can_read(system_user, weights)


def test_group_bits_decide_for_a_member_even_when_others_may_read(base, system_user):
    model, locked, weights = make_model(base)
    locked.chmod(0o755)
    os.chown(weights, 0, pwd.getpwnam(system_user).pw_gid)
    weights.chmod(0o604)
    assert model_access_problems(model, system_user, "/bin/cat") == [AccessProblem(str(weights), "read", "g")]
    assert not can_read(system_user, weights)
    weights.chmod(0o600)
    os.chown(weights, 0, 0)
    weights.chmod(0o604)
    assert model_access_problems(model, system_user, "/bin/cat") == []
    assert can_read(system_user, weights)


def test_an_interpreter_behind_a_closed_directory(base, system_user):
    """A venv whose python links into a directory the user cannot search (pyenv under /root): it cannot start."""
    model, locked, weights = make_model(base)
    locked.chmod(0o755)
    weights.chmod(0o644)
    hidden = base / "home" / "bin"
    hidden.mkdir(parents=True)
    shutil.copy("/bin/true", hidden / "python3.11")
    (base / "home").chmod(0o700)
    (base / "venv").mkdir()
    (base / "venv" / "python").symlink_to(hidden / "python3.11")
    python = str(base / "venv" / "python")
    problems = model_access_problems(model, system_user, python)
    assert problems == [AccessProblem(str(base / "home"), "search", "o")]
    with pytest.raises(PermissionError):
        run_as(system_user, [python])
    commands = access_fix_commands(model, system_user, problems)
    assert commands == [f"chmod o+x {base / 'home'}"]
    subprocess.run(["bash", "-ec", "\n".join(commands)], check=True)
    assert model_access_problems(model, system_user, python) == []
    assert run_as(system_user, [python]).returncode == 0
