"""Compile-only probe (session 40): a warp-specialized Hopper GEMM tile in Gluon, built for sm_90 on a CPU.

Needs triton 3.6.0, the GPU image's (``pip install triton==3.6.0`` into a scratch venv; 3.9's Gluon API differs and
fails on it). One TMA-load worker warp fills a ring of shared-memory stages guarded by ``ready`` / ``empty``
mbarriers; the default warpgroup runs ``warpgroup_mma`` on them and stores the tile through TMA. Never run on a GPU:
it shows that Gluon's warp-specialized Hopper kernels can be written and checked statically here (HGMMA, UTMALDG,
USETMAXREG in the SASS; registers and shared memory from cuobjdump). Session 40 output: REG 168 (maxnreg), STACK 0,
8 HGMMA, 3 UTMALDG, USETMAXREG.DEALLOC 0x18 for the worker, shared 131,132 B at 128 x 128 x 64, 3 stages, 8 warps.
"""
import re, subprocess, tempfile, os, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, K, BLOCK_K: gl.constexpr):
    stages: gl.constexpr = a_bufs.type.shape[0]
    for i in range(gl.cdiv(K, BLOCK_K)):
        s = i % stages
        phase = (i // stages) & 1
        mbarrier.wait(empty.index(s), phase ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, i * BLOCK_K], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [i * BLOCK_K, off_n], ready.index(s), b_bufs.index(s))


@gluon.jit
def _mma(a_bufs, b_bufs, ready, empty, c_desc, off_m, off_n, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
         num_warps: gl.constexpr):
    stages: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    for i in range(gl.cdiv(K, BLOCK_K)):
        s = i % stages
        mbarrier.wait(ready.index(s), (i // stages) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(s), count=1)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(0)


@gluon.jit
def ws_gemm(a_desc, b_desc, c_desc, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
            STAGES: gl.constexpr, num_warps: gl.constexpr):
    off_m = gl.program_id(0) * BLOCK_M
    off_n = gl.program_id(1) * BLOCK_N
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mma, (a_bufs, b_bufs, ready, empty, c_desc, off_m, off_n, K, BLOCK_M, BLOCK_N, BLOCK_K, num_warps)),
        (_load, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, K, BLOCK_K)),
    ], [1], [24])


def main():
    BM, BN, BK, ST = 128, 128, 64, 3
    lay_a = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    lay_b = gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16)
    lay_c = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
    print(lay_a, lay_b, sep="\n")
    sig = {"a_desc": f"tensordesc<bf16[{BM},{BK}],{lay_a!r}>", "b_desc": f"tensordesc<bf16[{BK},{BN}],{lay_b!r}>",
           "c_desc": f"tensordesc<bf16[{BM},{BN}],{lay_c!r}>", "K": "i32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "STAGES": "constexpr",
           "num_warps": "constexpr"}
    src = GluonASTSource(ws_gemm, sig, constexprs={"BLOCK_M": BM, "BLOCK_N": BN, "BLOCK_K": BK, "STAGES": ST,
                                                   "num_warps": 4})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
    ptx = k.asm["ptx"]
    print("wgmma:", len(re.findall(r"wgmma\.mma_async", ptx)), "setmaxnreg:", re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32 \d+", ptx)[:4],
          "cp.async.bulk.tensor:", len(re.findall(r"cp\.async\.bulk\.tensor", ptx)))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(k.asm["cubin"]); cubin.flush()
        sass = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    print(usage.strip().splitlines()[-1])
    print("shared", k.metadata.shared, "warps", k.metadata.num_warps, "HGMMA", len(re.findall(r"HGMMA", sass)),
          "USETMAXREG", re.findall(r"USETMAXREG[^;]*", sass)[:4], "UTMALDG", len(re.findall("UTMALDG", sass)))


if __name__ == "__main__":
    main()
