"""Helpers of tools/gpu/fla_suite.sh: FLA's KDA test file (tests/ops/test_kda.py) as kdakit's peer test suite.

    python3 tools/gpu/fla_suite.py prepare SRC_DIR WORK OUT
        rewrite the imports of the KDA ops to kdakit's; lay out WORK/tests/ops/test_kda.py (+ FLA's conftest.py in
        WORK/tests, as in FLA's tree) and the CPU plugin WORK/fla_suite_cpu.py; the diff in OUT
    python3 tools/gpu/fla_suite.py imports FILE
        import the rewritten file; print where its KDA ops come from (exit 1 unless all are kdakit's)
    python3 tools/gpu/fla_suite.py deselect
        the pytest -k expression that leaves the excluded tests out
    python3 tools/gpu/fla_suite.py summary JUNIT LOG OUT [FLA_COMMIT]
        passed / failed / skipped, failing ids grouped; OUT/fla_suite.md and .json; exit 0 unless a test that calls
        kdakit fails

Only the imports of `chunk_kda`, `fused_recurrent_kda` and `fused_recurrent_kda_fwd` are rewritten; everything else
(the float64 references `naive_recurrent_kda` / `naive_chunk_kda`, the gate references, `assert_close`, `device`) stays
FLA's, so FLA's package must be importable.
"""
from __future__ import annotations

import difflib
import importlib.util
import json
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# (FLA's line, kdakit's line): each FLA line must occur exactly once.
REWRITES = (
    ("from fla.ops.kda import chunk_kda, fused_recurrent_kda", "from kdakit import chunk_kda, fused_recurrent_kda"),
    ("from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd", "from kdakit import fused_recurrent_kda_fwd"),
)
KDA_OPS = ("chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd")
# Test functions left out, and why.
EXCLUDED = {
    "test_flash_kda_chunk": ("FLA's FlashKDA backend (FLA_FLASH_KDA dispatch inside FLA's chunk_kda), not a kdakit "
                             "path; its 'gold' is a float64 fused_recurrent_kda on the GPU"),
    "test_flash_kda_chunk_varlen": "FLA's FlashKDA backend, as test_flash_kda_chunk",
    "test_triton_ascend_backend_routing": "FLA's Triton-Ascend backend registry (NPU only)",
}
# Tests that call no kdakit function (FLA's references against each other, FLA's standalone gate op): their results
# say nothing about kdakit.
FLA_ONLY = {"test_naive_chunk": "FLA's naive_chunk_kda against FLA's naive_recurrent_kda",
            "test_gate": "FLA's fused_kda_gate (kdakit has no standalone gate op, spec §2.4)"}
# pytest plugin for a run on the CPU (`-p fla_suite_cpu`, loaded before any conftest or test module): FLA picks its
# device from Triton's active driver, which names CUDA on a machine with Triton's CUDA backend and no GPU.
CPU_PLUGIN = """\
# FLA's test file on the CPU: fla.utils' device (read by the test file and FLA's conftest at import) set to "cpu".
import torch

import fla.utils
import fla.utils.hardware

for _m in (fla.utils, fla.utils.hardware):
    _m.device = "cpu"
    _m.device_torch_lib = torch.cpu
"""


def rewrite(text: str) -> str:
    lines = text.splitlines(keepends=True)
    for old, new in REWRITES:
        hits = [i for i, line in enumerate(lines) if line.rstrip("\r\n") == old]
        if len(hits) != 1:
            raise SystemExit(f"fla_suite: expected the line {old!r} once in FLA's test file, found it {len(hits)} "
                             "times: the file changed; update REWRITES in tools/gpu/fla_suite.py")
        lines[hits[0]] = new + "\n"
    out = "".join(lines)
    left = re.findall(r"^\s*from fla[\w.]* import [^\n]*\b(?:%s)\b" % "|".join(KDA_OPS), out, flags=re.M)
    if left:
        raise SystemExit(f"fla_suite: FLA's KDA ops still imported after the rewrite: {left}")
    return out


