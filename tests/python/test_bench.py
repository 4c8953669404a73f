"""The benchmark's decode rows (kdakit.bench_decode), forward and training rows (kdakit.bench, kdakit.bench_train),
the peers' call forms (kdakit.bench_peers) and the peer-suite helper (tools/gpu/fla_suite.py) on the CPU: the row
matrix, every form's inputs, a row run end to end through kdakit's CPU path, the goal verdicts, the tables, cuDNN's
layouts and training inputs checked against kdakit's CPU path standing in for cuDNN's op, the rewrite of FLA's test
file, the summary of a JUnit file, and the A/B tools' renaming of a base package (tools/gpu/ab_rename.sh) and row
runner (tools/gpu/ab_compare.py), and the detached-job helper (tools/gpu/detached.sh). Timings
here are stand-ins; the GPU runs time."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import kdakit  # noqa: E402
from kdakit import bench, bench_decode as bd, bench_gate as bg, bench_peers as bp, bench_train as bt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def small_case(form, pool="bf16", T=1, H=2, HV=4, N=3):
    return bd.DecodeCase(bd.form_by_name(form), pool, dict(bd.DECODE_POOLS)[pool], T, H, HV, N)


def test_matrix_has_every_form_pool_t_heads_and_n():
    cases = bd.decode_cases()
    assert len(cases) == len(bd.FORMS) * 2 * 2 * 3 * 4 == 288
    assert len({c.name for c in cases}) == 288
    assert {c.N for c in cases} == {1, 32, 256, 1024}
    assert {(c.H, c.HV) for c in cases} == {(16, 16), (32, 32), (8, 32)}
    # A row name from before the forms still selects its shape, in every form.
    sel = bd.decode_cases(only=["decode T1 N1 H16 fp32"])
    assert sorted(c.form.name for c in sel) == sorted(bd.FORM_NAMES)
    assert all((c.T, c.N, c.H, c.HV, c.pool) == (1, 1, 16, 16, "fp32") for c in sel)
    assert {c.form.name for c in bd.decode_cases(["varlen-kfirst"])} == {"varlen-kfirst"}
    with pytest.raises(ValueError, match="unknown decode form 'nope'"):
        bd.decode_cases(["nope"])


def test_tools_take_the_batch_vfirst_form_unless_a_form_is_named():
    assert {c.form.name for c in bd.select_cases(["T1 N256 "])} == {"batch-vfirst"}
    assert len(bd.select_cases(["T1 N256 "])) == 6  # 3 head configurations x 2 pools
    assert [c.name for c in bd.select_cases(["T4 N32 H16 bf16 spare-slots"])] == ["decode T4 N32 H16 bf16 spare-slots"]


def test_pool_sizes_and_state_bytes():
    dense = small_case("batch-kfirst", "fp32", T=4)
    assert dense.pool_slots == dense.touched_slots == 12
    assert dense.state_bytes == 3 * 4 * 128 * 128 * 4 * (1 + 4)
    spare = small_case("spare-slots", "bf16", T=4)
    assert spare.pool_slots == 4 * 12
    big = bd.DecodeCase(bd.form_by_name("spare-slots"), "fp32", torch.float32, 4, 32, 32, 1024)
    assert big.touched_slots < big.pool_slots and big.pool_slots * big.slot_bytes <= bd.SPARE_POOL_CAP_BYTES


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("form", bd.FORM_NAMES)
def test_inputs_of_every_form(form, T):
    case = small_case(form, T=T)
    f = case.form
    x, nbytes = bd.decode_inputs(case, "cpu")
    assert nbytes == case.state_bytes
    lead = (1, 3 * T) if f.varlen else (3, T)
    assert x["q"].shape == x["k"].shape == lead + (2, 128) and x["q"].dtype == torch.bfloat16
    assert x["v"].shape == x["out"].shape == lead + (4, 128)
    assert x["g"].shape == lead + (4, 128) and x["beta"].shape == lead + (4,)
    if f.pregated:
        assert x["g"].dtype == x["beta"].dtype == torch.float32
        assert (x["g"] < 0).all() and ((x["beta"] > 0) & (x["beta"] < 1)).all()
        assert x["A_log"] is None and x["dt_bias"] is None
    else:
        assert x["g"].dtype == x["beta"].dtype == torch.bfloat16
        assert x["A_log"].shape == (4,) and x["dt_bias"].shape == (4 * 128,)
    assert x["pool"].shape == (case.pool_slots, 4, 128, 128) and x["pool"].dtype == torch.bfloat16
    ids = x["idx"]
    assert ids.dtype == f.index_dtype and ids.shape == ((3,) if T == 1 else (3, T))
    flat = ids.reshape(-1).tolist()
    assert len(set(flat)) == len(flat) and all(0 <= i < case.pool_slots for i in flat)
    if T == 1:
        assert x["acc"] is None
    else:
        assert x["acc"].dtype == torch.int32 and ((x["acc"] >= 1) & (x["acc"] <= T)).all()
    if f.varlen:
        assert x["cu"].dtype == torch.int32 and x["cu"].tolist() == list(range(0, 3 * T + 1, T))
    else:
        assert x["cu"] is None
    kw = bd.decode_kwargs(x)
    assert kw["state_v_first"] is f.v_first and kw["inplace_final_state"] is True
    assert kw["use_gate_in_kernel"] is (not f.pregated) and kw["use_beta_sigmoid_in_kernel"] is (not f.pregated)
    assert kw["lower_bound"] == (None if f.pregated else bd.LOWER_BOUND)


def fixed_timer(times):
    """A stand-in for kdakit.bench.time_ms: runs the call once, returns the next of `times` (ms)."""
    it = iter(times)

    def timer(fn, reps, flush):
        fn()
        return next(it)
    return timer


@pytest.mark.parametrize("form", bd.FORM_NAMES)
def test_row_through_kdakit_cpu(form):
    """The row's calls run kdakit's CPU decode from the same start for both 'libraries' (here kdakit twice): the
    outputs and updated slots agree exactly, the slots the call does not touch are unchanged."""
    case = small_case(form, "fp32", T=4, N=2)
    spare_before = {}

    def peer(x):  # records the untouched slots' start, then runs the same call
        touched = set(x["idx"].reshape(-1).tolist())
        for s in range(x["pool"].shape[0]):
            if s not in touched:
                spare_before.setdefault(s, x["pool"][s].clone())
        out = bd.run_kdakit_decode(x)
        for s, before in spare_before.items():
            assert torch.equal(x["pool"][s], before)
        return out

    row = bd.bench_row(case, timer=fixed_timer([0.02, 0.01]), reps=1, bw=1e12, flush=None, fla=peer, device="cpu")
    assert row["kdakit_error"] is None and row["fla_error"] is None
    assert row["diff_out"] == 0.0 and row["diff_state"] == 0.0
    assert row["fla_us"] == pytest.approx(20.0) and row["kdakit_us"] == pytest.approx(10.0)  # FLA is timed first
    assert row["kdakit_bw"] == pytest.approx(case.state_bytes / 10e-6 / 1e12)
    assert row["met"] is True and row["verdict"] == "yes"
    json.dumps(row)  # the JSON record


def test_row_flags_differences_and_errors():
    case = small_case("varlen-vfirst", T=1)

    def off_by_one_slot(x):  # right outputs, one updated slot wrong
        bd.run_kdakit_decode(x)
        x["pool"][int(x["idx"][0])] += 1.0

    row = bd.bench_row(case, timer=fixed_timer([0.02, 0.01]), reps=1, bw=1e12, flush=None, fla=off_by_one_slot,
                       device="cpu")
    assert row["diff_out"] == 0.0 and row["diff_state"] > bd.DIFF_FLAG
    assert row["met"] is False and "differs from FLA" in row["verdict"]

    def raises(x):
        raise ValueError("g: float32 is not accepted")

    row = bd.bench_row(case, timer=fixed_timer([0.01]), reps=1, bw=1e12, flush=None, fla=raises, device="cpu")
    assert row["fla_error"] == "ValueError: g: float32 is not accepted" and row["fla_us"] is None
    assert row["kdakit_us"] == pytest.approx(10.0) and row["met"] is None and row["verdict"] == "FLA did not run"

    class Broken:
        @staticmethod
        def fused_recurrent_kda_fwd(*args, **kwargs):
            raise RuntimeError("no kernel for this form")

    row = bd.bench_row(case, timer=fixed_timer([0.02]), reps=1, bw=1e12, flush=None, fla=bd.run_kdakit_decode,
                       lib=Broken, device="cpu")
    assert row["kdakit_error"] == "RuntimeError: no kernel for this form" and row["fla_us"] == pytest.approx(20.0)
    assert row["met"] is False and row["verdict"] == "no: kdakit did not run"


def test_run_stops_when_the_cuda_context_is_lost(monkeypatch):
    cases = [small_case("batch-vfirst", N=n) for n in (1, 2, 3)]
    calls = []

    def inputs(case, device):
        calls.append(case.N)
        if case.N == 1:
            raise torch.OutOfMemoryError("CUDA out of memory")  # the row fails, the run goes on
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(bd, "decode_inputs", inputs)
    lines = []
    rows = bd.run_rows(cases, timer=fixed_timer([]), reps=1, bw=1e12, flush=None, device="cpu", log=lines.append)
    assert calls == [1, 2] and len(rows) == 2
    assert rows[0]["verdict"] == "row not run: OutOfMemoryError: CUDA out of memory" and rows[0]["met"] is False
    assert rows[1]["kdakit_error"].startswith("row not run: RuntimeError: CUDA error")
    assert "the CUDA context is lost" in lines[-1]


def test_verdicts():
    base = dict(N=256, kdakit_us=10.0, fla_us=12.0, kdakit_bw=0.9, diff_out=1e-3, diff_state=1e-3, fla_error=None)
    assert bd.verdict(base) == (True, "yes")
    assert bd.verdict({**base, "kdakit_bw": 0.8}) == (False, "no: 80% < 85% of copy BW")
    assert bd.verdict({**base, "N": 32, "kdakit_bw": 0.1}) == (True, "yes")  # the bandwidth goal starts at N = 256
    assert bd.verdict({**base, "kdakit_us": 12.0}) == (False, "no: not faster than FLA")
    assert bd.verdict({**base, "diff_out": float("nan")}) == (False, "no: differs from FLA")
    assert bd.verdict({**base, "fla_us": None}) == (None, "no FLA; bandwidth met")


def test_tables_and_cli_listing(capsys):
    rows = [dict(name=c.name, form=c.form.name, pool=c.pool, T=c.T, H=c.H, HV=c.HV, N=c.N, slots=c.pool_slots,
                 state_mb=c.state_bytes / 1e6, kdakit_us=10.0, fla_us=None if c.N == 1 else 20.0, kdakit_bw=0.9,
                 fla_bw=None if c.N == 1 else 0.45, diff_out=None if c.N == 1 else 1e-3, diff_state=1e-3,
                 kdakit_error=None, fla_error="E: x" if c.N == 1 else None, met=c.N != 1, verdict="v")
            for c in bd.decode_cases(["batch-vfirst", "pregated-fp32"], ["T1 N1 H16", "T4 N256 H32 bf16"])]
    table = bd.decode_table(rows).splitlines()
    assert len(table) == 2 + len(rows) == 8
    assert all(line.count("|") == 13 for line in table)
    assert table[4].startswith("| batch-vfirst | T4 N256 H32 bf16 | 1024 | ")
    summary = bd.form_summary(rows).splitlines()
    assert summary[2] == "| batch-vfirst | 1/3 | 90% | 0.50 | 0.50 | 2 |"
    assert bd.errors_list(rows).count("fla: E: x") == 4
    assert bench.main(["--list", "--only", "decode T4 N1024", "--forms", "spare-slots"]) == 0
    out = capsys.readouterr().out
    assert "decode T4 N1024 H32 fp32 spare-slots  (pool slots 8192" in out
    assert "0 forward rows, 6 decode rows, 0 training rows" in out


# --- forward and training rows, peers -------------------------------------------------------------------------------

def test_rows_selected_by_only_and_listed(capsys):
    names = [s[0] for s in bench.FORWARD_SHAPES]
    assert len(set(names)) == len(names)
    for new in ("B1 T2048 H12", "B32 T512 H16", "B1 T1048576 H4"):
        assert new in names
    assert dict((s[0], s[1:]) for s in bench.FORWARD_SHAPES)["B1 T1048576 H4"] == (1, 1048576, 4, 4, None)
    assert [s[0] for s in bt.TRAIN_SHAPES] == ["train B1 T8192 H64", "train B2 T4096 H32", "train B8 T4096 H32",
                                               "train varlen6 H64", "train GVA H16 HV64 T8192",
                                               "train B1 T65536 H8"]
    assert dict((s[0], s[5]) for s in bt.TRAIN_SHAPES)["train varlen6 H64"] == [1300, 547, 2048, 963, 271, 3063]
    shapes, cases, train = bench.selected_rows(bench.parse_args(["--only", "train"]))
    assert shapes == [] and cases == [] and train == bt.TRAIN_SHAPES
    # A shape's name selects its forward row and its training row.
    shapes, cases, train = bench.selected_rows(bench.parse_args(["--only", "B8 T4096 H32"]))
    assert [s[0] for s in shapes] == ["B8 T4096 H32"] and [s[0] for s in train] == ["train B8 T4096 H32"]
    assert cases == []
    # --sections keeps only the named sections.
    shapes, cases, train = bench.selected_rows(bench.parse_args(["--only", "B8 T4096 H32", "--sections", "forward"]))
    assert [s[0] for s in shapes] == ["B8 T4096 H32"] and train == [] and cases == []
    shapes, cases, train = bench.selected_rows(bench.parse_args(["--sections", "decode"]))
    assert shapes == [] and train == [] and len(cases) == 288
    assert bench.main(["--list", "--only", "train"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [s[0] for s in bt.TRAIN_SHAPES] + ["0 forward rows, 0 decode rows, 6 training rows"]
    assert bench.main(["--list", "--only", "T1048576", "train B1 T65536"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["B1 T1048576 H4", "train B1 T65536 H8", "1 forward rows, 0 decode rows, 1 training rows"]


def test_gate_dtype_section_only_when_asked(capsys):
    assert bench.selected_gate_rows(bench.parse_args([])) == []  # not a default section
    assert "gate-dtype" in bench.SECTIONS and "gate-dtype" not in bench.DEFAULT_SECTIONS
    rows = bench.selected_gate_rows(bench.parse_args(["--sections", "gate-dtype", "--only", "B8 T4096 H32"]))
    assert [s[0] for s in rows] == ["B8 T4096 H32"]
    assert len(bench.selected_gate_rows(bench.parse_args(["--sections", "gate-dtype"]))) == len(bench.FORWARD_SHAPES)
    assert bench.main(["--list", "--sections", "gate-dtype", "--only", "B1 T512"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "gate-dtype B1 T512 H64", "0 forward rows, 0 decode rows, 0 training rows, 1 gate-dtype rows"]


def test_gate_dtype_row_through_kdakit_cpu():
    """Both calls' outputs through the CPU path (same bits: g widened exactly), each dtype timed in every round, and
    the verdict from the times the timer gives."""
    torch.manual_seed(0)
    B, T, H, K = 1, 70, 2, 16
    bf = torch.bfloat16
    x = dict(q=torch.randn(B, T, H, K, dtype=bf), k=torch.randn(B, T, H, K, dtype=bf),
             v=torch.randn(B, T, H, K, dtype=bf), g=torch.randn(B, T, H, K, dtype=bf),
             beta=torch.randn(B, T, H, dtype=bf), A_log=torch.log(torch.empty(H).uniform_(1, 16)),
             dt_bias=torch.randn(H * K), h0=torch.randn(B, H, K, K),
             cu=None, cu_cpu=None)
    seen = []

    def timer(fn, reps, flush):
        fn()
        seen.append(reps)
        return 1.0 if len(seen) % 2 else 1.25  # bf16 g 1.0 ms, fp32 g 1.25 ms
    r = bg.gate_dtype_row("row", x, bench.run_kdakit, timer, 7, 1e12, None)
    assert seen == [7] * (2 * bg.ROUNDS)
    assert r["same_bits"] and r["bf16"] == 1.0 and r["fp32"] == 1.25
    assert r["extra"] == pytest.approx(x["g"].numel() * 2 / 1e12 * 1e3)
    assert not r["meets"]  # 0.25 ms slower, against nanoseconds of extra bytes
    assert bg.gate_dtype_row("row", x, bench.run_kdakit, lambda fn, reps, flush: 1.0, 7, 1e12, None)["meets"]


def test_gate_recipes():
    torch.manual_seed(0)
    a_fla, b_fla = bench.gate_params(4, "fla", "cpu")
    a_zero, b_zero = bench.gate_params(4, "zero-bias", "cpu")
    assert a_fla.shape == a_zero.shape == (4,) and b_fla.shape == b_zero.shape == (4 * bench.D,)
    assert ((a_fla.exp() >= 1) & (a_fla.exp() <= 16)).all() and ((a_zero.exp() >= 1) & (a_zero.exp() <= 16)).all()
    assert b_fla.std() > 0.5 and torch.count_nonzero(b_zero) == 0
    with pytest.raises(ValueError, match="recipe: expected one of"):
        bench.gate_params(4, "fast", "cpu")
    assert bench.parse_args([]).recipe == "fla" and bench.parse_args(["--recipe", "zero-bias"]).recipe == "zero-bias"
    with pytest.raises(SystemExit):
        bench.parse_args(["--recipe", "fast"])


def test_gate_dtype_verdict_and_table():
    ok = bg.verdict(dict(name="A", bf16=1.0, fp32=1.05, extra=0.06, same_bits=True))
    slow = bg.verdict(dict(name="B", bf16=1.0, fp32=1.2, extra=0.06, same_bits=True))
    bits = bg.verdict(dict(name="C", bf16=1.0, fp32=0.9, extra=0.06, same_bits=False))
    assert ok["meets"] and not slow["meets"] and not bits["meets"]
    assert slow["diff"] == pytest.approx(0.2)
    t = bg.table([ok, slow, bits])
    assert t.startswith("1 of 3 rows meet the line.")
    assert "| A | 1.000 | 1.050 | +0.050 | 0.060 | yes | yes |" in t
    assert "| C | 1.000 | 0.900 | -0.100 | 0.060 | no | no |" in t


def forward_row(name, cudnn=None, fla=2.0, fk=None):
    return dict(name=name, floor=0.5, ours=1.0, fla=fla, fk=fk, fk_diff=3e-3 if fk else None, cudnn=cudnn,
                diff=1e-3 if fla else None, cudnn_diff=2e-3 if cudnn else None)


def test_forward_table_has_the_cudnn_columns():
    table = bench.forward_table([forward_row("B1 T2048 H12", cudnn=0.8), forward_row("GVA", fla=None)],
                                with_flashkda=False).splitlines()
    assert table[0].endswith("| cuDNN ms | kdakit/cuDNN | rel. diff vs FLA | cuDNN rel. diff |")
    assert all(line.count("|") == 11 for line in table)
    assert table[2] == "| B1 T2048 H12 | 0.500 | 1.000 | 2.000 | 0.50 | 2.0 | 0.800 | 1.25 | 1.0e-03 | 2.0e-03 |"
    assert table[3] == "| GVA | 0.500 | 1.000 | — | — | 2.0 | — | — | — | — |"
    with_fk = bench.forward_table([forward_row("B1", cudnn=0.8, fk=1.25), forward_row("GVA", cudnn=0.8)],
                                  with_flashkda=True).splitlines()
    assert all(line.count("|") == 14 for line in with_fk)
    assert "| FlashKDA ms | kdakit/FlashKDA | cuDNN ms |" in with_fk[0]
    assert with_fk[0].endswith("| rel. diff vs FLA | FlashKDA rel. diff | cuDNN rel. diff |")
    assert with_fk[2] == "| B1 | 0.500 | 1.000 | 2.000 | 0.50 | 2.0 | 1.250 | 0.80 | 0.800 | 1.25 | 1.0e-03 | 3.0e-03 | 2.0e-03 |"
    assert with_fk[3] == "| GVA | 0.500 | 1.000 | 2.000 | 0.50 | 2.0 | — | — | 0.800 | 1.25 | 1.0e-03 | — | 2.0e-03 |"


def test_notes_log_each_reason_once():
    logged = []
    notes = bp.Notes(logged.append)
    notes("cuDNN did not run on A: E: x")
    notes("cuDNN did not run on A: E: x")
    notes("FLA not importable: E: y")
    assert logged == notes.lines == ["cuDNN did not run on A: E: x", "FLA not importable: E: y"]
    assert bench.notes_list(notes.lines) == "- cuDNN did not run on A: E: x\n- FLA not importable: E: y"
    assert bp.error_text(ValueError("a\n  b" + "c" * 400)).startswith("ValueError: a bccc")
    assert bp.error_text(ValueError("c" * 400)).endswith(" ...") and len(bp.error_text(ValueError("c" * 400))) < 310


def test_missing_peers_are_none_with_the_reason(monkeypatch):
    for mod in ("cudnn", "cudnn.linear_attention", "cudnn.linear_attention.ops", "fla", "fla.ops", "fla.ops.kda",
                "flash_kda"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    logged = []
    assert bp.cudnn_kda(logged.append) is None
    assert bp.fla_chunk_kda(logged.append) is None and bench.fla_runner(logged.append) is None
    assert bp.flashkda_runner(logged.append) is None
    assert logged[0].startswith("cuDNN KDA (nvidia-cudnn-frontend) not importable: ModuleNotFoundError")
    assert [line.split(" not importable")[0] for line in logged] == ["cuDNN KDA (nvidia-cudnn-frontend)", "FLA", "FLA",
                                                                    "FlashKDA"]


def cpu_inputs(B=2, T=20, H=2, HV=2, lens=None, dtype=torch.float32):
    """A row's inputs as kdakit.bench.forward_inputs makes them, on the CPU, small (fp32 unless told)."""
    g = torch.Generator().manual_seed(1)
    if lens is not None:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        B, T, N = 1, int(cu[-1]), len(lens)
    else:
        cu, N = None, B

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    return dict(q=rnd(B, T, H, 128), k=rnd(B, T, H, 128), v=rnd(B, T, HV, 128), g=rnd(B, T, HV, 128),
                beta=rnd(B, T, HV), A_log=torch.log(torch.rand(HV, generator=g) * 15 + 1),
                dt_bias=torch.randn(HV * 128, generator=g), h0=torch.randn(N, HV, 128, 128, generator=g),
                cu=cu, cu_cpu=cu)


