"""The docs cannot drift from the tool (issue 36).

README.md, BENCHMARKS.md and docs/*.md are collected and checked for:
- every relative markdown link: its target exists, and a `#anchor` names a heading of the target (GitHub's anchor
  rules: lower case, punctuation dropped, spaces to hyphens, `-1`, `-2` for repeats);
- every `orin-omni COMMAND [--option ...]` in a code span or a fenced code block (and `python -m orin.cli ...`):
  the command exists in the Click group of orin/cli.py and each `--option` after it, on the same command line
  (a code block's `\\` continuations joined), belongs to that command, or is `--help`;
- every `--option` named alone in code (the option tables) is some orin-omni command's option, or one of a short
  list of other tools' options.
benchmarks/LOG.md (the run history) is checked for links only: its commands are those of their day.

Fast and offline: the checker is plain functions over text; the CLI is imported once, lazily (orin.cli imports
no torch). The last tests plant a broken link, a bad anchor, an unknown command and an unknown option in a
scratch file, so the check itself cannot pass silently.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
BENCHMARKS_MAX_LINES = 200


def doc_files(root: Path = ROOT) -> list[Path]:
    """The pages whose links and commands are checked."""
    return [root / "README.md", root / "BENCHMARKS.md", *sorted((root / "docs").glob("*.md"))]


def link_only_files(root: Path = ROOT) -> list[Path]:
    """Pages whose links are checked but whose commands are history."""
    return [p for p in (root / "benchmarks" / "LOG.md",) if p.exists()]


# ------------------------------------------------------------------ markdown structure

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def split_blocks(text: str) -> tuple[list[tuple[int, str]], list[list[tuple[int, str]]]]:
    """The prose lines (code-block lines blanked, so line numbers hold) and the fenced code blocks, each a list of
    (line number, line). An unclosed fence runs to the end of the file, as GitHub renders it."""
    prose: list[tuple[int, str]] = []
    blocks: list[list[tuple[int, str]]] = []
    fence: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                blocks.append([])
                prose.append((n, ""))
            else:
                prose.append((n, line))
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):]:
            fence = None
            prose.append((n, ""))
        else:
            blocks[-1].append((n, line))
            prose.append((n, ""))
    return prose, blocks


def paragraphs(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Runs of non-blank prose lines joined by newlines, with their first line number."""
    out, start, lines = [], None, []
    for n, line in prose + [(0, "")]:
        if line.strip():
            start = n if start is None else start
            lines.append(line)
        elif lines:
            out.append((start, "\n".join(lines)))
            start, lines = None, []
    return out


