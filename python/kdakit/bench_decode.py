"""Decode rows of `kdakit.bench`: `fused_recurrent_kda_fwd` in place on a state pool, kdakit and FLA in the same form,
in one process, on the same inputs.

A row is a form x pool dtype x tokens per sequence T x head configuration x sequences N. Every form has bf16 q, k,
v, K = V = 128, L2 norm in kernel and a caller-provided `out`; unless it says otherwise, g and beta are bf16 raw
inputs with the gate (lower_bound -5) and the beta sigmoid in kernel, and slot ids are int32. The forms:

- batch-vfirst: [N,T] inputs, v-first pool [slots,HV,V,K] (state_v_first=True).
- batch-kfirst: [N,T] inputs, K-first pool [slots,HV,K,V] (state_v_first=False).
- varlen-vfirst: vLLM's form: [1,N*T] inputs with int32 cu_seqlens, one row of slot ids per sequence, v-first pool.
- varlen-kfirst: as varlen-vfirst with a K-first pool.
- spare-slots: batch-vfirst on a pool with 4x the slots the call touches (at most 16 GiB), the touched slots a random
  subset, int64 slot ids.
- pregated-fp32: vLLM's decode inputs: varlen-vfirst with g an fp32 log-decay already gated (logsigmoid of a
  normal), beta fp32 after the sigmoid (use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False).

T = 1: [N] slot ids, the state read and written once. T = 4: speculative verify as the engines call it: [N,4] slot
ids, random num_accepted_tokens, the state read once and written after every token. The bandwidth column is those
state bytes over the time, as a share of the copy bandwidth measured in the process. A row meets the goal when kdakit
is faster than FLA and, from N = 256, reaches 85% of the copy bandwidth; its outputs must also agree with FLA's.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
import zlib
from typing import Callable

import torch
import torch.nn.functional as F

D = 128  # K = V
DECODE_NS = (1, 32, 256, 1024)
DECODE_HEADS = ((16, 16), (32, 32), (8, 32))  # (H, HV); the last is GVA
DECODE_TS = (1, 4)
DECODE_POOLS = (("fp32", torch.float32), ("bf16", torch.bfloat16))
LOWER_BOUND = -5.0

BANDWIDTH_GOAL = 0.85  # share of the copy bandwidth kdakit must reach ...
GOAL_MIN_N = 256       # ... from this many sequences on
# Relative RMS difference of kdakit's outputs from FLA's above which a row is flagged: twice the tolerance of each
# library against the float64 reference for 16-bit inputs (spec §6.1).
DIFF_FLAG = 8e-3
SPARE_FACTOR = 4
SPARE_POOL_CAP_BYTES = 16 << 30


@dataclasses.dataclass(frozen=True)
class DecodeForm:
    name: str
    varlen: bool                # [1,N*T] tokens with cu_seqlens instead of [N,T]
    v_first: bool               # pool [slots,HV,V,K] (state_v_first=True) or [slots,HV,K,V]
    spare: int                  # pool slots per slot the call touches (1: every slot is touched)
    index_dtype: torch.dtype    # slot ids
    pregated: bool              # g an fp32 log-decay, beta fp32 after the sigmoid: no gate or sigmoid in kernel


FORMS = (
    DecodeForm("batch-vfirst", varlen=False, v_first=True, spare=1, index_dtype=torch.int32, pregated=False),
    DecodeForm("batch-kfirst", varlen=False, v_first=False, spare=1, index_dtype=torch.int32, pregated=False),
    DecodeForm("varlen-vfirst", varlen=True, v_first=True, spare=1, index_dtype=torch.int32, pregated=False),
    DecodeForm("varlen-kfirst", varlen=True, v_first=False, spare=1, index_dtype=torch.int32, pregated=False),
    DecodeForm("spare-slots", varlen=False, v_first=True, spare=SPARE_FACTOR, index_dtype=torch.int64,
               pregated=False),
    DecodeForm("pregated-fp32", varlen=True, v_first=True, spare=1, index_dtype=torch.int32, pregated=True),
)
FORM_NAMES = tuple(f.name for f in FORMS)
DEFAULT_TOOL_FORM = "batch-vfirst"


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    form: DecodeForm
    pool: str  # "fp32" or "bf16"
    pool_dtype: torch.dtype
    T: int
    H: int
    HV: int
    N: int

    @property
    def heads(self) -> str:
        return f"H{self.H}" if self.H == self.HV else f"H{self.H}-HV{self.HV}"

    @property
    def name(self) -> str:
        # The shape first, as the rows were named before there were forms: "decode T1 N256 H16 fp32" still selects.
        return f"decode T{self.T} N{self.N} {self.heads} {self.pool} {self.form.name}"

    @property
    def touched_slots(self) -> int:
        return self.N * self.T

    @property
    def slot_bytes(self) -> int:
        return self.HV * D * D * (torch.finfo(self.pool_dtype).bits // 8)

    @property
    def pool_slots(self) -> int:
        want = self.touched_slots * self.form.spare
        if self.form.spare > 1:
            want = min(want, max(SPARE_POOL_CAP_BYTES // self.slot_bytes, self.touched_slots + 1))
        return want

    @property
    def state_bytes(self) -> int:
        """State bytes that must move: read once, written once per token."""
        return self.N * self.slot_bytes * (1 + self.T)


def form_by_name(name: str) -> DecodeForm:
    for f in FORMS:
        if f.name == name:
            return f
    raise ValueError(f"unknown decode form {name!r}; the forms are {', '.join(FORM_NAMES)}")


def decode_cases(forms=None, only=None) -> list:
    """Rows in table order (form, pool, T, heads, N); `forms`: form names; `only`: substrings of row names."""
    chosen = [form_by_name(n) for n in forms] if forms else list(FORMS)
    cases = [DecodeCase(f, pool, dt, T, H, HV, N) for f in chosen for pool, dt in DECODE_POOLS for T in DECODE_TS
             for H, HV in DECODE_HEADS for N in DECODE_NS]
    if only:
        cases = [c for c in cases if any(s in c.name for s in only)]
    return cases


def select_cases(substrings) -> list:
    """Decode rows for the GPU tools (kernel times, tilings, Nsight Compute): rows whose names contain one of the
    substrings; of the batch-vfirst form only unless a substring names a form."""
    named = any(f in s for s in substrings for f in FORM_NAMES)
    return [c for c in decode_cases(None if named else [DEFAULT_TOOL_FORM]) if any(s in c.name for s in substrings)]


def decode_inputs(case: DecodeCase, device="cuda"):
    """Fresh random inputs of one row: a dict for `run_kdakit_decode` / an FLA runner, and the row's state bytes."""
    f, N, T, H, HV = case.form, case.N, case.T, case.H, case.HV
    bf = torch.bfloat16
    lead = (1, N * T) if f.varlen else (N, T)
    x = dict(form=f, q=torch.randn(*lead, H, D, device=device, dtype=bf), k=torch.randn(*lead, H, D, device=device,
             dtype=bf), v=torch.randn(*lead, HV, D, device=device, dtype=bf))
    if f.pregated:
        x["g"] = F.logsigmoid(torch.randn(*lead, HV, D, device=device, dtype=torch.float32))
        x["beta"] = torch.randn(*lead, HV, device=device, dtype=torch.float32).sigmoid()
        x["A_log"] = x["dt_bias"] = None
    else:
        x["g"] = torch.randn(*lead, HV, D, device=device, dtype=bf)
        x["beta"] = torch.randn(*lead, HV, device=device, dtype=bf)
        x["A_log"] = torch.log(torch.empty(HV, device=device).uniform_(1, 16))
        x["dt_bias"] = torch.randn(HV * D, device=device)
    # [slots,HV,V,K] or [slots,HV,K,V]: the same shape, as V = K.
    x["pool"] = torch.randn(case.pool_slots, HV, D, D, device=device, dtype=case.pool_dtype)
    ids = torch.randperm(case.pool_slots, device=device)[:case.touched_slots].to(f.index_dtype)
    x["idx"] = ids if T == 1 else ids.reshape(N, T)
    x["acc"] = None if T == 1 else torch.randint(1, T + 1, (N,), device=device, dtype=torch.int32)
    x["cu"] = torch.arange(0, N * T + 1, T, device=device, dtype=torch.int32) if f.varlen else None
    x["out"] = torch.empty(*lead, HV, D, device=device, dtype=bf)
    return x, case.state_bytes