class FakeCudnn:
    """cuDNN's `kimi_delta_attention` contract (THD tensors, int32 cu_seqlens, v-first state, the plan pinned),
    computed by kdakit's CPU path with state_v_first=True; it records each call's options."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, safe_gate=False,
                 gate_lower_bound=None, a_log=None, dt_bias=None, plan_name=None):
        assert q.dim() == k.dim() == v.dim() == g.dim() == 3 and beta.dim() == 2
        assert cu_seqlens.dtype == torch.int32 and int(cu_seqlens[-1]) == q.shape[0]
        assert initial_state.shape == (cu_seqlens.numel() - 1, v.shape[1], 128, 128) and initial_state.is_contiguous()
        if safe_gate:
            assert a_log.shape == (v.shape[1],) and dt_bias.shape == (v.shape[1], 128)
            assert a_log.dtype == dt_bias.dtype == torch.float32
        self.calls.append(dict(plan_name=plan_name, l2=use_qk_l2norm_in_kernel, sigmoid=use_beta_sigmoid_in_kernel,
                               safe_gate=safe_gate, lower_bound=gate_lower_bound, g=g.dtype, beta=beta.dtype))
        o, ht = kdakit.chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                                 initial_state=initial_state, output_final_state=output_final_state,
                                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=safe_gate,
                                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, safe_gate=safe_gate,
                                 lower_bound=gate_lower_bound, A_log=a_log, dt_bias=dt_bias, state_v_first=True,
                                 cu_seqlens=cu_seqlens)
        return o[0], ht


@pytest.mark.parametrize("lens", [None, [7, 13, 4]])
def test_cudnn_forward_call_matches_kdakit(lens):
    x = cpu_inputs(lens=lens)
    fake = FakeCudnn()
    o, ht = bp.cudnn_forward_call(fake, x)()
    ko, kht = bench.run_kdakit(x)
    assert fake.calls == [dict(plan_name="kda_hopper_cuda", l2=True, sigmoid=True, safe_gate=True, lower_bound=-5.0,
                               g=torch.float32, beta=torch.float32)]
    assert o.shape == ko.shape and ht.shape == kht.shape
    assert bench.rel_diff(o, ko) < 1e-5 and bench.rel_diff(ht, kht) < 1e-5


@pytest.mark.parametrize("lens", [None, [7, 13, 4]])
def test_cudnn_train_step_gives_kdakit_gradients(lens):
    """The torch-side L2 norm, gate and sigmoid around the unfused op, and the v-first h0, give kdakit's gradients."""
    x = cpu_inputs(lens=lens)
    fake = FakeCudnn()
    grads = bp.cudnn_train_step(fake, x)()
    ref = bp.kdakit_train_step(x)()
    assert fake.calls == [dict(plan_name="kda_hopper_cuda", l2=False, sigmoid=False, safe_gate=False,
                               lower_bound=None, g=torch.float32, beta=torch.float32)]
    assert set(grads) == set(ref) == set(bp.GRAD_NAMES)
    assert all(grads[n].shape == ref[n].shape for n in bp.GRAD_NAMES)
    assert bt.grad_diff(grads, ref, bench.rel_diff) < 1e-4
    assert bt.grad_diff(bp.fla_train_step(kdakit.chunk_kda, x)(), ref, bench.rel_diff) == 0.0  # same call form
    bad = dict(ref, h0=ref["h0"].transpose(-1, -2))  # a layout slip is caught
    assert bt.grad_diff(grads, bad, bench.rel_diff) > 0.1