_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def code_spans(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Every inline code span, one line (a span may wrap), with the line it starts on. A table's `\\|` is `|`."""
    spans = []
    for start, para in paragraphs(prose):
        for m in _SPAN.finditer(para):
            line = start + para.count("\n", 0, m.start())
            spans.append((line, m.group(2).replace("\\|", "|").replace("\n", " ").strip()))
    return spans


def without_code_spans(text: str) -> str:
    """`text` with its code spans blanked (same length and newlines), so links inside code are not links."""
    return _SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


# ------------------------------------------------------------------ anchors

_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=[\"']([^\"']+)[\"']", re.I)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, every character that is not a letter, a
    mark, a decimal digit, `_`, `-` or a space dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    kept = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in "-_ " or cat[0] in "LM" or cat == "Nd":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page offers: its headings' (repeats get -1, -2, ...) and explicit `<a id=...>`."""
    prose, _ = split_blocks(text)
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose:
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(_HTML_ANCHOR.findall(line))
    return found


# ------------------------------------------------------------------ links

_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every inline link, image and reference definition outside code."""
    prose, _ = split_blocks(text)
    found = []
    for start, para in paragraphs(prose):
        clean = without_code_spans(para)
        for m in _INLINE_LINK.finditer(clean):
            found.append((start + clean.count("\n", 0, m.start()), m.group(1)))
        for i, line in enumerate(clean.split("\n")):
            m = _REF_DEF.match(line)
            if m:
                found.append((start + i, m.group(1)))
    return found


def check_links(path: Path) -> list[str]:
    """Problems with `path`'s relative links, as 'file:line: message'."""
    text = path.read_text(encoding="utf-8")
    problems = []
    for line, target in links(text):
        if _SCHEME.match(target):
            continue  # http(s), mailto: not checked here (no network)
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path.resolve()
        where = f"{path}:{line}: link {target!r}"
        if not dest.exists():
            problems.append(f"{where}: {dest} does not exist")
            continue
        if not anchor:
            continue
        anchor = unquote(anchor)
        if dest.is_file() and dest.suffix.lower() == ".md":
            if anchor not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading in {dest.name} makes the anchor #{anchor}")
        elif not re.fullmatch(r"L\d+(-L\d+)?", anchor):  # GitHub's line anchors on code files
            problems.append(f"{where}: #{anchor} on a file that is not markdown")
    return problems


# ------------------------------------------------------------------ orin-omni commands

_ENDS = {"|", "||", "&&", ";", "&"}


def cli_group():
    """The Click group behind the `orin-omni` script (orin.cli), imported lazily."""
    import click

    import orin.cli as module

    group = getattr(module, "cli", None)
    if not isinstance(group, click.Group):
        group = next(v for v in vars(module).values() if isinstance(v, click.Group))
    return group


def command_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line, text, in_block) of every piece of code that may hold a command: each code block's logical lines
    (a trailing backslash joins the next line) and each code span."""
    prose, blocks = split_blocks(text)
    out = [(n, span, False) for n, span in code_spans(prose)]
    for block in blocks:
        pending, start = "", None
        for n, line in block:
            start = n if start is None else start
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((start, pending + line, True))
            pending, start = "", None
        if pending:
            out.append((start, pending, True))
    return out


def _tokens(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote (Python, prose): split on blanks, dropping a trailing comment
        return re.split(r"\s+", re.sub(r"(^|\s)#.*$", "", line).strip())


def _is_program(tokens: list[str], i: int) -> bool:
    t = tokens[i]
    if t == "orin-omni" or t.endswith("/bin/orin-omni"):
        return True
    return t == "orin.cli" and i > 0 and tokens[i - 1] == "-m"


def _option_names(token: str) -> list[str]:
    """The long options a token names: `--out`, `--out=DIR`, `[--sym/--asym]`, `--device` in `[--device`."""
    token = token.lstrip("[(")
    if not token.startswith("--") or token == "--":
        return []
    names = []
    for part in re.split(r"[/|]", token):
        m = re.match(r"--([A-Za-z0-9][A-Za-z0-9_-]*)", part)
        if m:
            names.append("--" + m.group(1))
    return names


def _options_of(command) -> set[str]:
    import click

    names = {"--help", "-h"}
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def invocations(line: str, in_block: bool) -> list[tuple[list[str], list[str]]]:
    """Each `orin-omni` invocation in a line: (the words after the program up to the first option, the options
    named after it), stopping at a shell separator (a bare `|` only in code blocks: in a span it separates
    alternatives)."""
    tokens = _tokens(line)
    found = []
    i = 0
    while i < len(tokens):
        if not _is_program(tokens, i):
            i += 1
            continue
        words, options = [], []
        i += 1
        while i < len(tokens):
            t = tokens[i]
            if t in _ENDS and (t != "|" or in_block):
                break
            ends = t.endswith(";") and in_block
            t = t.rstrip(";") if ends else t
            if _is_program(tokens, i):
                break
            names = _option_names(t)
            if names:
                options.extend(names)
            elif not options and not t.startswith("-"):
                words.append(t)
            i += 1
            if ends:
                break
        found.append((words, options))
    return found


def check_commands(path: Path, group=None) -> list[str]:
    """Problems with the `orin-omni` commands and options `path` names, as 'file:line: message'."""
    import click

    group = group or cli_group()
    problems = []
    for line, code, in_block in command_lines(path.read_text(encoding="utf-8")):
        if "orin-omni" not in code and "orin.cli" not in code:
            continue
        for words, options in invocations(code, in_block):
            command, name = group, "orin-omni"
            for word in words:
                if not isinstance(command, click.Group):
                    break
                if word.isupper() or not re.fullmatch(r"[a-z][a-z0-9-]*", word):
                    command = None  # a placeholder (COMMAND) or an argument: nothing to check
                    break
                sub = command.commands.get(word)
                if sub is None:
                    problems.append(f"{path}:{line}: `{name} {word}`: no such command "
                                    f"(commands: {', '.join(sorted(command.commands))})")
                    command = None
                    break
                command, name = sub, f"{name} {word}"
            if command is None:
                continue
            known = _options_of(command)
            for option in options:
                if option not in known:
                    problems.append(f"{path}:{line}: `{name}` has no option {option}")
    return problems


# Options the docs name for other tools, alone in a code span (`--force-reinstall` in pip's advice): the rest of a
# bare `--option` span must be some orin-omni command's option. A line that starts with another program is that
# program's business and is not checked.
FOREIGN_OPTIONS = {"--break-system-packages", "--force-reinstall", "--upgrade-strategy", "--system-site-packages",
                   "--index-url", "--device-url", "--device-model-dir", "--fixtures-dir"}
FOREIGN_PROGRAMS = {"pip", "pip3", "python", "python3", "rsync", "scp", "ssh", "hf", "systemctl", "journalctl",
                    "nvpmodel", "vllm", "pytest", "apt", "apt-get", "curl", "git", "make", "jetson_release", "cat",
                    "df", "export", "cd", "mkdir", "chmod", "chown", "userdel", "useradd", "tee", "jq"}


def check_bare_options(path: Path, group=None) -> list[str]:
    """Problems with `--options` named in code without `orin-omni` before them (the option tables): each must be
    an option of some orin-omni command (`--prefix-*` of at least one), or a known other tool's."""
    group = group or cli_group()
    known = set(_options_of(group))
    for command in group.commands.values():
        known |= _options_of(command)
    problems = []
    for line, code, _ in command_lines(path.read_text(encoding="utf-8")):
        if "orin-omni" in code or "orin.cli" in code or "--" not in code:
            continue
        tokens = _tokens(code)
        head = [t for t in tokens[:2] if t != "sudo"][:1]
        if head and (head[0] in FOREIGN_PROGRAMS or "/" in head[0]):
            continue
        for token in tokens:
            wildcard = token.lstrip("[(").rstrip("])")
            if wildcard.startswith("--") and wildcard.endswith("-*"):
                if not any(k.startswith(wildcard[:-1]) for k in known):
                    problems.append(f"{path}:{line}: no orin-omni option matches {wildcard}")
                continue
            for option in _option_names(token):
                if option not in known and option not in FOREIGN_OPTIONS:
                    problems.append(f"{path}:{line}: {option} is no orin-omni option (nor a known other tool's)")
    return problems