def decode_kwargs(x) -> dict:
    """The keywords both libraries get: the same in kdakit's and FLA's `fused_recurrent_kda_fwd`."""
    f = x["form"]
    kw = dict(inplace_final_state=True, state_v_first=f.v_first, cu_seqlens=x["cu"], ssm_state_indices=x["idx"],
              num_accepted_tokens=x["acc"], use_qk_l2norm_in_kernel=True, out=x["out"])
    if f.pregated:
        kw.update(use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, lower_bound=None)
    else:
        kw.update(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)
    return kw


def run_kdakit_decode(x, lib=None):
    """One decode call of kdakit (or of `lib`, another build's package) on a row's inputs, in place on its pool."""
    if lib is None:
        import kdakit as lib
    return lib.fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["pool"],
                                       None, **decode_kwargs(x))


def fla_decode_runner(log=print):
    """FLA's `fused_recurrent_kda_fwd` as a row runner, or None where FLA (or its state_v_first) is missing."""
    try:
        import inspect

        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:  # noqa: BLE001
        log(f"FLA decode not importable: {e}")
        return None
    if "state_v_first" not in inspect.signature(fused_recurrent_kda_fwd).parameters:
        log("FLA's fused_recurrent_kda_fwd has no state_v_first; decode rows run without FLA")
        return None

    def run(x):
        return fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                       initial_state=x["pool"], scale=None, **decode_kwargs(x))
    return run


