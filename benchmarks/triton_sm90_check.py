"""Compile every Triton kernel of oakenkv for an H100/H200 (sm_90a) on a machine without a GPU, and report
registers and spills (ptxas -v).

The interpreter runs the kernels' Python, not the GPU compiler: an operation it accepts may not lower (a gather,
a size-1 dimension, a type), and register spills only show in the compiled code. This compiles the launch
configurations the wrappers use (and the tuning variants of ``gpu_check.py``) with the ptxas shipped in the triton
wheel, so a GPU run meets no compile error it could have met here.

    python benchmarks/triton_sm90_check.py [--json OUT] [--arch 90]

Exit status 1 if a kernel does not compile. Takes ~2-4 minutes on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from oakenkv.kernels.triton import _oaken as F
from oakenkv.kernels.triton import attention as A
from oakenkv.kernels.triton import decode as Dk
from oakenkv.kernels.triton import encode as E
from oakenkv.kernels.triton import prefill as P
from oakenkv.kernels.triton import rotate as R

#: The scales' bytes of the default config (fp16 scales), what the wrappers pass as SB.
SB = F.scale_bytes(F.OakenConfig())
ERRS = {
    "E_POS": F.ERR_POSITION_RANGE, "E_ZERO": F.ERR_ZERO_ADVANCE, "E_FIFTH": F.ERR_FIFTH_BIT,
    "E_TRUNC": F.ERR_ESCAPE_TRUNCATED, "E_NOENTRY": F.ERR_ESCAPE_NO_ENTRY,
}  # fmt: skip


def _cases():
    enc_sig = {
        "x_ptr": "*fp16", "stride_x": "i32", "thr_ptr": "*fp32", "stride_thr": "i32", "rec_ptr": "*u8",
        "rec_dst_ptr": "*u8", "sp_ptr": "*u8", "sp_dst_ptr": "*u8", "count_ptr": "*i32", "N": "i32", "D": "i32",
        "REC": "i32", "CAP": "i32",
    }  # fmt: skip
    for d in (1024, 4096):
        nch = F.num_chunks(d)
        yield f"encode D={d}", E._encode_kernel, enc_sig, dict(
            ROWS=1, NCH_P=nch, INNER_BITS=5, OUTER_BITS=5, FP16=True, SB=SB, HAS_REC_DST=False, HAS_SP_DST=False, KP=64,
            NE=2, FLOOR=F.STEP_FLOOR, FP16_MAX=F.FP16_MAX, ERR_NONFINITE=F.ERR_NONFINITE,
            ERR_SCALE_OVERFLOW=F.ERR_SCALE_OVERFLOW,
        ), dict(num_warps=4 if d <= 2048 else 8, enable_fp_fusion=False)  # fmt: skip
    dec_sig = {
        "rec_ptr": "*u8", "rec_addr_ptr": "*i64", "sp_ptr": "*u8", "sp_addr_ptr": "*i64", "sp_len_ptr": "*i32",
        "thr_ptr": "*fp32", "stride_thr": "i32", "out_ptr": "*fp32", "stride_out": "i32", "status_ptr": "*i32",
        "N": "i32", "D": "i32",
    }  # fmt: skip
    for d in (1024, 4096):
        yield f"decode D={d}", Dk._decode_kernel, dec_sig, dict(
            BT=max(1, min(16, 4096 // d)), BLOCK_D=d, SB=SB, INNER_BITS=5, OUTER_BITS=5, SBLK=Dk.SPARSE_BLOCK,
            SBLK_LOG=Dk.SPARSE_BLOCK_LOG, OUT_F16=False, E_SCALE=F.ERR_SCALE_NONFINITE, **ERRS,
        ), dict(num_warps=4, enable_fp_fusion=False)  # fmt: skip
    att_sig = {
        "q_ptr": "*fp32", "sq_b": "i32", "sq_h": "i32", "dpool": "*u8", "spool": "*u8", "pages_ptr": "*i32",
        "sp_b": "i32", "sp_k": "i32", "addr_ptr": "*i64", "len_ptr": "*i32", "sa_b": "i32", "sa_k": "i32",
        "keep_ptr": "*u8", "sk_b": "i32", "thr_ptr": "*fp32", "scratch_ptr": "*u8", "pm_ptr": "*fp32",
        "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "status_ptr": "*i32", "status_stride": "i32", "T": "i32",
        "H": "i32", "Hq": "i32",
        "HD": "i32", "D": "i32", "page_size": "i32", "rec": "i32", "rpp": "i32", "scaling": "fp32",
        "softcap": "fp32", "split_tokens": "i32", "S": "i32",
    }  # fmt: skip
    configs = [(A.TILE_TOKENS, A.NUM_WARPS), (8, 4), (16, 4)]  # the default, then gpu_check's tuning variants
    for g in (4, 1):  # GQA 32q/8kv, MHA
        for bt, warps in configs:
            for fuse in (False, True):
                yield f"attention G={g} tile={bt} warps={warps} fused={fuse}", A._attn_kernel, att_sig, dict(
                    G=g, G_P=g, HD_P=128, BT=bt, SB=SB, INNER_BITS=5, OUTER_BITS=5, SBLK=1 << A.SPARSE_BLOCK_LOG,
                    SBLK_LOG=A.SPARSE_BLOCK_LOG, SOFTCAP=False, E_EVICTED=F.ERR_EVICTED, **ERRS,
                ), dict(num_warps=warps, enable_fp_fusion=fuse)  # fmt: skip
    comb_sig = {
        "pm_ptr": "*fp32", "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "out_ptr": "*fp32", "lse_ptr": "*fp32", "N": "i32",
        "S": "i32", "HD": "i32",
    }  # fmt: skip
    yield "combine", A._combine_kernel, comb_sig, dict(R=1, S_P=32, HD_P=128), dict(num_warps=4)
    pre_sig = {
        "q_ptr": "*fp32", "sq_b": "i32", "sq_h": "i32", "sq_s": "i32", "dpool": "*u8", "spool": "*u8",
        "pages_ptr": "*i32", "sp_b": "i32", "sp_k": "i32", "addr_ptr": "*i64", "len_ptr": "*i32", "sa_b": "i32",
        "sa_k": "i32", "mask_ptr": "*u8", "sm_b": "i32", "sm_s": "i32", "thr_ptr": "*fp32", "scratch_ptr": "*u8",
        "out_ptr": "*fp32", "so_b": "i32", "so_h": "i32", "so_s": "i32", "lse_ptr": "*fp32", "status_ptr": "*i32",
        "status_stride": "i32", "S": "i32", "T": "i32", "past": "i32", "skip": "i32", "H": "i32", "HD": "i32",
        "D": "i32", "page_size": "i32", "rec": "i32", "rpp": "i32", "scaling": "fp32", "softcap": "fp32",
        "NQB": "i32",
    }  # fmt: skip
    for g in (4, 1):  # the prefill kernel: GQA 32q/8kv and MHA; float32 (IEEE) and bfloat16 products; masks
        for dot, q_type in ((P.DOT_FP32, "*fp32"), (P.DOT_BF16, "*bf16"), (P.DOT_FP16, "*fp16")):
            for masked in (False, True):
                yield f"prefill G={g} dot={dot} masked={masked}", P._prefill_kernel, {**pre_sig, "q_ptr": q_type}, dict(
                    G=g, G_P=g, BQ=P.QUERY_BLOCK, HD_P=128, BT=P.TILE_TOKENS, SB=SB, INNER_BITS=5, OUTER_BITS=5,
                    SBLK=1 << A.SPARSE_BLOCK_LOG, SBLK_LOG=A.SPARSE_BLOCK_LOG, SOFTCAP=False, MASKED=masked, DOT=dot,
                    E_EVICTED=F.ERR_EVICTED, **ERRS,
                ), dict(num_warps=P.NUM_WARPS, enable_fp_fusion=False)  # fmt: skip
    rot_sig = {"x_ptr": "*fp32", "stride_x": "i32", "shift_ptr": "*fp32", "N": "i32", "H": "i32", "HD_SCALE": "fp32"}
    for heads, hd in ((8, 128), (32, 128), (4, 64)):  # keys of a GQA / MHA layer, the default model's 3 x 64
        yield f"rotate H={heads} hd={hd}", R._shift_rotate_kernel, rot_sig, dict(
            BR=max(1, min(16, 4096 // (heads * hd))), H_P=heads, HD=hd, LOG_HD=hd.bit_length() - 1, SHIFT=True,
            ROTATE=True,
        ), dict(num_warps=4, enable_fp_fusion=False)  # fmt: skip
    copy_sig = {"src": "*u8", "src_off": "*i64", "dst": "*u8", "dst_off": "*i64", "lens": "*i32"}
    yield "copy_spans", E._copy_spans_kernel, copy_sig, dict(BLOCK=256), dict(num_warps=4)


def _ptxas_info(ptx: str, arch: int) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    info: dict = {}
    for line in r.stderr.splitlines():
        if "registers" in line:
            info["registers"] = int(line.split("Used ")[1].split(" registers")[0])
        if "spill stores" in line:
            info["spill_store_bytes"] = int(line.split("bytes spill stores")[0].split(",")[-1])
    return info


def _machine() -> str:
    """``lscpu``'s model name and the core count (no GPU is needed: the compiler runs on the CPU)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        name = "?"
    return f"{name}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    args = p.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    results, failed = [], 0
    for name, fn, sig, consts, opts in _cases():
        t = time.perf_counter()
        try:
            k = triton.compile(ASTSource(fn, {**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts),
                               target=target, options=opts)  # fmt: skip
            info = {"ok": True, **_ptxas_info(k.asm["ptx"], args.arch), "shared_bytes": k.metadata.shared}
        except Exception as e:
            failed += 1
            info = {"ok": False, "error": repr(e)[:500]}
        info.update(name=name, seconds=round(time.perf_counter() - t, 1))
        results.append(info)
        print(json.dumps(info), flush=True)
    if args.json:
        meta = {
            "command": " ".join(["python", *sys.argv]),
            "machine": _machine(),
            "load": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d"),
        }
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "arch": args.arch, **meta, "kernels": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
