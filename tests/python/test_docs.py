"""Documentation checks: spec citations resolve to headings of docs/spec.md, the paths docs/ARCHITECTURE.md names
exist, and nothing cites the old upper-case spec file any more.

Plain standard library: needs neither torch nor a build of kdakit (and does not import kdakit).
"""
import glob
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "spec.md"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"

SCANNED_DIRS = ("src", "include", "python", "tests", "tools", "docs", "examples")
SCANNED_FILES = ("README.md",)
SKIPPED_DIRS = {".git", "build", ".venv", ".deps", "__pycache__", ".pytest_cache"}

# "spec §1.4", "Spec §3", "spec.md §5.2", "docs/spec.md §7.5", "spec§6.1"; a list after one "spec" counts too:
# "spec §1.5, §2.2 and §2.5".
_NUM = r"\d+(?:\.\d+)?"
CITATION = re.compile(r"\bspec(?:\.md)?\s?§\s?(" + _NUM + r")((?:\s*(?:,|;|/|and|or)\s*§\s?" + _NUM + r")*)",
                      re.IGNORECASE)
LISTED = re.compile(r"§\s?(" + _NUM + r")")
# Headings whose text starts with the section number: "## 1. The token recurrence", "### 1.4 Per-token update".
HEADING = re.compile(r"^#{1,6}\s+(" + _NUM + r")\.?(?:\s|$)")
# The old citation forms, built so that this file does not contain them.
OLD_CITATION = re.compile("SP" + "EC" + r"(?:\.md| ?§)")

# The numbered sections the code's citations were written against; docs/spec.md keeps this numbering.
REQUIRED_SECTIONS = (
    ["1"] + ["1.%d" % i for i in range(1, 9)]
    + ["2"] + ["2.%d" % i for i in range(1, 8)]
    + ["3"] + ["3.%d" % i for i in range(1, 5)]
    + ["4"] + ["4.%d" % i for i in range(1, 4)]
    + ["5"] + ["5.%d" % i for i in range(1, 5)]
    + ["6", "6.1", "6.2"]
    + ["7"] + ["7.%d" % i for i in range(1, 6)]
    + ["8"] + ["8.%d" % i for i in range(1, 5)]
    + ["9"]
)

ARCH_PREFIXES = ("src/", "include/", "python/", "tests/", "tools/", "docs/", "cmake/", ".ci/", "examples/")
ARCH_ROOT_FILES = ("README.md", "CMakeLists.txt", "pyproject.toml")


def _scanned_files():
    """Files under the scanned folders (skipping build trees, virtual environments, caches) and README.md."""
    for top in SCANNED_DIRS:
        base = ROOT / top
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
            for name in sorted(filenames):
                yield Path(dirpath) / name
    for name in SCANNED_FILES:
        path = ROOT / name
        if path.is_file():
            yield path


def _text_lines(path):
    """The file's lines, or None for a binary file (a NUL byte in its first 8 KB)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace").splitlines()


def _rel(path):
    return path.relative_to(ROOT).as_posix()


def _spec_sections():
    lines = SPEC.read_text(encoding="utf-8").splitlines()
    return {m.group(1) for m in (HEADING.match(line) for line in lines) if m}


def _citations():
    """(file:line, cited section) for every spec citation in the scanned files. In docs/spec.md itself every "§N.M"
    is a citation of the spec."""
    found = []
    for path in _scanned_files():
        lines = _text_lines(path)
        if lines is None:
            continue
        is_spec = path.resolve() == SPEC.resolve()
        for lineno, line in enumerate(lines, 1):
            where = "%s:%d" % (_rel(path), lineno)
            if is_spec:
                found.extend((where, num) for num in LISTED.findall(line))
                continue
            for m in CITATION.finditer(line):
                found.append((where, m.group(1)))
                found.extend((where, num) for num in LISTED.findall(m.group(2)))
    return found


def test_spec_keeps_section_numbering():
    assert SPEC.is_file(), "docs/spec.md is missing"
    sections = _spec_sections()
    missing = [s for s in REQUIRED_SECTIONS if s not in sections]
    assert not missing, "docs/spec.md has no heading for section(s): " + ", ".join("§" + s for s in missing)


def test_spec_citations_resolve():
    assert SPEC.is_file(), "docs/spec.md is missing"
    sections = _spec_sections()
    assert sections, "docs/spec.md has no numbered headings (e.g. '## 1. ...', '### 1.4 ...')"
    citations = _citations()
    outside = [c for c in citations if not c[0].startswith("docs/spec.md:")]
    assert outside, "no spec citations found outside docs/spec.md: the scan's pattern or its file walk is broken"
    unresolved = ["%s: spec §%s" % (where, num) for where, num in citations if num not in sections]
    assert not unresolved, (
        "%d spec citation(s) name no heading of docs/spec.md:\n  " % len(unresolved) + "\n  ".join(unresolved))


def _architecture_paths():
    """Repository paths named in backticks in docs/ARCHITECTURE.md, as written and as checked."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    paths = []
    for span in re.findall(r"`([^`\n]+)`", text):
        path = re.split(r"[ (]", span.strip(), maxsplit=1)[0]
        path = re.sub(r":\d+(?:-\d+)?$", "", path)  # a trailing :line or :line-line
        path = re.sub(r"(?:…|\.\.\.)$", "", path)  # "tests/cpp/…": the folder
        path = path.rstrip("/")
        if path.startswith(ARCH_PREFIXES) or path in ARCH_ROOT_FILES:
            paths.append((span, path))
    return paths


def _expand_braces(path):
    """`src/x.{h,cpp}` names src/x.h and src/x.cpp (one brace group, as the docs write them)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [path[:m.start()] + alt + path[m.end():] for alt in m.group(1).split(",")]


def test_architecture_paths_exist():
    assert ARCHITECTURE.is_file(), "docs/ARCHITECTURE.md is missing"
    paths = _architecture_paths()
    assert paths, "docs/ARCHITECTURE.md names no repository paths in backticks: the pattern is broken"
    missing = []
    for span, written in paths:
        for path in _expand_braces(written):
            if "*" in path or "?" in path or "[" in path:
                ok = bool(glob.glob(str(ROOT / path), recursive=True))
            else:
                ok = (ROOT / path).exists()
            if not ok:
                missing.append("`%s` (checked as %s)" % (span, path))
    missing = sorted(set(missing))
    assert not missing, (
        "%d path(s) named in docs/ARCHITECTURE.md do not exist:\n  " % len(missing) + "\n  ".join(missing))


def test_no_old_spec_citations():
    old = []
    for path in _scanned_files():
        lines = _text_lines(path)
        if lines is None:
            continue
        for lineno, line in enumerate(lines, 1):
            for m in OLD_CITATION.finditer(line):
                old.append("%s:%d: %s" % (_rel(path), lineno, line.strip()[:120]))
    assert not old, (
        "%d line(s) still cite the old upper-case spec file; cite docs/spec.md as 'spec §N.M':\n  " % len(old)
        + "\n  ".join(old))
