"""Small decode calls in place on state pools, for compute-sanitizer (memcheck, racecheck): T = 1 (the one-token form,
its state staged over several passes) and T = 4 (verify: 2-D slot ids, random accepted counts, the state written after
every token), fp32 and bf16 pools, v-first on a pool with spare slots (int64 slot ids) and [K,V] on a pool of exactly
the named slots; and varlen calls of at most N tokens with device cu_seqlens in both layouts, with empty sequences and
a 3-token one (the one-token form's MULTI instance, which runs it token by token). Each CUDA call is checked against
the CPU path of the same call on the same inputs (outputs and pool within 8e-3 relative RMS), and the slots no call
names must stay bit for bit as they were. Exits non-zero if a check fails."""
import sys

import torch

from kdakit import bench_decode as bd



def rel(a, b):
    return ((a.float().cpu() - b.float()).norm() / b.float().norm()).item()


torch.manual_seed(1)
bad = 0
for form, Ts in (("spare-slots", (1, 4)), ("batch-kfirst", (1, 4)), ("varlen-vfirst", (1,)), ("varlen-kfirst", (1,))):
    for T in Ts:
        for pool, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            # 40 sequences x 16 heads: enough CTAs per SM for the staged tiles (DecodeConfig's passes).
            case = bd.DecodeCase(bd.form_by_name(form), pool, dtype, T, 16, 16, 40)
            x, _ = bd.decode_inputs(case, device="cpu")
            if x["cu"] is not None:  # 40 tokens in 40 sequences, two of them empty and one of 3 tokens
                lens = [1] * 40
                lens[3], lens[4], lens[7] = 0, 0, 3
                x["cu"] = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
            pool0 = x["pool"].clone()
            xc = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in x.items()}
            bd.run_kdakit_decode(xc)
            torch.cuda.synchronize()
            bd.run_kdakit_decode(x)

            e_out, e_pool = rel(xc["out"], x["out"]), rel(xc["pool"], x["pool"])
            named = set(x["idx"].flatten().tolist())
            others = [i for i in range(pool0.shape[0]) if i not in named]
            untouched = torch.equal(xc["pool"].cpu()[others], pool0[others]) if others else True
            ok = e_out < 8e-3 and e_pool < 8e-3 and untouched
            bad += not ok
            print(f"{form} T{T} {pool}: out {e_out:.2e}, pool {e_pool:.2e}, {len(others)} other slots untouched "
                  f"{untouched}: {'ok' if ok else 'FAILED'}")
print("decode sanitize case", "OK" if bad == 0 else "FAILED")
sys.exit(1 if bad else 0)