def rel_diff(a: torch.Tensor, b: torch.Tensor, rows: int = 256) -> float:
    """||a - b|| / ||b|| (float64 sums), over blocks of `rows` leading rows so pools need no full-size temporaries.
    NaN when either holds a NaN."""
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    num = den = 0.0
    for i in range(0, a.shape[0], rows):
        x, y = a[i:i + rows].double(), b[i:i + rows].double()
        num += (x - y).square().sum().item()
        den += y.square().sum().item()
    return math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num)


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def verdict(row: dict):
    """(met, text): met is True, False, or None where FLA did not run (the bandwidth part is still judged)."""
    if row.get("kdakit_us") is None:
        return False, "no: kdakit did not run"
    reasons = []
    if row["N"] >= GOAL_MIN_N and row["kdakit_bw"] < BANDWIDTH_GOAL:
        reasons.append(f"{100 * row['kdakit_bw']:.0f}% < {100 * BANDWIDTH_GOAL:.0f}% of copy BW")
    if row.get("fla_us") is not None:
        if row["kdakit_us"] >= row["fla_us"]:
            reasons.append("not faster than FLA")
        diffs = [row.get("diff_out"), row.get("diff_state")]
        if any(d is None or not d <= DIFF_FLAG for d in diffs):
            reasons.append("differs from FLA")
    if reasons:
        return False, "no: " + "; ".join(reasons)
    if row.get("fla_us") is None:
        return None, ("FLA did not run" if row.get("fla_error") else "no FLA") + (
            "" if row["N"] < GOAL_MIN_N else "; bandwidth met")
    return True, "yes"