def test_training_row_and_table():
    x = cpu_inputs()
    measured = []

    def fake_measure(step, *, timer, reps, flush):
        measured.append(reps)
        grads = step()
        return {1: 3.0, 2: 6.0, 3: 2.0}[len(measured)], 100.0 * len(measured), grads

    def fails(x):
        def step():
            raise RuntimeError("no kda_hopper_cuda plan for this graph")
        return step
    logged = []
    notes = bp.Notes(logged.append)
    steps = {"kdakit": bp.kdakit_train_step, "FLA": lambda x: bp.fla_train_step(kdakit.chunk_kda, x),
             "cuDNN": lambda x: bp.cudnn_train_step(FakeCudnn(), x)}
    row = bt.bench_row(("train B2 T20 H2",), x, steps, timer=None, reps=5, flush=None, notes=notes,
                       rel_diff=bench.rel_diff, measure_fn=fake_measure)
    assert measured == [5, 5, 5] and logged == []
    assert (row["kdakit_ms"], row["FLA_ms"], row["cuDNN_ms"]) == (3.0, 6.0, 2.0)
    assert (row["kdakit_mib"], row["FLA_mib"], row["cuDNN_mib"]) == (100.0, 200.0, 300.0)
    assert row["diff_fla"] == 0.0 and row["diff_cudnn"] < 1e-4
    failed = bt.bench_row(("train GVA",), x, dict(steps, cuDNN=fails, FLA=None), timer=None, reps=1, flush=None,
                          notes=notes, rel_diff=bench.rel_diff, measure_fn=lambda step, **kw: (1.0, 1.0, step()))
    assert failed["cuDNN_ms"] is None and failed["diff_cudnn"] is None and failed["FLA_ms"] is None
    assert failed["diff_fla"] is None and failed["kdakit_ms"] == 1.0
    assert logged == ["cuDNN did not run on train GVA: RuntimeError: no kda_hopper_cuda plan for this graph"]
    table = bt.train_table([row, failed]).splitlines()
    assert len(table) == 4 and all(line.count("|") == 12 for line in table)
    assert table[0].startswith("| row | kdakit ms | FLA ms | cuDNN ms | kdakit/FLA | kdakit/cuDNN |")
    assert table[2].startswith("| train B2 T20 H2 | 3.000 | 6.000 | 2.000 | 0.50 | 1.50 | 100 | 200 | 300 | 0.0e+00 |")
    assert table[3] == "| train GVA | 1.000 | — | — | — | — | 1 | — | — | — | — |"