# ------------------------------------------------------------------ the checks


def test_the_docs_exist():
    for path in doc_files():
        assert path.is_file(), path
    assert {p.name for p in (ROOT / "docs").glob("*.md")} >= {
        "jetson.md", "quantize.md", "service.md", "api.md", "architecture.md", "troubleshooting.md"}


@pytest.mark.parametrize("path", doc_files() + link_only_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert check_links(path) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_and_options_exist(path):
    assert check_commands(path) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_options_named_alone_exist(path):
    assert check_bare_options(path) == []


def test_readme_and_benchmarks_stay_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    bench = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines; move reference material to docs/"
    assert len(bench) <= BENCHMARKS_MAX_LINES, f"BENCHMARKS.md has {len(bench)} lines; history goes to LOG.md"


def test_readme_starts_with_make_demo_then_make_test():
    _, blocks = split_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    first = [line.split("#")[0].strip() for _, line in blocks[0] if line.strip()]
    assert first[:2] == ["make demo", "make test"]


# ------------------------------------------------------------------ the check checks itself


def test_slug_follows_github():
    assert slug("Runs 66-75 (H200, 2026-11-25): the talker's end") == "runs-66-75-h200-2026-11-25-the-talkers-end"
    assert slug("Jetson AGX Orin 64 GB — a projection") == "jetson-agx-orin-64-gb--a-projection"
    assert slug("5. orin-omni, dry run first") == "5-orin-omni-dry-run-first"
    assert slug("The `orin_omni` **wheel**") == "the-orin_omni-wheel"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## B\n") == {"a", "a-1", "b"}


def test_a_planted_broken_link_and_bad_anchor_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Its section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "Good: [other](other.md), [section](other.md#its-section), [here](#page), [web](https://example.com/x).\n"
        "Broken: [gone](missing.md) and [bad anchor](other.md#no-such-section).\n\n"
        "`[not a link](nowhere.md)` is code.\n\n"
        "```\n[also code](nowhere.md)\n```\n"
    )
    problems = check_links(page)
    assert len(problems) == 2, problems
    assert "missing.md" in problems[0] and ":4:" in problems[0]
    assert "#no-such-section" in problems[1]


def test_planted_unknown_commands_and_options_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "Run `orin-omni plan MODEL --budget 24GiB --json` and `orin-omni COMMAND --help`.\n"
        "Unknown: `orin-omni frobnicate --fast`, and `orin-omni serve --model-dir D\n--no-such-flag`.\n\n"
        "| cmd |\n|---|\n| `orin-omni smoke [--url URL \\| --model-dir DIR]` |\n\n"
        "```sh\n"
        "sudo /opt/orin-omni/venv/bin/orin-omni install-service --model-dir /m --budget 24GiB \\\n"
        "    --power-mode MAXN --bogus   # a continuation line\n"
        "cd /opt/orin-omni && orin-omni doctor --json | tee out.txt --not-ours\n"
        "python3 -m orin.cli bench --synthetic --budget-sliced 18GiB --skip-hf --warp 9\n"
        "orin-omni quantize IN --out OUT [--sym/--asym] [--activations auto|device|host|disk] # --in-a-comment\n"
        "```\n"
    )
    problems = check_commands(page)
    text = "\n".join(problems)
    assert len(problems) == 4, text
    assert "`orin-omni frobnicate`: no such command" in text and ":4:" in problems[0]
    assert "`orin-omni serve` has no option --no-such-flag" in text
    assert "`orin-omni install-service` has no option --bogus" in text and "page.md:12:" in text
    assert "`orin-omni bench` has no option --warp" in text


def test_a_planted_unknown_option_in_a_table_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "| option | default |\n|---|---|\n"
        "| `--model-dir DIR` | required |\n| `--realtime-*` | |\n| `--turbo-mode` | off |\n| `--nothing-*` | |\n\n"
        "Never add `--force-reinstall`; `pip install --no-such-pip-flag x` is pip's business.\n"
    )
    problems = check_bare_options(page)
    assert len(problems) == 2, problems
    assert "--turbo-mode is no orin-omni option" in problems[0] and ":5:" in problems[0]
    assert "--nothing-*" in problems[1]