def empty_row(case: DecodeCase) -> dict:
    return dict(name=case.name, form=case.form.name, pool=case.pool, T=case.T, H=case.H, HV=case.HV, N=case.N,
                slots=case.pool_slots, index_dtype=str(case.form.index_dtype).replace("torch.", ""),
                state_mb=case.state_bytes / 1e6, kdakit_us=None, fla_us=None, kdakit_bw=None, fla_bw=None,
                diff_out=None, diff_state=None, kdakit_error=None, fla_error=None, met=False, verdict="not run")


def bench_row(case: DecodeCase, *, timer: Callable, reps: int, bw: float, flush, fla=None, lib=None,
              device="cuda") -> dict:
    """One row: outputs and updated slots of both libraries from the same start, then each timed in place."""
    x, state_bytes = decode_inputs(case, device)
    row = empty_row(case)
    touched = x["idx"].reshape(-1).long()
    start = x["pool"].index_select(0, touched)
    ours_out = ours_state = None
    calls = [("kdakit", lambda: run_kdakit_decode(x, lib))]
    if fla is not None:
        calls.append(("fla", lambda: fla(x)))
    with torch.inference_mode():
        for label, call in calls:  # each from the same start, its outputs poisoned first
            x["pool"].index_copy_(0, touched, start)
            x["out"].fill_(float("nan"))
            try:
                call()
            except Exception as e:  # noqa: BLE001  (a form a library rejects is reported, the other rows still run)
                row[f"{label}_error"] = _error_text(e)
                continue
            if label == "kdakit":
                ours_out, ours_state = x["out"].clone(), x["pool"].index_select(0, touched)
            elif ours_out is not None:
                row["diff_out"] = rel_diff(ours_out, x["out"])
                row["diff_state"] = rel_diff(ours_state, x["pool"].index_select(0, touched))
        del start, ours_out, ours_state
        for label, call in reversed(calls):  # FLA first, as the benchmark always did
            if row[f"{label}_error"] is None:
                try:
                    row[f"{label}_us"] = timer(call, reps, flush) * 1e3
                except Exception as e:  # noqa: BLE001
                    row[f"{label}_error"] = _error_text(e)
                    continue
                row[f"{label}_bw"] = state_bytes / (row[f"{label}_us"] * 1e-6) / bw
    x.clear()
    row["met"], row["verdict"] = verdict(row)
    return row


def run_rows(cases, *, timer: Callable, reps: int, bw: float, flush, fla=None, lib=None, device="cuda",
             log=print) -> list:
    """Every row in turn, with a progress line each (elapsed time and an estimate of the time left)."""
    rows = []
    t0 = time.monotonic()
    for i, case in enumerate(cases, 1):
        torch.manual_seed(zlib.crc32(case.name.encode()))  # a row's inputs do not depend on which rows run
        try:
            r = bench_row(case, timer=timer, reps=reps, bw=bw, flush=flush, fla=fla, lib=lib, device=device)
        except Exception as e:  # noqa: BLE001  (the inputs could not be made: out of memory, a lost CUDA context)
            r = empty_row(case)
            r["kdakit_error"] = r["verdict"] = f"row not run: {_error_text(e)}"
            if "CUDA error" in str(e) and not isinstance(e, torch.OutOfMemoryError):
                rows.append(r)
                log(f"[{i}/{len(cases)}] {case.name}: {r['verdict']}; the CUDA context is lost, the run stops here")
                break
        rows.append(r)
        if device == "cuda":
            torch.cuda.empty_cache()
        spent = time.monotonic() - t0
        left = spent / i * (len(cases) - i)
        log(f"[{i}/{len(cases)}] {r['name']:42s} kdakit {fmt(r['kdakit_us'], '{:9.1f}')} us  FLA "
            f"{fmt(r['fla_us'], '{:9.1f}')} us  {fmt(r['kdakit_bw'] and 100 * r['kdakit_bw'], '{:5.1f}')}% copy BW  "
            f"{r['verdict']}  ({spent:.0f} s, ~{left:.0f} s left)")
        for label in ("kdakit", "fla"):
            if r[f"{label}_error"]:
                log(f"    {label}: {r[label + '_error']}")
    return rows