def test_training_plot_takes_missing_peers(tmp_path):
    pytest.importorskip("matplotlib")
    row = dict(name="train A", kdakit_ms=3.0, FLA_ms=None, cuDNN_ms=2.0, kdakit_mib=10.0, FLA_mib=None, cuDNN_mib=None)
    path = tmp_path / "train.png"
    bt.plot([row, dict(row, name="train B", kdakit_ms=None)], path, "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_forward_plot_takes_missing_peers(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "forward.png"
    bench.plot_forward([forward_row("A", cudnn=0.8, fk=1.2), forward_row("GVA", fla=None)], path, "dev")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def load_fla_suite():
    spec = importlib.util.spec_from_file_location("fla_suite", ROOT / "tools" / "gpu" / "fla_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HEAD = ("import torch\n\nfrom fla.ops.kda import chunk_kda, fused_recurrent_kda\n"
        "from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd\n"
        "from fla.ops.kda.naive import naive_recurrent_kda\n")


def test_fla_suite_rewrites_exactly_the_kda_imports(tmp_path):
    fs = load_fla_suite()
    new = fs.rewrite(HEAD)
    assert new == ("import torch\n\nfrom kdakit import chunk_kda, fused_recurrent_kda\n"
                   "from kdakit import fused_recurrent_kda_fwd\nfrom fla.ops.kda.naive import naive_recurrent_kda\n")
    with pytest.raises(SystemExit, match="found it 0 times"):
        fs.rewrite(HEAD.replace("from fla.ops.kda import", "from fla.ops.kda.chunk import"))
    with pytest.raises(SystemExit, match="still imported"):
        fs.rewrite(HEAD + "from fla.ops.kda.chunk import chunk_kda\n")
    src = tmp_path / "src"
    src.mkdir()
    (src / "test_kda.py").write_text(HEAD)
    (src / "conftest.py").write_text("# FLA's\n")
    fs.prepare(src, tmp_path / "work", tmp_path / "out")
    assert (tmp_path / "work" / "tests" / "ops" / "test_kda.py").read_text() == new
    assert (tmp_path / "work" / "tests" / "conftest.py").is_file()
    diff = (tmp_path / "out" / "fla_suite.diff").read_text()
    assert diff.count("\n-from fla") == 2 and diff.count("\n+from kdakit") == 2


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.ops.test_kda" name="test_fused_recurrent_state_v_first[B1]"/>
<testcase classname="tests.ops.test_kda" name="test_chunk[B2-fp16]"><failure message="NotImplementedError: chunk_kda:
 the CUDA backward is not implemented yet; run the forward under torch.no_grad()">tb</failure></testcase>
<testcase classname="tests.ops.test_kda" name="test_fused_recurrent[B1]"><failure message="kdakit.InvalidArgumentError:
 fused_recurrent_kda: has no backward">tb</failure></testcase>
<testcase classname="tests.ops.test_kda" name="test_fused_recurrent[B1]"><error message="failed on teardown">t</error>
</testcase>
<testcase classname="tests.ops.test_kda" name="test_gate[B1]"><failure message="AssertionError: dg">tb</failure>
</testcase>
<testcase classname="tests.ops.test_kda" name="test_fused_recurrent_vllm_decode[B7]"><skipped message="needs CUDA"/>
</testcase></testsuite></testsuites>"""


def test_fla_suite_summary_groups_failures(tmp_path, capsys):
    fs = load_fla_suite()
    (tmp_path / "j.xml").write_text(JUNIT)
    (tmp_path / "log").write_text("== 3 failed, 1 passed, 1 skipped, 7 deselected in 9.0s ==\n")
    assert fs.summary(tmp_path / "j.xml", tmp_path / "log", tmp_path, "bc3b101dcb71") == 1
    res = json.loads((tmp_path / "fla_suite.json").read_text())
    assert res["counts"] == dict(passed=1, failed=3, error=0, skipped=1) and res["deselected"] == 7
    assert [r["id"] for r in res["groups"]["other"]] == ["test_chunk[B2-fp16]", "test_fused_recurrent[B1]"]
    assert "has no backward" in res["groups"]["other"][1]["message"]
    assert [r["id"] for r in res["groups"]["fla-only"]] == ["test_gate[B1]"]
    assert "**1 passed, 3 failed, 0 errors, 1 skipped, 7 deselected**" in capsys.readouterr().out
    # Only FLA-only failures: exit status 0.
    only_fla = JUNIT.split('<testcase classname="tests.ops.test_kda" name="test_chunk[B2-fp16]">')[0] + \
        JUNIT.split("</testcase>\n", 3)[3]
    (tmp_path / "j.xml").write_text(only_fla)
    assert fs.summary(tmp_path / "j.xml", tmp_path / "log", tmp_path) == 0
    assert not json.loads((tmp_path / "fla_suite.json").read_text())["groups"]["other"]


def test_fla_suite_reads_a_cut_short_log(tmp_path):
    fs = load_fla_suite()
    (tmp_path / "log").write_text(
        "tests/ops/test_kda.py::test_chunk_varlen[H4-cu_seqlens[0, 15]-fp16] PASSED [ 1%]\n"
        "tests/ops/test_kda.py::test_chunk[B1] FAILED [ 2%]\n")
    rows = fs.results_from_log(tmp_path / "log")
    assert [(r["id"], r["outcome"]) for r in rows] == [("test_chunk_varlen[H4-cu_seqlens[0, 15]-fp16]", "passed"),
                                                       ("test_chunk[B1]", "failed")]
    assert "not test_flash_kda_chunk" in fs.deselect_expr()


def test_ab_rename_leaves_no_reference_to_the_current_package(tmp_path):
    """tools/gpu/ab_rename.sh on a copy of this tree's package: every self-reference is renamed (the script's own
    check passes), and one that its patterns miss fails the script instead of reaching an A/B."""
    import shutil
    import subprocess

    shutil.copytree(ROOT / "python" / "kdakit", tmp_path / "kdakit_base")
    script = str(ROOT / "tools" / "gpu" / "ab_rename.sh")
    run = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    text = "\n".join(p.read_text() for p in (tmp_path / "kdakit_base").rglob("*.py"))
    assert "import kdakit_base as kdakit" in text and "torch.ops.kdakit." not in text
    assert "\nimport kdakit\n" not in text and "from kdakit." not in text and "from kdakit import" not in text
    (tmp_path / "kdakit_base" / "late.py").write_text("def f():\n    from  kdakit import chunk_kda\n")  # two spaces
    bad = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1 and "late.py" in bad.stderr


def test_ab_compare_runs_a_forward_and_a_decode_row(monkeypatch):
    """tools/gpu/ab_compare.py's row runner on the CPU, kdakit standing in for both builds: a forward row and a decode
    row each come out bit-identical with both timings (CUDA timing and synchronisation stubbed)."""
    import types

    spec = importlib.util.spec_from_file_location("ab_compare", ROOT / "tools" / "gpu" / "ab_compare.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)

    def forward_inputs(B, T, H, HV, lens):
        x = {n: torch.randn(B, T, h, bench.D, dtype=torch.bfloat16) for n, h in (("q", H), ("k", H), ("v", HV),
                                                                                   ("g", HV))}
        x["beta"] = torch.randn(B, T, HV, dtype=torch.bfloat16)
        x["A_log"], x["dt_bias"] = bench.gate_params(HV, device="cpu")
        x["h0"], x["cu"], x["cu_cpu"] = torch.randn(B, HV, bench.D, bench.D), None, None
        return x, 0

    timed = []
    stub = types.SimpleNamespace(forward_inputs=forward_inputs, run_kdakit=bench.run_kdakit,
                                 time_ms=lambda fn, reps, flush: (fn(), timed.append(1), 1.0)[-1])
    stub_decode = types.SimpleNamespace(decode_inputs=lambda case: bd.decode_inputs(case, device="cpu"),
                                        run_kdakit_decode=bd.run_kdakit_decode)
    args = types.SimpleNamespace(reps=2, block=1, profile=False)
    rows = [dict(name="forward", kind="forward", shape=(1, 20, 1, 1, None), seed=1),
            dict(name="decode", kind="decode", case=small_case("batch-vfirst"), seed=2)]
    for row in rows:
        res = ab.run_row(args, stub, stub_decode, kdakit, None, row)
        assert res["equal"] and res["outputs"], (row["name"], res)
        assert res["base_ms"] == res["cur_ms"] == 1.0 and res["ratio"] == 1.0
    assert len(timed) == 2 * 2 * 2  # rows x reps x builds


def test_detached_job_does_not_hold_the_callers_output(tmp_path):
    """tools/gpu/detached.sh returns after its wait even when its output is piped: the job it starts keeps none of the
    caller's file descriptors (a job holding the pipe would keep `detached.sh ... | tail` waiting for the job)."""
    import os
    import subprocess
    import time

    env = dict(os.environ, KDAKIT_DETACHED_DIR=str(tmp_path / "job"), OUT=str(tmp_path / "out"))
    script = ROOT / "tools" / "gpu" / "detached.sh"
    t0 = time.monotonic()
    run = subprocess.run(f"bash {script} 1 sleep 6 | tail -n 1", shell=True, env=env, capture_output=True, text=True,
                         timeout=60)
    took = time.monotonic() - t0
    assert "still running" in run.stdout, run.stdout + run.stderr
    assert took < 4, took
    subprocess.run(["bash", str(script), "10", "true"], env=env, capture_output=True, timeout=60)  # collect the job
