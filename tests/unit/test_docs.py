"""The code, tests, benchmarks and docs speak of the product.

Every line of ``src``, ``tests``, ``benchmarks``, ``docs`` and ``README.md`` describes what fedseg
does; none speaks of the team's working process (work sessions, issue numbers, tickets, who ran
what on which lent machine), cites a file outside the repository (``shared/``) or links a run's
output folder (``runs/``, which is not in git). History lives in git and ``CHANGELOG.md``.
Every relative Markdown link in ``docs/**/*.md`` and ``README.md`` points to a file that exists, and
an ``#anchor`` into a Markdown file to one of its headings; every test file a line names (``tests/…/x.py``,
``tests/…/x.py::name``) exists and holds that name.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
SCANNED = ("src", "tests", "benchmarks", "docs", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".yaml", ".yml", ".sh", ".cfg", ".ini"}

#: Words of the working process.  Each is written in two pieces, so that a plain-text search for the
#: words this file forbids does not find the file itself.
PROCESS_WORDS = (
    "sessi" + "on [0-9]+",
    "sessi" + "ons [0-9]",
    "iss" + "ue [0-9]+",
    r"issues? #?[0-9]",
    "coord" + "inator",
    "device " + "tool",
    "len" + "t (gpu|to)",
    "shared/" + "DESIGN",
    "ticket",
    r"runs/s[0-9]+",
    "earlier run",
    r"\bsession\b",
)
PROCESS = re.compile("|".join(PROCESS_WORDS), re.IGNORECASE)
#: The one technical meaning of "session" in fedseg: NVIDIA FLARE's admin (API) session and the
#: session token a site logs in with. Such a use is removed from a line before it is matched.
FLARE_SESSION = re.compile(
    r"\b(admin|API) session\b|\bsession token\b|\blog(s|ged) in with a new session\b", re.IGNORECASE
)
#: A file outside the repository.
OUTSIDE = re.compile(r"(?<![\w.-])(\.\./)*shared/")
#: A Markdown link to a run's output folder.
RUNS_LINK = re.compile(r"\]\(\s*(\./|\.\./)*runs/")
#: A test file named in a line, with the name of a test (or a prefix of names, ``test_x_*``) after ``::``.
TEST_PATH = re.compile(r"(?<![\w/.-])(tests/[\w/]+\.py)(?:::(\w+))?")
#: Markdown link or image target: [text](target) / ![alt](target).
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def scanned_files():
    """Text files under the scanned paths, this file left out."""
    for name in SCANNED:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in files:
            built = "__pycache__" in f.parts or any(p.endswith(".egg-info") for p in f.parts)  # not ours
            if f.is_file() and f.suffix in TEXT_SUFFIXES and not built and f.resolve() != THIS:
                yield f


def offences(line):
    """What is wrong with one line (empty: nothing)."""
    found = []
    if PROCESS.search(FLARE_SESSION.sub("", line)):
        found.append("process")
    if OUTSIDE.search(line):
        found.append("outside the repository")
    if RUNS_LINK.search(line):
        found.append("link to runs/")
    return found


def test_the_patterns_catch_process_words_and_spare_flares_session():
    # Assert
    for bad in (
        "Measured in sessi" + "on 12 on the len" + "t GPU.",
        "see iss" + "ue 16, continued",
        "the coord" + "inator's two-process benchmark",
        "This session added the flips.",
        "in a new session we measured it",
        "as DESIGN.md says (shared/" + "DESIGN.md)",
        "cited from `../shared/papers/fedsm.md`",
        "the tables in [runs](runs/s13/m32/fundus.md)",
        "an earlier run gave 0.77",
    ):
        assert offences(bad), bad
    for good in (
        "the supervisor's admin session breaks",
        "a site logged in with a new session token",
        "A FLARE API session from the admin kit",
        "`--out runs/fedsm-32` writes the runs there",
        "several sites share the GPU",
    ):
        assert not offences(good), good


def test_no_line_speaks_of_the_working_process_or_outside_the_repository():
    # Arrange
    files = list(scanned_files())
    # Act
    bad = [
        f"{f.relative_to(ROOT)}:{n}: {', '.join(why)}: {line.strip()[:120]}"
        for f in files
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if (why := offences(line))
    ]
    # Assert
    assert len(files) > 50 and ROOT / "README.md" in files
    assert not bad, "\n".join(bad)


def slug(heading):
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md):
    """The anchors of a Markdown file: its headings' (GitHub numbers repeated ones) and ``<a id="...">`` tags."""
    seen, out = {}, set()
    in_code = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} (.*)", line)):
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
        if not in_code:
            out.update(re.findall(r'<a id="([^"]+)">', line))
    return out


def links(md):
    """(line number, target) of every link outside code blocks and code spans."""
    in_code = False
    for n, line in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code or line.startswith("    "):
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            yield n, target


def broken_links(md):
    """The relative links of one Markdown file whose file or heading does not exist."""
    bad = []
    for n, target in links(md):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{md.relative_to(ROOT)}:{n}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{md.relative_to(ROOT)}:{n}: {target} (no such heading)")
    return bad


def test_the_link_check_finds_a_broken_link(tmp_path):
    # Arrange
    global ROOT
    md = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Top\n\n## Table 7: λ sweep\n")
    md.write_text(
        "[ok](b.md) [ok](b.md#table-7-λ-sweep) [ok](#here) [web](https://example.org)\n"
        "## Here\n[missing](c.md) [no heading](b.md#nothing)\n```\n[in code](d.md)\n```\n"
    )
    saved, ROOT = ROOT, tmp_path
    try:
        # Act
        bad = broken_links(md)
    finally:
        ROOT = saved
    # Assert
    assert bad == ["a.md:3: c.md (no such file)", "a.md:3: b.md#nothing (no such heading)"]


@pytest.mark.parametrize(
    "md", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_relative_markdown_link_points_to_a_file_that_exists(md):
    # Act
    bad = broken_links(md)
    # Assert
    assert not bad, "\n".join(bad)


def named_test_files(lines):
    """What is wrong with the test files ``lines`` name (``(where, line)`` pairs): missing files, missing names."""
    bad = []
    for where, line in lines:
        for path, name in TEST_PATH.findall(line):
            target = ROOT / path
            if not target.is_file():
                bad.append(f"{where}: {path} (no such file)")
            elif name and not re.search(rf"^\s*(async def|def|class) {name}", target.read_text(), re.M):
                bad.append(f"{where}: {path}::{name} (no such test)")
    return bad


def test_the_test_file_check_finds_a_moved_file_and_a_renamed_test():
    # Arrange
    here = "tests/unit/test_docs.py"
    lines = [
        ("a", f"see `{here}` and `{here}::test_the_patterns_catch_process_words_and_spare_flares_session`"),
        ("b", f"a prefix: `{here}::test_the_patterns_*`; a path below another: `src/tests/nothing.py`"),
        ("c", "moved or gone: `tests/test_gone.py`"),
        ("d", f"renamed: `{here}::test_nothing_of_the_kind`"),
    ]
    # Act
    bad = named_test_files(lines)
    # Assert
    assert bad == ["c: tests/test_gone.py (no such file)", f"d: {here}::test_nothing_of_the_kind (no such test)"]


def test_every_test_file_a_line_names_exists_and_holds_the_test_it_names():
    # Arrange
    lines = [
        (f"{f.relative_to(ROOT)}:{n}", line)
        for f in scanned_files()
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
    ]
    # Act
    bad = named_test_files(lines)
    # Assert
    assert not bad, "\n".join(bad)