def fmt(v, f: str) -> str:
    return "—" if v is None else f.format(v)


def decode_table(rows) -> str:
    lines = [("| form | row | pool slots | state MB (read + write) | kdakit µs | FLA µs | kdakit/FLA | "
              "kdakit % copy BW | FLA % copy BW | rel. diff out | rel. diff state | meets |"), "|---" * 12 + "|"]
    for r in rows:
        ratio = r["kdakit_us"] / r["fla_us"] if r["kdakit_us"] is not None and r["fla_us"] else None
        shape = r["name"][len("decode "):-len(r["form"]) - 1]
        lines.append("| " + " | ".join([
            r["form"], shape, str(r["slots"]), f"{r['state_mb']:.1f}", fmt(r["kdakit_us"], "{:.1f}"),
            fmt(r["fla_us"], "{:.1f}"), fmt(ratio, "{:.2f}"), fmt(r["kdakit_bw"] and 100 * r["kdakit_bw"], "{:.0f}%"),
            fmt(r["fla_bw"] and 100 * r["fla_bw"], "{:.0f}%"), fmt(r["diff_out"], "{:.1e}"),
            fmt(r["diff_state"], "{:.1e}"), r["verdict"]]) + " |")
    return "\n".join(lines)


def form_summary(rows) -> str:
    """Per form: rows that meet the goal, the lowest bandwidth share from N = 256, kdakit/FLA (median, worst)."""
    lines = [(f"| form | rows meeting the goal | lowest kdakit % copy BW at N >= {GOAL_MIN_N} | kdakit/FLA median | "
              "kdakit/FLA worst | rows with errors |"), "|---" * 6 + "|"]
    for name in dict.fromkeys(r["form"] for r in rows):
        rs = [r for r in rows if r["form"] == name]
        big = [r["kdakit_bw"] for r in rs if r["N"] >= GOAL_MIN_N and r["kdakit_bw"] is not None]
        ratios = [r["kdakit_us"] / r["fla_us"] for r in rs if r["kdakit_us"] is not None and r["fla_us"]]
        errors = sum(1 for r in rs if r["kdakit_error"] or r["fla_error"])
        lines.append("| " + " | ".join([
            name, f"{sum(1 for r in rs if r['met'])}/{len(rs)}", fmt(min(big) * 100 if big else None, "{:.0f}%"),
            fmt(statistics.median(ratios) if ratios else None, "{:.2f}"), fmt(max(ratios) if ratios else None,
                                                                               "{:.2f}"), str(errors)]) + " |")
    return "\n".join(lines)


def errors_list(rows) -> str:
    return "\n".join(f"- {r['name']}: {label}: {r[label + '_error']}" for r in rows for label in ("kdakit", "fla")
                     if r[f"{label}_error"])


def plot(rows, path, title: str) -> None:
    """kdakit's and FLA's bandwidth shares, one panel per form."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    forms = list(dict.fromkeys(r["form"] for r in rows))
    per = max(sum(1 for r in rows if r["form"] == f) for f in forms)
    fig, axes = plt.subplots(len(forms), 1, figsize=(max(10, 0.22 * per), 3.2 * len(forms)), squeeze=False)
    for ax, form in zip(axes[:, 0], forms):
        rs = [r for r in rows if r["form"] == form]
        xs = range(len(rs))
        ax.bar([i - 0.2 for i in xs], [100 * (r["kdakit_bw"] or 0) for r in rs], 0.4, label="kdakit")
        ax.bar([i + 0.2 for i in xs], [100 * (r["fla_bw"] or 0) for r in rs], 0.4, label="FLA")
        ax.axhline(100 * BANDWIDTH_GOAL, color="gray", lw=0.8, ls="--")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["name"][len("decode "):-len(form) - 1] for r in rs], rotation=90, fontsize=6)
        ax.set_ylabel("% of copy BW")
        ax.set_title(f"{title}: {form}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