def prepare(src_dir: Path, work: Path, out: Path) -> None:
    src = src_dir / "test_kda.py"
    if not src.is_file():
        raise SystemExit(f"fla_suite: no {src}; fill .deps/peers with FLA_GIT=<git dir> tools/gpu/run prepare-deps")
    text = src.read_text()
    new = rewrite(text)
    if work.exists():
        shutil.rmtree(work)
    (work / "tests" / "ops").mkdir(parents=True)
    (work / "tests" / "ops" / "test_kda.py").write_text(new)
    if (src_dir / "conftest.py").is_file():  # FLA's: NaN-filled torch.empty inside FLA's code, for tests/ops/
        shutil.copy(src_dir / "conftest.py", work / "tests" / "conftest.py")
    (work / "pytest.ini").write_text("[pytest]\naddopts =\n")  # none of kdakit's pytest settings
    (work / "fla_suite_cpu.py").write_text(CPU_PLUGIN)
    diff = "".join(difflib.unified_diff(text.splitlines(keepends=True), new.splitlines(keepends=True),
                                        "fla/tests/ops/test_kda.py", "kdakit-peer/tests/ops/test_kda.py"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fla_suite.diff").write_text(diff)
    shutil.copy(work / "tests" / "ops" / "test_kda.py", out / "fla_suite_test_kda.py")
    print(diff, end="")


def check_imports(path: Path) -> int:
    spec = importlib.util.spec_from_file_location("fla_peer_test_kda", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bad = 0
    for name in KDA_OPS:
        fn = getattr(mod, name)
        where = getattr(fn, "__module__", "?")
        print(f"{name:26s} from {where}")
        bad += not where.startswith("kdakit")
    import fla  # noqa: F401  (the rest of the file's imports are FLA's)

    print(f"FLA package: {getattr(fla, '__version__', '?')} at {Path(fla.__file__).parent}")
    return 1 if bad else 0


def deselect_expr() -> str:
    return " and ".join(f"not {name}" for name in sorted(EXCLUDED))


def _function(test_id: str) -> str:
    return test_id.split("::")[-1].split("[")[0]


_RANK = {"passed": 0, "skipped": 1, "error": 2, "failed": 3}


def results_from_junit(path: Path) -> list:
    """One row per test (a test whose teardown also fails has two JUnit entries): the worst outcome, the first
    message of that outcome."""
    rows = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = case.get("name", "?")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = el.get("message") or ""
                if not message and (el.text or "").strip():
                    message = el.text.strip().splitlines()[-1]
                break
        row = dict(id=test_id, function=_function(test_id), outcome=outcome, message=_one_line(message))
        old = rows.get(test_id)
        if old is None or _RANK[outcome] > _RANK[old["outcome"]]:
            rows[test_id] = row
    return list(rows.values())


_VERBOSE = re.compile(r"^(\S+::.+?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")  # ids may hold spaces


def results_from_log(path: Path) -> list:
    """Outcomes from pytest -v lines, for a run cut short before it wrote its JUnit file."""
    rows = {}
    for line in path.read_text(errors="replace").splitlines():
        m = _VERBOSE.match(line)
        if m:
            test_id = m.group(1).split("::", 1)[-1]
            rows[test_id] = dict(id=test_id, function=_function(test_id), outcome=m.group(2).lower(), message="")
    return list(rows.values())


def _one_line(message: str) -> str:
    message = " ".join((message or "").split())
    return message if len(message) <= 240 else message[:237] + "..."


def group(rows) -> dict:
    """Failing tests by kind: 'fla-only' (no kdakit call), 'other'."""
    groups = {"fla-only": [], "other": []}
    for r in rows:
        if r["outcome"] not in ("failed", "error"):
            continue
        if r["function"] in FLA_ONLY:
            groups["fla-only"].append(r)
        else:
            groups["other"].append(r)
    return groups


def deselected_count(log: Path) -> int:
    m = re.findall(r"(\d+) deselected", log.read_text(errors="replace")) if log.is_file() else []
    return int(m[-1]) if m else 0


def environment() -> list:
    lines = []
    for name in ("kdakit", "fla", "torch", "triton"):
        try:
            mod = __import__(name)
            lines.append(f"{name} {getattr(mod, '__version__', '?')} ({Path(mod.__file__).parent})")
        except Exception as e:  # noqa: BLE001
            lines.append(f"{name}: not importable ({type(e).__name__}: {e})")
    try:
        import kdakit
        import torch

        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        lines.append(f"device: {dev}; kdakit CUDA kernels: {'yes' if kdakit.cuda_available() else 'no'}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"device: unknown ({e})")
    return lines


def summary(junit: Path, log: Path, out: Path, fla_commit: str = "") -> int:
    source = "JUnit XML"
    if junit.is_file():
        rows = results_from_junit(junit)
    elif log.is_file():
        rows, source = results_from_log(log), "pytest -v log (the run ended before writing its JUnit file)"
    else:
        print(f"fla_suite: neither {junit} nor {log} exists")
        return 2
    counts = {k: sum(1 for r in rows if r["outcome"] == k) for k in ("passed", "failed", "error", "skipped")}
    deselected = deselected_count(log)
    groups = group(rows)
    md = ["# FLA's KDA test file against kdakit", ""]
    md += [(f"- FLA test file: tests/ops/test_kda.py{' at ' + fla_commit if fla_commit else ''}, its imports of "
            f"{', '.join(KDA_OPS)} rewritten to kdakit's (fla_suite.diff)")]
    md += [f"- {line}" for line in environment()]
    md += [f"- results from the {source}", "",
           (f"**{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, {counts['skipped']} "
            f"skipped, {deselected} deselected** (the exclusions below and any -k of the caller)"), "", "Excluded:",
           ""]
    md += [f"- `{name}`: {why}" for name, why in EXCLUDED.items()]
    titles = {"other": "Failures of tests that call kdakit", "fla-only": "Failures of FLA-only tests (no kdakit call)"}
    for key in ("other", "fla-only"):
        md += ["", f"{titles[key]}: {len(groups[key])}", ""]
        md += [f"- `{r['id']}`: {r['message'] or '(no message in the -v log)'}" for r in groups[key]]
    skips = {}
    for r in rows:
        if r["outcome"] == "skipped":
            skips.setdefault(r["message"], []).append(r["id"])
    if skips:
        md += ["", "Skipped, by reason:", ""]
        md += [f"- {len(ids)}x {reason or '(no reason given)'}" for reason, ids in skips.items()]
    md += ["", "FLA-only tests: " + "; ".join(f"`{k}`: {v}" for k, v in FLA_ONLY.items()), ""]
    text = "\n".join(md)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fla_suite.md").write_text(text)
    (out / "fla_suite.json").write_text(json.dumps(dict(counts=counts, deselected=deselected, excluded=EXCLUDED,
                                                        groups=groups, results=rows), indent=1) + "\n")
    print(text)
    if not rows:
        return 2
    return 1 if groups["other"] else 0


def main(argv) -> int:
    if not argv or argv[0] not in ("prepare", "imports", "deselect", "summary"):
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "prepare" and len(args) == 3:
        prepare(Path(args[0]), Path(args[1]), Path(args[2]))
        return 0
    if cmd == "imports" and len(args) == 1:
        return check_imports(Path(args[0]))
    if cmd == "deselect" and not args:
        print(deselect_expr())
        return 0
    if cmd == "summary" and len(args) in (3, 4):
        return summary(Path(args[0]), Path(args[1]), Path(args[2]), args[3] if len(args) == 4 else "")
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
