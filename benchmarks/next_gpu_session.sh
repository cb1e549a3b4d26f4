#!/usr/bin/env bash
# The measurements waiting for a GPU (benchmarks/NOTES.md, "Waiting for the next GPU session"), each step
# capped so that a part fits one 600 s device call (caps allow a cold compile cache: a first gem-large run
# took 193 s in sessions 3 and 4). On a 2-GPU host the two chains of a part run side by side, one per GPU
# and sharing the host's 16 cores, so each part pairs a CPU-heavy chain (compiles, 12 loader workers) with
# a light one, and the gem-large timings (part 2) run beside nothing heavy. On one GPU run a part's chains
# as separate calls (PART 1a, 1b, 2a, 2b).
#   bash benchmarks/next_gpu_session.sh OUT_DIR PART
# 1 (1a | 1b): the calibration with the host probe and the planner's predictions from it (issue 13), the
#   phase-split GPU test, bench train with layers and with fp8 MLPs (issue 10) | the FP8 MLP block (issue
#   6), FP8 attention, BlockAttention, JFA full (kernel issues)
# 2 (2a | 2b): gem-large on one GPU at batch 256 then 512 (issues 13, 11) | gem-large at batch 512 with the
#   sequence stream in bf16 (issue 10), the embedding lookup (issue 8)
# 3 (3a | 3b): issue 11's 1-GPU loss curves, fp32 (the noise floor) | bf16, then gem-small with Inductor's
#   max-autotune (issue 10)
# 4 (2 GPUs): issue 11's FSDP curve on 2 GPUs and its verdict against part 3's curves (carried in as
#   CURVES_DIR), then FSDP with the SM-free all-gather (SINGLE_GPU_MFU = part 2a's batch-512 e2e_mfu)
# 5 (2 GPUs): issue 11's layouts of gem-large at batch 512 per GPU (SINGLE_GPU_MFU as in part 4)
# k (one GPU, session 5): BlockAttention full (issue 5: power-law workload, Flex and JFA peers, the rotary
#   cost since the SFU sin/cos), the FP8 MLP block (issue 6), the embedding lookup (issue 8)
# plan (one GPU, session 5): the calibration with the host probe, the planner's predictions from it, then
#   gem-large at batch 256 beside nothing else (issue 13)
# k2 (one GPU, session 5): BlockAttention full again (Flex mask fixed, graph-replay timing), then gem-large
#   b256 under bench train (its phase split: is the GPU idle in the step? issue 13)
# s6c, s6d (one GPU, session 6): each BlockAttention backward config alone, then the full benchmark and GPU
#   tests | gem-large b256 in the multi-GPU harness, then gem-small b2048 under bench train (host-event counts)
# s6e (one GPU, session 6): BlockAttention full (the backward recomputes its cos/sin), gem-large b256 (GDPA
#   no longer specialized on the token count), the BlockAttention GPU tests
# s7a (one GPU, session 7): BlockAttention full and GPU tests (early dK/dV stores), JFA autotuned on (a), (d) and
#   L1024 s0.5 without Flex, each BlockAttention backward config alone
# s7b (one GPU, session 7): BlockAttention full (given positions block-relative, SHARE_BACK configs), JFA's
#   per-kernel times and tile configs on (b)'s short causal workloads, BlockAttention GPU tests and configs
# s7c (one GPU, session 7): BlockAttention full (SHARE_BACK / POLY_BACK / POLY_FRONT configs), JFA (fused
#   delta, short-sequence tiles) on (a), (d), L512 and L1024 at s0.5 causal, BlockAttention's GPU tests
# s7d (one GPU, session 7): JFA against varlen flash alone on every workload (b)
# s8a (one GPU, session 8): JFA's per-kernel times and tile sweep on L1024 / L2048 causal, then JFA full
#   (every workload and peer, Flex included)
# s8b (one GPU, session 8): JFA with ragged TMA loads against pointer loads (per pass, beside flash), then JFA
#   on (a) and (d) with the Flex pass
# s8c (one GPU, session 8): JFA's GPU tests, then JFA full (every workload and eager peer; Flex on (a), (d))
# s9a (one GPU, next session): TMA against pointer loads per pass (dK/dV's k and v now pointer loads on both
#   paths) and the sequence-owned backward on the short causal cells, then JFA's GPU tests
# s9b (one GPU, next session): JFA full (the length bucket past 4096 now its own; Flex on (a), (d))
# s9c (one GPU, next session): BlockAttention full (LATE_V backward configs: three programs per SM with
#   rotary), then its GPU tests
# s9d (one GPU, session 9): JFA's GPU tests (the sequence-owned backward removed), GDPA untuned (--quick)
# s10a (one GPU, next session): GDPA --quick (default configs no longer replicate a dot), the GPU tests session 9
#   fixed and GDPA's (ragged TMA loads), the embedding lookup (its step size now tuned)
# s10b (one GPU, next session): GDPA tuned over tiles and both load paths on (a) L1024 s1.0 and (b), beside JFA
#   and the compiled padded peer (issue 4); then part 6a (GDPA full)
# s10c (one GPU, session 10): each GDPA candidate alone on each load path against the reference (which TMA
#   candidates s10a's tests found wrong), then part s10b
# s10d, s10e (one GPU, session 10): GDPA (a) with JFA and the padded peers | the candidate diag at D 64 too,
#   GDPA's GPU tests, GDPA (b)-(d) with every peer (part 6a in two calls)
# s10f (one GPU, session 10): GDPA's GPU tests (every candidate at D 64 too), gem-large b512 with the sequence
#   stream in bf16 (part 2b's first step)
# s11b (one GPU, session 11): every tile of the embedding forward alone on issue 8's quick
#   and full workloads, the embedding benchmark quick then full (the compiled peer last), the embedding GPU tests
# s11d (one GPU, session 11): the embedding forward's tiles (1-warp candidates) and GPU tests, then gem-small
#   b2048 under bench train with layers, and with fp8 MLPs (part 1a's last two steps)
# s11e (one GPU, session 11): FP8 linears under torch.compile (the row quantizer's tuners without
#   prune_configs_by) and the low-precision GPU tests
# s12a (one GPU, next session): FP8 layers under torch.compile, eager regions against traced (the aliasing fix),
#   the low-precision GPU tests, gem-small b2048 under bench train (bf16, with layers)
# s12b (one GPU, next session): gem-small b2048 under bench train with fp8_rowwise MLPs, then the embedding
#   benchmark's full workload with uniform ids (the HBM-only figure)
# s12c (session 12, removed with its diag): where the traced FP8 linear lost its gradients, per compile backend
# s12d (one GPU, session 12): the FP8 layers as custom ops under compile against eager, the low-precision GPU
#   tests, then gem-small b2048 under bench train in bf16 and with fp8_rowwise MLPs (issue 10's 1.2x)
# s13a (one GPU, not run: its stage diag ran in s13e and its bench train in s13f; the uniform-id embedding run is
#   still pending): the embedding step's stages and kernels (power-law and uniform ids), the embedding
#   benchmark with uniform ids, gem-small b2048 under bench train with the warm-up over the window's batches
# s13b, s13c (one GPU, next session): issue 6's 2000-step gem-small runs, BF16 MLPs | fp8_rowwise MLPs, then the
#   comparison of their final held-out NE (bar: 0.2%) and the curves' PNG
# s13d (one GPU, next session): gem-small b2048 compiled, bf16 and fp8_rowwise MLPs, under `benchmarks.step_profile`
#   with the host profile (cProfile) and the kernel table: the GPU idle time and FP8's 0.89x
# s13e (one GPU, session 13): 250 steps of gem-small as the trainer runs them, each step's stalls (autotuner keys,
#   kernel loads, Dynamo graphs) and one evaluation timed twice, then the embedding step's stages
# s13f (one GPU, session 13): the low-precision and step-sync GPU tests (column-summing quantizer, collector
#   frozen after the first step), the FP8 MLP block's kernels, gem-small b2048 under bench train
# s14a (one GPU, next session): the GPU tests of the fast-math GELU quantizers, the FP8 MLP block's kernels with
#   fp8_rowwise and fp8_rowwise_fast, gem-small b2048 under bench train (the restarted loader warm before the window)
# s15a, s15b (one GPU, next session): issue 6's low-precision benchmark with interleaved rounds and graph
#   replays, the MLP block's kernels | gem-small b2048 with the bf16 sequence stream, then with fp8_rowwise_fast MLPs
# s15d (one GPU, session 15): issue 6's benchmark with the fused MLP's bias sums on by default and torchao (a carried
#   wheel, EXTRA_PYTHONPATH) in the peer rounds, the MLP block's kernels, then FP8 attention's GPU tests and quick run
# s15c (one GPU, next session): the 2000-step gem-small curve with the bf16 sequence stream against session 14's
#   BF16 curve (NE within 0.2%?)
# s16a (one GPU, session 16): gem-small b2048 under bench train with the sequence stream in fp32 then bf16 (one call:
#   the ratio), then gem-large b512 with the bf16 stream, each with its top kernels and timed idle (issue 10)
# s16b (one GPU, session 16): FP8 attention's GPU tests and quick run (the quantize pass a tile per program, the
#   hardware E4M3 conversion), then the Wukong layer's token-mixing GEMMs padded to 8 tokens against unpadded
# s17a (one GPU, next session): the JFA GPU tests (the packed q/k/v gradient among them), then gem-small b2048 under
#   bench train (kernel time against session 16's 141.4 ms: the stack copies gone)
# s17b (one GPU, next session): issue 12's 2000-step curve, FP8 attention and FP8 MLPs, against session 14's BF16
#   curve (bar 0.3%)
# s17c (one GPU, next session): FP8 attention's GPU tests (the fused QKV projection among them), then the FP8
#   benchmark quick and full (attention from hidden states: cuBLAS + bf16 op against the fused projection + FP8)
# s17d (one GPU): FP8 attention's GPU tests, then the FP8 benchmark full (the quantize pass in one launch again;
#   rerun after session 17: also the straight-through backward's tests and each forward's backward timed;
#   qkv_attention's default route, cuBLAS + the quantize pass, and the fused projection, against bf16)
# s18b (one GPU): the 2000-step NE run with FP8 attention (straight-through backward) + FP8 MLPs, bar 0.3%
# s18c (one GPU): gem-small b2048 twice in one call, the default with the profiled steps' timeline, then with
#   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the timed steps' cudaMalloc count beside their GPU idle)
# s18d (one GPU, run in session 18 at 4d3c8c5, with an allocator default since reverted): gem-small b2048 with
#   3 lead steps on the restarted loader, expandable segments then PYTORCH_ALLOC_CONF=expandable_segments:False
# s19a (one GPU): gem-small b2048 three times in one call, the allocators alternating (fixed, expandable, fixed):
#   s18c's 1.16x for expandable segments (second in its call) and s18d's 0.98x (first) disagree
# s19b, then s19c on the same warm machine: issue 12's 2000-step NE run (FP8 attention, straight-through backward,
#   + FP8 MLPs) in two calls: s19b stops after 420 s with a checkpoint in runs/ (kept between the calls of one
#   machine), s19c resumes it to step 2000 and compares with the BF16 run (bar 0.3%)
# s19d (one GPU): FP8 GDPA and the looping quantize pass (new in session 18): the FP8 attention GPU tests (GDPA's
#   and the looping pass's and FP8 BlockAttention's among them), then benchmarks.gdpa_fp8 and attention_fp8 quick
#   (both time both passes) and block_attention quick (FP8 BlockAttention beside ours in bf16)
# s19e (one GPU): benchmarks.gdpa_fp8 full (workload (a) L 1024 / 2048, (b) K/V 128 / 256, tuned)
# s20a, then s20b on the same warm machine: the BF16 2000-step run repeated at this commit (label bf16_repeat) in
#   two calls, then compared with session 14's BF16 run (the spread of one configuration's final NE, code drift
#   included) and the FP8 attention run of session 19 compared against the repeat (issue 12's bar, 0.3%)
# s20c (one GPU): the FP8 attention GPU tests (MXFP8 JFA's and GDPA's, new in session 19, among them), then
#   attention_fp8 full (FP8 and MXFP8 JFA against bf16, tuned) and gdpa_fp8 quick (FP8 and MXFP8 GDPA)
# s20d (one GPU): gem-large b512 under bench train (issue 10; last measured in session 16: 299.8 ms, 26.2%)
# s21a (one GPU): MXFP8's Triton operand pass (new after session 20): the FP8/MXFP8 attention GPU tests, then
#   attention_fp8 quick (MXFP8 JFA's op with the pass, against bf16); then benchmarks.diag.gdpa_small_overhead
# s21b, then s21c on the same warm machine: issue 12's NE run with GEM's late-layer lever: FP8 attention in all but
#   the last 2 layers (gem.bf16_attention_last_layers=2) + FP8 MLPs, seed 0, compared with both BF16 runs (bar 0.3%)
# s21d (one GPU): gem-large b512 with FP8 MLPs under bench train (issue 10's 1.2x samples/s against s20d's BF16)
# s21e, then s21f on the same warm machine: the BF16 run with seed 1 (the baseline of a later FP8 run on seed 1)
# s22a (one GPU, session 21): the low-precision GPU tests, the FP8 layer compiled both ways, GDPA's host time,
#   gem-small b2048 FP8 (inductor path) then BF16
# s23a (one GPU): gem-small b2048 FP8 MLPs through Inductor (OPENGEM_FP8_COMPILE=inductor), then BF16
# s23b (one GPU): gem-large b512 FP8 MLPs through Inductor then BF16 (issue 10's 1.2x)
# s23c (one GPU): the low-precision GPU tests and the fp8_compile diag (issue 10), GDPA (a) L256 / L512 at s0.5
#   with JFA and the compiled padded peer and the host-time diag (issue 4; writes gdpa.json: keep the full run's
#   file, rename this one)
# s24a (one GPU): the low-precision GPU tests, gem-large b512 FP8 (Inductor) then BF16 with mix-order reductions off
# s24b (one GPU): the same with the traced bias gradient as a GEMV and Inductor's defaults
# s25a (one GPU): GDPA's forward with extra tile candidates on (a) L256-L1024 and (b) K/V 256, beside JFA (issue 4)
# s25b (one GPU): GDPA's GPU tests with the 32-wide tiles shipped, (a) L256 / L512 and (b) K/V 256 with JFA and the
#   compiled padded peer, the low-precision GPU tests
# s26a (one GPU): the traced FP8 linear's backward reductions of dy alone, compiled with and without Inductor's
#   mix-order fusion, per bias-gradient formulation (issue 10)
# s26b (one GPU): JFA's forward tiles on (a)-like non-causal workloads with the 32-wide key tiles added (kernels)
# s27a (one GPU): GDPA's op against its kernel at L256 / L512 (device kernels, 20 / 100 ms windows, the SM clock
#   sampled throughout), then GDPA (a) L256-L1024 with JFA (interleaved forward) and the compiled padded peer
# s27b (one GPU): JFA's GPU tests with the 32-key forward tiles, what each activation costs GDPA's kernels ((b) K/V
#   256, (a) L512 s1.0), GDPA (a) L256 / L512 against the retuned JFA, JFA against flash on L512 / L1024 non-causal
# s27c (one GPU): fast_gelu as a smoothstep of one saturating FMA: GDPA's GPU tests, its cost against identity, GDPA
#   (a) L256 / L512 and (b) K/V 256 with JFA and the compiled padded peer
# s27d (one GPU): s27c's tests and benchmark again after its fixes (per-head forward unfolded, 64 x 32 forward capped
#   at 168 registers), without the activation diag
# s28a (one GPU): GDPA's host time against JFA's at L256 / L512 (`gdpa_small_overhead`), then GDPA (a) L256-L2048
#   with JFA (the forward also from CUDA-graph replays) and the compiled padded peer; part 6a after it for the rest
# s28c (one GPU): gem-large b512 BF16 under bench train (issue 10; session 23: 278.44 ms, 29.2% e2e MFU)
# s29a (one GPU): JFA's GPU tests (the backward's 32-row inner tiles forced too), then its dK/dV and dQ swept with them
# s29b (one GPU): dK/dV's 32 x 64 tiles on the GEM-like batch, then gem-large b512 BF16 with them in the tuning list
# s29c (one GPU): FP8 JFA GPU tests, then attention_fp8 on workload (a), tuned (issue 12)
# s29d (one GPU): attention_fp8 on (a) again and (c), tuned: the repeat of s29c's ratios
# s30a (one GPU): the persistent fused FP8 projection's GPU tests and time on (a); JFA's bf16 forward tiles on (a)
# s30b (one GPU, session 27): JFA's tuner timings against each tile timed rested and hot on (a) and (c), with clocks
# s30c (one GPU, session 27): the interleaved autotuner against Triton's one window (repeated fresh tunings on (a)
#   and (c), each pick's hot time), then issue 12's (a) with it
# s30d (one GPU, session 27, not run: the interleaved autotuner was dropped after s30c)
# s30e (one GPU, session 27): the FP8 attention GPU tests (persistent projection removed), issue 12's (a) and (c)
#   against the bf16 op at its fastest forward tile (every tile forced alone beside the tuned pick)
# s31a (one GPU, session 28): the confirming autotuner against Triton's one window (fresh tunings on (a) and (c), each
#   pick's hot time), then the FP8 attention GPU tests (every forward tile forced alone, the register-capped ones too)
# s31b (one GPU, session 28): issue 12's (a) and (c) with the register-capped FP8 forward tiles and the confirming
#   tuner, then the JFA GPU tests
# s31c (one GPU, session 28): gem-large b512 BF16 with the confirming tuner (issue 10)
# s31d (one GPU, session 28): the FP8 quantize pass at other warp counts and register caps, then FP8 GDPA full (the
#   register-capped FP8 tiles are GDPA's candidates too)
# s31e (one GPU, session 28): issue 12's (a) and (c) again, a second process (is call 2's 1.35x repeatable?)
# s31f (one GPU, session 28): the GPU tests of the other kernels now tuned by the confirming autotuner (embedding
#   lookup) and of FP8 GDPA / BlockAttention
# s32a (one GPU, session 29): the quantize pass at 4 warps capped at 160 / 168 registers, FP8 GDPA full (its tuned FP8
#   tile recorded), JFA's bf16 forward tiles with the capped (64, 64, 4, 2, 168) on (a) and (c), the JFA GPU tests
# s32b (one GPU, session 29; removed with the fused backward after it, commit c127629): JFA's fused backward (dQ by
#   atomic or TMA reductions) against the two-pass one and flash, then its GPU tests; s32c (gem-large with it) not run
# s32d (one GPU, session 29): the FP8 attention GPU tests with the quantize pass at 4 warps capped at 168 registers,
#   then issue 12's (a) and (c) with it
# s32e (one GPU, session 29): the FP8 GDPA / BlockAttention GPU tests (their quantize pass at its new default), then
#   gem-large b512 BF16 (issue 10; JFA's forward without the capped tile)
# s33a (one GPU, next session): gem-large b512 BF16 at session 29's HEAD with s31c's 560 s cap (s32e's 240 s ran out
#   on a cold compile cache)
# s33b (one GPU, session 30): every Inductor kernel of gem-large b512's compiled step timed with its argument bytes
#   against the copy bandwidth (issue 10: where the ~57 ms of fused element-wise work a step stands)
# s33c (one GPU, session 30): GEM's PFFN and seed-pooling GDPA at gem-large's shapes, its power-law batch against
#   the same tokens in equal-length samples (issue 10: are the per-sample passes held by their longest programs?)
# s33d (one GPU, session 30): GDPA GPU tests (broadcast dQ now chunked by keys), then s33c's and s33b's diags again
#   (issue 10: dQ chunks; SequenceSummary's one gather)
# s33e (one GPU, session 30): GDPA GPU tests with the resident-K/V dQ, GEM's GDPA layers again, issue 4's (b)
# s33f (one GPU, session 30): GDPA GPU tests with each resident-K/V dQ candidate alone, FP8 / MXFP8 GDPA GPU tests
# s33g (one GPU, session 30): GDPA GPU tests with the short-query broadcast dK/dV, GEM's GDPA layers again
# s33h (one GPU, session 30): gem-large b512 BF16 with every GDPA change of session 30 (call 4's compile cache)
# s34a (one GPU, session 31): gem-large b512 BF16 twice in one call (the idle of the very batches profiled, the gaps
#   it waits in), then the bench train GPU test
# s34b (one GPU, session 31): JFA's GPU tests of the column sums (the QKV bias gradient), gem-large b512 with them
# s34c (one GPU, session 31): gem-large b512 with combo kernels and no size asserts (a cold compile: alone in its call)
# s34d (one GPU, session 31): the session's GPU tests (qkv_attention's bias gradient, bench train's gaps), then
#   benchmarks.diag.host_lead on gem-large b512 (where the host falls behind the GPU)
# s34e (one GPU, session 31): host_lead again, 8 steps, each step's leads and spans and the collector's time
# s35a (one GPU, next session, without a carried compile cache): GDPA's GPU tests of the projection-bias gradients
#   (PFFN's q, seed pooling's kv) and of the candidates they touch, then gem-large b512 with them
# s35b (one GPU, next session): gem-large b512 with Inductor's defaults, then with triton.enable_pdl=True
# s35c (one GPU, next session): host_lead over 10 steps (each step's leads, collections and device mallocs)
# s36a (one GPU, session 32): GDPA's projection-bias gradient from its kernels against a column sum
#   (benchmarks.diag.gdpa_gem_layers --bias), then gem-large b512
# s36b (one GPU, session 32): gem-large b512 with Inductor's defaults, then with triton.enable_pdl=True
# s36c (one GPU, session 32): host_lead over 10 steps
# s36d (one GPU, session 32): GDPA dK/dV query chunks (GPU tests, the PFFN with and without, same run), gem-large,
#   host_lead
# s36e (one GPU, session 32): the chunked dK/dV's GPU tests (after s36d's test fixes)
# s37a (one GPU, next session, carry .compile_cache.tgz): host_lead with a drained queue before each step, then with
#   the forward under cProfile; then gem-large b512 with its profile (this session's kernels' step-level figures)
# s37b (one GPU, next session): gem-large b512 with autocast's per-use weight casts, then with weight_shadows=true
# s37c (one GPU, next session): the weight shadows' GPU tests (bitwise losses, fewer kernels a step; fp32 weight
#   gradients: fewer kernels again, the fp32-output GEMM eager and compiled)
# s39a | s39b | s39c (one GPU each, next session; cold compiles): gem-large b512 as set | with weight_shadows=true |
#   with weight_shadows=true and fp32_weight_grads=true (the shadowed layers' weight gradients from fp32-output GEMMs)
# s39d (one GPU, after s39a-c, their cache): the three gem-large runs again, warm, in one call (same-run ratios)
# s39e (one GPU): the shadows' GPU tests, then benchmarks.diag.wukong_gemms (token mixing old against new)
# s40c (one GPU, session 35, ran; chain removed with the feature): s39a, then JFA's dQ from a stored dS
# s40d (one GPU): s39b and s39c in one call
# s38a (one GPU, next session): gem-small b2048 at today's code (last measured in session 23), then with
#   weight_shadows=true (issue 10's other preset)
# s41a (one GPU, session 37, ran): JFA's tile sweep on gem-large's attention shape, then gem-small b2048
# s42b (one GPU): gem-small with the fp32 and the bf16 sequence stream (s42a, s43b, s43c: the shadows' tests, now in s39e)
# s43a (one GPU, session 38): gem-small b2048 as set, then with compile_mode=max-autotune-no-cudagraphs (same call)
# s43d (one GPU, session 38): gem-small b2048 as set, alone (cold compile: more than 230 s in s43a)
# s44a (one GPU, session 39): gem-small b2048 with the bf16 sequence stream, alone (s43d's pair on the same machine)
# s44d (one GPU, session 39): the weight shadows' GPU tests with tolerances for compiled graphs' kernel choices
# s45a, s45b (one GPU, session 40): issue 4 on its acceptance device (every GDPA figure so far came from an H200):
#   GDPA's GPU tests and workload (a) with every peer | workloads (b), (c), (d) with every peer
# s45c (one GPU, session 40): the GDPA GPU test that s45a's cap cut (the pooling K/V projection-bias gradients)
# s45d, s45e (one GPU, after session 40): issue 12 on its acceptance device (its figures so far: H200s): the FP8
#   attention GPU tests and JFA's workload (a) | FP8 GDPA on (a) and (b)
# s45f (one GPU, after session 40): the first Gluon kernel (a warp-specialized GDPA forward, benchmarks/diag) against
#   the Triton GDPA forward and JFA on workload (a), errors against the fp32 reference first; then GDPA's dK/dV pass in
#   Gluon against the Triton dK/dV kernel (kernel time), errors against the Triton op's gradients
# 6 (6a | 6b): GDPA full (issue 4: the compiled padded reference, every workload) | BlockAttention full
#   (issue 5: the power-law workload)
# The device returns at most 8 files: logs and result JSON go to OUT_DIR/results.tgz (rewritten after
# every step, so a call cut short keeps what finished; of benchmarks/results/ only what this call wrote), the
# one-line status per step to OUT_DIR/status. Inductor's and Triton's compile caches live in the checkout's
# git-ignored .compile_cache/ (kept between the calls of one machine) and come back as OUT_DIR/compile_cache.tgz
# .part0, .part1, ... (13.9 MB pieces, up to 55.6 MB): `cat compile_cache.tgz.part* > .compile_cache.tgz` in the
# checkout's root and carry that file into a fresh machine's first call; its first compiled run then skips the
# cold compile (gem-small: >200 s cold, 58-65 s warm in sessions 16 and 18).
set -u
final=$1; part=$2
out=$final/work
# EXTRA_PYTHONPATH: packages the GPU image lacks, installed from carried wheels (torchao for issue 6's peer)
export PYTHONPATH=src:.${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out/logs" "$out/results"
touch "$out/started"  # benchmarks/results/ files newer than this were written by this call
export TORCHINDUCTOR_CACHE_DIR=$PWD/.compile_cache/inductor TRITON_CACHE_DIR=$PWD/.compile_cache/triton
if [ -f .compile_cache.tgz ] && [ ! -d .compile_cache ]; then mkdir -p .compile_cache && tar xzf .compile_cache.tgz -C .compile_cache; fi
# session 66: two gem-large steps capped at 150 s ran out of time compiling cold (no cache was carried); say so first
if [ ! -d .compile_cache ]; then echo "note: no compile cache (carry .compile_cache.tgz): compiled steps start cold"; fi
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
step() {  # step NAME SECONDS COMMAND...   (appends its status line to $out/status)
  local name=$1 cap=$2; shift 2
  local start=$SECONDS
  # the host's load before the step: a step paced by a busy host reads slow (session 49, s53b: 191.67 ms, then
  # 138.80 on a fresh machine, the same code)
  local load; load=$(cut -d' ' -f1-3 /proc/loadavg)
  # what else is busy when the step starts (session 50: a second bench run on a machine idled the GPU 76 ms a step)
  if command -v top > /dev/null; then top -b -n 1 -o %CPU | head -n 14; else ps -eo pcpu,etimes,comm --sort=-pcpu; fi \
    > "$out/logs/$name.busy" 2>&1
  timeout "$cap" bash -c '"$@"' _ "$@" > "$out/logs/$name.log" 2>&1  # bash -c: the command may be a function
  local rc=$?
  local last; last=$(tail -n 1 "$out/logs/$name.log" | cut -c1-200)
  echo "rc=$rc $((SECONDS - start))s load=$load $name :: $last" >> "$out/status"
  collect_checkout_results
  tar czf "$final/results.tgz" -C "$out" logs results status 2>/dev/null  # a call cut short keeps what finished
}
copied_from_checkout=$(mktemp); trap 'rm -f "$copied_from_checkout"' EXIT
collect_checkout_results() {  # what the benchmarks wrote into the checkout's results folder during this call, after
  # every step (session 64: a call cut at 600 s lost the optimizer's JSON, copied only at the end). A step's own file
  # of the same name is kept; a file copied before is copied again when a later step rewrites it
  local file name
  while IFS= read -r file; do
    name=${file##*/}
    if [ ! -e "$out/results/$name" ] || grep -qxF "$name" "$copied_from_checkout"; then
      cp "$file" "$out/results/$name" && echo "$name" >> "$copied_from_checkout"
    fi
  done < <(find benchmarks/results -maxdepth 1 -newer "$out/started" \( -name '*.json' -o -name '*.png' \) 2>/dev/null)
}
on_gpu() {  # on_gpu INDEX FUNCTION: the chain on one GPU (in the background when there are two)
  if [ "$gpus" -ge 2 ]; then (export CUDA_VISIBLE_DEVICES=$1; $2) & else $2; fi
}
tests() { python -m pytest -v -n 4 -p no:cacheprovider --timeout 170 --tb=short "$@"; }
train() { python -m opengem.cli.main "$@"; }
multi() { local n=$1; shift; python -m torch.distributed.run --standalone --nproc-per-node "$n" -m benchmarks.multi_gpu "$@"; }
large_single() {  # large_single BATCH NAME [ARGS]: gem-large on one GPU with the multi-GPU harness (the layouts' baseline)
  local batch=$1 name=$2; shift 2
  multi 1 --preset gem-large --layouts single --batch-per-gpu "$batch" --warmup 6 --steps 10 --out "$out/results/$name.json" "$@"
}
large_at() {  # large_at BATCH NAME [ARGS]: gem-large under bench train (bf16 sequence stream), issue 10's steady state
  local batch=$1 name=$2; shift 2
  train bench train --preset gem-large --batch-size "$batch" --compile --steps 12 --warmup 6 --num-workers 12 \
    --set gem.sequence_dtype=compute "$@" --out "$out/results/$name.json"
}
large_with_inductor() {  # large_with_inductor NAME=VALUE BATCH NAME [ARGS]: large_at with one Inductor setting
  # changed (benchmarks.diag.with_inductor_config; it enters Inductor's cache key, so the run compiles afresh)
  local setting=$1 batch=$2 name=$3; shift 3
  python -m benchmarks.diag.with_inductor_config "$setting" -- bench train --preset gem-large --batch-size "$batch" \
    --compile --steps 12 --warmup 6 --num-workers 12 --set gem.sequence_dtype=compute "$@" \
    --out "$out/results/$name.json"
}
large_b512() { large_at 512 "$@"; }  # large_b512 NAME [ARGS]
unpacked_cache() { rm -rf "$1" && mkdir -p "$1" && tar xzf .compile_cache.tgz -C "$1"; }  # a pristine copy of the carry
with_cache() {  # with_cache CACHE [VAR=VALUE...] COMMAND...: COMMAND with its compile caches under CACHE
  local cache=$1; shift
  (export TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton"
   while [[ $1 == *=* ]]; do export "$1"; shift; done
   "$@")
}
predict() {  # predict CALIBRATION: the planner's 1-GPU step for the runs of part 1 (issue 13)
  local run
  for run in "gem-small 2048" "gem-large 256" "gem-large 512"; do
    set -- $run "$1"
    train plan --preset "$1" --cluster h200 --gpus 1 --local-batch "$2" --calibration "$3" \
      --out "$out/results/plan_$1_b$2.json" || return
    set -- "$3"
  done
}
curves_single() {
  multi 1 --curve --preset gem-small --layouts single --batch-per-gpu 1024 --warmup 1 --steps 199 \
    --set compile=false "$@"
}
chain_1a() {
  step calibrate 200 train bench calibrate --quick --out "$out/results/calibration_quick.json"  # with the host probe
  step predict 60 predict "$out/results/calibration_quick.json"  # issue 13: before part 2's measurements
  step phase_test 90 tests tests/gpu/test_flops_gpu.py::test_bench_train_on_the_gpu
  step bench_train 160 train bench train --preset gem-small --batch-size 2048 --compile \
    --steps 20 --warmup 8 --num-workers 12 --with-layers --out "$out/results/train_gem-small.json"
  step fp8_mlp_train 140 train bench train --preset gem-small --batch-size 2048 --compile \
    --steps 20 --warmup 8 --num-workers 12 --low-precision-mlp fp8_rowwise --out "$out/results/train_gem-small_fp8.json"
}
chain_1b() {
  step low_precision 150 python -m benchmarks.low_precision  # the row quantizer's tuned programs (issue 6)
  step attention_fp8 90 python -m benchmarks.attention_fp8 --quick
  step block_attention 90 python -m benchmarks.block_attention --quick
  step jfa_full 240 python -m benchmarks.jfa
}
chain_2a() {
  step large_single 300 large_single 256 multi_gpu_single
  step large_single_b512 200 large_single 512 multi_gpu_single_b512
}
chain_2b() {
  step large_bf16_sequence 300 large_single 512 multi_gpu_single_b512_bf16_sequence --set gem.sequence_dtype=compute
  step embedding 90 python -m benchmarks.embedding --quick
}
chain_s11b() {
  step embedding_configs 250 python -m benchmarks.diag.embedding_lookup_configs
  step embedding_quick 80 python -m benchmarks.embedding --quick
  step embedding_full 140 python -m benchmarks.embedding
  step embedding_gpu_tests 100 tests tests/gpu/test_embedding_gpu.py
}
chain_s11d() {
  step embedding_configs 110 python -m benchmarks.diag.embedding_lookup_configs
  step embedding_gpu_tests 110 tests tests/gpu/test_embedding_gpu.py
  step bench_train 160 train bench train --preset gem-small --batch-size 2048 --compile \
    --steps 20 --warmup 8 --num-workers 12 --with-layers --out "$out/results/train_gem-small.json"
  step fp8_mlp_train 150 train bench train --preset gem-small --batch-size 2048 --compile \
    --steps 20 --warmup 8 --num-workers 12 --low-precision-mlp fp8_rowwise --out "$out/results/train_gem-small_fp8.json"
}
chain_s11e() { step low_precision_gpu_tests 100 tests tests/gpu/test_low_precision_gpu.py; }
chain_s12a() {
  step fp8_compile 120 python -m benchmarks.diag.fp8_compile
  step low_precision_gpu_tests 100 tests tests/gpu/test_low_precision_gpu.py
  step bench_train 330 train bench train --preset gem-small --batch-size 2048 --compile \
    --steps 20 --warmup 8 --num-workers 12 --with-layers --out "$out/results/train_gem-small.json"
}
small_train() {  # gem-small b2048 under bench train, compiled, 8 + 20 warm-up and 20 timed steps
  train bench train --preset gem-small --batch-size 2048 --compile --steps 20 --warmup 8 --num-workers 12 "$@"
}
small_train_expandable() {  # the same with the caching allocator growing segments instead of adding new ones
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True small_train "$@"
}
small_train_fixed_segments() {  # the allocator as it was before session 18 (new segments, not grown ones)
  PYTORCH_ALLOC_CONF=expandable_segments:False small_train "$@"
}
chain_s12b() {
  step fp8_mlp_train 330 small_train --low-precision-mlp fp8_rowwise --out "$out/results/train_gem-small_fp8.json"
  step embedding_uniform 200 python -m benchmarks.embedding --uniform-ids --skip-compile
}
chain_s12d() {
  step fp8_compile 120 python -m benchmarks.diag.fp8_compile
  step low_precision_gpu_tests 100 tests tests/gpu/test_low_precision_gpu.py
  step bench_train 200 small_train --out "$out/results/train_gem-small_b2048_bf16.json"
  step fp8_mlp_train 220 small_train --low-precision-mlp fp8_rowwise --out "$out/results/train_gem-small_b2048_fp8.json"
}
chain_s13a() {
  step embedding_backward_stages 240 python -m benchmarks.diag.embedding_backward_stages
  step embedding_uniform 200 python -m benchmarks.embedding --uniform-ids --skip-compile
  step bench_train 200 small_train --out "$out/results/train_gem-small_b2048_replay.json"
}
# issue 6's curves with the kernels' default tiles (both runs alike): tuning made the first step 164 s (session 13)
untuned_curve() { OPENGEM_JFA_AUTOTUNE=0 OPENGEM_GDPA_TUNE=0 OPENGEM_FP8_AUTOTUNE=0 python -m benchmarks.low_precision_curves "$@"; }
chain_s13b() { step lp_curve_bf16 590 untuned_curve --variant none; }
chain_s13c() {  # issue 6: the FP8 curve against the BF16 one in benchmarks/results (session 14's, committed)
  step lp_curve_fp8 560 untuned_curve --variant fp8_rowwise
  step lp_curves_compare 30 untuned_curve --compare --variant fp8_rowwise
}
chain_s13d() {  # where the host time of the compiled gem-small step goes, bf16 and with FP8 MLPs (cProfile + kernels)
  step step_profile 560 python -m benchmarks.step_profile --steps 20 --out "$out/results" \
    --runs gem-small:2048:bf16:compile:fresh:host,gem-small:2048:bf16:compile:fresh:host:lp=fp8_rowwise
}
chain_s13e() {  # what a long run meets that bench train's window does not (the 2000-step curve ran at ~0.33 s a step)
  step long_run_events 360 python -m benchmarks.diag.long_run_events --steps 250
  step embedding_backward_stages 180 python -m benchmarks.diag.embedding_backward_stages
}
chain_s13f() {  # the FP8 MLP block's kernels after the fused bias gradients, then gem-small's steady state
  step low_precision_gpu_tests 150 tests tests/gpu/test_low_precision_gpu.py tests/gpu/test_step_sync_gpu.py
  step fp8_mlp_kernels 150 python -m benchmarks.diag.fp8_mlp_kernels
  step bench_train 230 small_train --out "$out/results/train_gem-small_b2048_replay.json"
}
chain_s14a() {  # the fast-math GELU quantizers and fp8_rowwise_fast in the MLP block, then gem-small's steady state
  step low_precision_gpu_tests 150 tests tests/gpu/test_low_precision_gpu.py tests/gpu/test_step_sync_gpu.py
  step fp8_mlp_kernels 150 python -m benchmarks.diag.fp8_mlp_kernels
  step bench_train 230 small_train --out "$out/results/train_gem-small_b2048_s14.json"
}
chain_s15a() {  # issue 6's benchmark with the variants in interleaved rounds (and graph replays), the block's kernels
  step low_precision_gpu_tests 150 tests tests/gpu/test_low_precision_gpu.py  # the persistent quantizer candidates
  step low_precision_full 300 python -m benchmarks.low_precision
  step fp8_mlp_kernels 150 python -m benchmarks.diag.fp8_mlp_kernels
}
chain_s15b() {  # issue 10: gem-small with the sequence stream in bf16 (never run on gem-small), then with FP8 MLPs
  step bench_train_bf16_sequence 240 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_bf16_sequence.json"
  step bench_train_fp8_fast 240 small_train --low-precision-mlp fp8_rowwise_fast \
    --out "$out/results/train_gem-small_b2048_fp8_fast.json"
}
chain_s15c() {  # issue 10's bf16 sequence stream over issue 6's 2000 steps, against session 14's BF16 curve (committed)
  step lp_curve_bf16_sequence 560 untuned_curve --variant none --label bf16_sequence --set gem.sequence_dtype=compute
  step lp_curves_compare 30 untuned_curve --compare --label bf16_sequence
}
chain_s15d() {  # issue 6 with the bias sums on by default and torchao in the peer rounds, then issue 12's FP8 JFA forward
  step low_precision_gpu_tests 120 tests tests/gpu/test_low_precision_gpu.py
  step low_precision_full 240 python -m benchmarks.low_precision
  step fp8_mlp_kernels 90 python -m benchmarks.diag.fp8_mlp_kernels
  step fp8_attention_gpu_tests 60 tests tests/gpu/test_fp8_attention_gpu.py
  step attention_fp8 80 python -m benchmarks.attention_fp8 --quick
}
chain_s16a() {  # issue 10: the bf16 sequence stream against fp32 in one call, then gem-large's kernels
  step bench_train_fp32_sequence 260 small_train --out "$out/results/train_gem-small_b2048_s16_fp32_sequence.json"
  step bench_train_bf16_sequence 200 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s16_bf16_sequence.json"
  step bench_train_large 200 large_b512 train_gem-large_b512_s16_bf16_sequence
}
chain_s16b() {  # issue 12's quantize pass, then issue 10's Wukong GEMMs (eager and compiled, both presets' shapes)
  step fp8_attention_gpu_tests 100 tests tests/gpu/test_fp8_attention_gpu.py
  step attention_fp8 100 python -m benchmarks.attention_fp8 --quick
  step wukong_gemms 210 python -m benchmarks.diag.wukong_gemms --out "$out/results"
}
chain_s17a() {  # the packed q/k/v gradient on the GPU, then its effect on gem-small's kernel time (issue 10)
  step jfa_gpu_tests 200 tests tests/gpu/test_jagged_attention_gpu.py
  step bench_train_packed 300 small_train --out "$out/results/train_gem-small_b2048_s17_packed_qkv.json"
}
chain_s17b() {  # issue 12: FP8 attention (forward) and FP8 MLPs over issue 6's 2000 steps, bar 0.3% NE
  step lp_curve_fp8_attention 560 untuned_curve --variant fp8_rowwise --label fp8_attention \
    --set gem.attention_precision=fp8
  step lp_curves_compare 30 untuned_curve --compare --variant fp8_rowwise --label fp8_attention --bar 0.003
}
chain_s17c() {  # issue 12: the QKV projection quantizing in its epilogue, tests then timings
  step fp8_attention_gpu_tests 150 tests tests/gpu/test_fp8_attention_gpu.py tests/gpu/test_gdpa_gpu.py::test_packed_kv_gradient_equals_the_stacked_one
  step attention_fp8 120 python -m benchmarks.attention_fp8 --quick
  step attention_fp8_full 300 python -m benchmarks.attention_fp8
}
chain_s17d() {  # issue 12: the single-launch quantize pass and qkv_attention's two FP8 routes against bf16's
  step fp8_attention_gpu_tests 150 tests tests/gpu/test_fp8_attention_gpu.py
  step attention_fp8_full 300 python -m benchmarks.attention_fp8
}
chain_s18b() {  # issue 12: the NE run again with the straight-through FP8 backward (session 17's kept as it is)
  step lp_curve_fp8_attention_st 560 untuned_curve --variant fp8_rowwise --label fp8_attention_straight_through \
    --set gem.attention_precision=fp8
  step lp_curves_compare 30 untuned_curve --compare --variant fp8_rowwise --label fp8_attention_straight_through \
    --bar 0.003
}
chain_s18c() {  # issue 10: gem-small's GPU idle: the allocator's trips to the driver, the timeline, expandable segments
  step bench_train_default 330 small_train --trace "$final/gem-small_steps.json.gz" \
    --out "$out/results/train_gem-small_b2048_s18_default.json"
  step bench_train_expandable 200 small_train_expandable \
    --out "$out/results/train_gem-small_b2048_s18_expandable_segments.json"
}
chain_s18d() {  # issue 10: the lead steps; expandable segments (then a default, since reverted) against fixed ones
  step bench_train_new_defaults 330 small_train_expandable \
    --out "$out/results/train_gem-small_b2048_s18_new_defaults.json"
  step bench_train_fixed_segments 150 small_train_fixed_segments \
    --out "$out/results/train_gem-small_b2048_s18_fixed_segments.json"
}
chain_s19a() {  # issue 10: does the allocator or the run's place in its call move gem-small's step? (A B A)
  step bench_train_fixed_1 330 small_train_fixed_segments --out "$out/results/train_gem-small_b2048_s19_fixed_1.json"
  step bench_train_expandable_1 120 small_train_expandable \
    --out "$out/results/train_gem-small_b2048_s19_expandable_1.json"
  step bench_train_fixed_2 120 small_train_fixed_segments --out "$out/results/train_gem-small_b2048_s19_fixed_2.json"
}
fp8_attention_curve() {  # issue 12's NE run, resumable: the same command stops (s19b) and resumes (s19c)
  untuned_curve --variant fp8_rowwise --label fp8_attention_straight_through --set gem.attention_precision=fp8 \
    --checkpoint-dir runs/curve_fp8_attention_straight_through "$@"
}
chain_s19b() { step lp_curve_fp8_attention_st_part1 560 fp8_attention_curve --stop-after 420; }
chain_s19c() {
  step lp_curve_fp8_attention_st_part2 540 fp8_attention_curve --resume
  step lp_curves_compare 30 untuned_curve --compare --variant fp8_rowwise --label fp8_attention_straight_through \
    --bar 0.003
}
chain_s19d() {  # issue 12: FP8 GDPA and the looping quantize pass, tests then timings against bf16 in one run
  step fp8_attention_gpu_tests 150 tests tests/gpu/test_fp8_attention_gpu.py
  step gdpa_fp8_quick 150 python -m benchmarks.gdpa_fp8 --quick
  step attention_fp8_quick 120 python -m benchmarks.attention_fp8 --quick
  step block_attention_quick 100 python -m benchmarks.block_attention --quick
}
chain_s19e() { step gdpa_fp8_full 480 python -m benchmarks.gdpa_fp8; }
bf16_repeat_curve() {  # the BF16 run again, resumable like fp8_attention_curve
  untuned_curve --variant none --label bf16_repeat --checkpoint-dir runs/curve_bf16_repeat "$@"
}
chain_s20c() {
  step fp8_attention_gpu_tests 150 tests tests/gpu/test_fp8_attention_gpu.py
  step attention_fp8_full 330 python -m benchmarks.attention_fp8
  step gdpa_fp8_quick 150 python -m benchmarks.gdpa_fp8 --quick
}
chain_s20d() {  # issue 10: gem-large's step at the current commit (last measured in session 16), bf16 stream as then
  step bench_train_large 300 large_b512 train_gem-large_b512_s20_bf16_sequence
}
chain_s20a() { step lp_curve_bf16_repeat_part1 560 bf16_repeat_curve --stop-after 420; }
chain_s20b() {
  step lp_curve_bf16_repeat_part2 540 bf16_repeat_curve --resume
  step lp_curves_bf16_spread 30 untuned_curve --compare --variant none --label bf16_repeat --bar 0.003
  step lp_curves_fp8_attention_vs_repeat 30 untuned_curve --compare --variant fp8_rowwise \
    --label fp8_attention_straight_through --baseline bf16_repeat --bar 0.003
}
chain_s21a() {  # issue 12: MXFP8's operand pass on the GPU (tests, then the op's time against bf16); issue 4: where
  # GDPA's op time goes on short ragged batches (L256 s0.5: 0.816 ms op against a 0.298 ms launch)
  step fp8_attention_gpu_tests 150 tests tests/gpu/test_fp8_attention_gpu.py
  step attention_fp8_quick 150 python -m benchmarks.attention_fp8 --quick
  step gdpa_small_overhead 150 python -m benchmarks.diag.gdpa_small_overhead
}
bf16_seed1_curve() {  # the BF16 run on a second seed, resumable (its FP8 partner comes in a later session)
  untuned_curve --variant none --label bf16_seed1 --set seed=1 --checkpoint-dir runs/curve_bf16_seed1 "$@"
}
fp8_late_bf16_curve() {  # issue 12's NE run with the last 2 of gem-small's 8 attention layers in bf16, resumable
  untuned_curve --variant fp8_rowwise --label fp8_attention_late_bf16 --set gem.attention_precision=fp8 \
    --set gem.bf16_attention_last_layers=2 --checkpoint-dir runs/curve_fp8_attention_late_bf16 "$@"
}
chain_s21b() { step lp_curve_fp8_late_bf16_part1 560 fp8_late_bf16_curve --stop-after 450; }
chain_s21c() {
  step lp_curve_fp8_late_bf16_part2 400 fp8_late_bf16_curve --resume
  step lp_curves_fp8_late_bf16_vs_repeat 30 untuned_curve --compare --variant fp8_rowwise \
    --label fp8_attention_late_bf16 --baseline bf16_repeat --bar 0.003
  step lp_curves_fp8_late_bf16 30 untuned_curve --compare --variant fp8_rowwise --label fp8_attention_late_bf16 \
    --bar 0.003
}
chain_s21d() {  # issue 10: gem-large with FP8 MLPs (never timed; bar 1.2x the samples/s of s20d's BF16 run)
  step bench_train_large_fp8 320 large_b512 train_gem-large_b512_s21_fp8_mlps --set low_precision_mlp=fp8_rowwise
}
chain_s21e() { step lp_curve_bf16_seed1_part1 560 bf16_seed1_curve --stop-after 450; }
chain_s21f() { step lp_curve_bf16_seed1_part2 300 bf16_seed1_curve --resume; }
chain_s22a() {  # issue 10: FP8 linears compiled as torch ops (Inductor fuses the quantizations; no row pad):
  # their GPU tests (both compile paths, ragged rows), the layer against compiled BF16, gem-small b2048 with FP8
  # MLPs then BF16 (the same-run peer); issue 4: GDPA's host time per call after the cached offsets summary
  step low_precision_gpu_tests 100 tests tests/gpu/test_low_precision_gpu.py
  step fp8_compile 100 python -m benchmarks.diag.fp8_compile
  step gdpa_small_overhead 70 python -m benchmarks.diag.gdpa_small_overhead
  step bench_train_fp8_inductor 170 train bench train --preset gem-small --batch-size 2048 --compile --steps 20 \
    --warmup 8 --num-workers 12 --low-precision-mlp fp8_rowwise --out "$out/results/train_gem-small_b2048_s22_fp8.json"
  step bench_train_bf16 130 train bench train --preset gem-small --batch-size 2048 --compile --steps 20 --warmup 8 \
    --num-workers 12 --out "$out/results/train_gem-small_b2048_s22_bf16.json"
}
small_train_fp8_inductor() { OPENGEM_FP8_COMPILE=inductor small_train --low-precision-mlp fp8_rowwise "$@"; }
chain_s23a() {  # issue 10: gem-small b2048 with FP8 MLPs through Inductor (OPENGEM_FP8_COMPILE=inductor), then BF16:
  # the same-call peer; caps for a cold compile cache (session 22 had none to carry)
  step bench_train_fp8_inductor 300 small_train_fp8_inductor --out "$out/results/train_gem-small_b2048_s23_fp8_inductor.json"
  step bench_train_bf16 240 small_train --out "$out/results/train_gem-small_b2048_s23_bf16.json"
}
chain_s23b() {  # issue 10's bar at gem-large b512: FP8 MLPs through Inductor, then BF16 (the same-call peer)
  step bench_train_large_fp8_inductor 320 env OPENGEM_FP8_COMPILE=inductor python -m opengem.cli.main bench train \
    --preset gem-large --batch-size 512 --compile --steps 12 --warmup 6 --num-workers 12 --set gem.sequence_dtype=compute \
    --set low_precision_mlp=fp8_rowwise --out "$out/results/train_gem-large_b512_s23_fp8_inductor.json"
  step bench_train_large 240 large_b512 train_gem-large_b512_s23_bf16_sequence
}
chain_s23c() {  # the traced FP8 linears' GPU tests (both compile paths) and the layer against compiled BF16 (issue 10);
  # issue 4: GDPA (a) L256 / L512 at s0.5 with JFA and the compiled padded peer after the host-time cut (writes
  # gdpa.json: keep the full run's file, rename this one), then where the with-grad host time goes
  step low_precision_gpu_tests 100 tests tests/gpu/test_low_precision_gpu.py
  step fp8_compile 80 python -m benchmarks.diag.fp8_compile
  step gdpa_small 150 python -m benchmarks.gdpa --workloads "a self L=256 s=0.5,a self L=512 s=0.5" \
    --peers jfa,padded-compiled
  step gdpa_small_overhead 80 python -m benchmarks.diag.gdpa_small_overhead
}
chain_s24a() {  # session 22, call 4: the low-precision GPU tests held to the fp32 computation; gem-large b512 FP8
  # through Inductor, then BF16, both with Inductor's mix-order reductions off (call 3: the FP8 backward's row
  # quantization fused with the bias gradient's column sum into mix-order kernels at 0.66-2.8 ms a call). Call 4 also
  # printed the setting through `python -c` (session22_logs/call4_s24a_mix_order_off.log: False)
  step low_precision_gpu_tests 80 tests tests/gpu/test_low_precision_gpu.py
  step bench_train_large_fp8_inductor_nomix 290 env TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 OPENGEM_FP8_COMPILE=inductor \
    python -m opengem.cli.main bench train --preset gem-large --batch-size 512 --compile --steps 12 --warmup 6 \
    --num-workers 12 --set gem.sequence_dtype=compute --set low_precision_mlp=fp8_rowwise \
    --out "$out/results/train_gem-large_b512_s24_fp8_inductor_nomix.json"
  step bench_train_large_nomix 190 env TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 python -m opengem.cli.main bench train \
    --preset gem-large --batch-size 512 --compile --steps 12 --warmup 6 --num-workers 12 \
    --set gem.sequence_dtype=compute --out "$out/results/train_gem-large_b512_s24_bf16_nomix.json"
}
chain_s24b() {  # session 22, call 5: the traced FP8 linear's bias gradient as a GEMV (no mix-order fusion with dy's
  # row amax), Inductor's defaults otherwise: gem-large b512 FP8 then BF16 in one call, then the low-precision GPU tests
  step bench_train_large_fp8_inductor 240 env OPENGEM_FP8_COMPILE=inductor python -m opengem.cli.main bench train \
    --preset gem-large --batch-size 512 --compile --steps 12 --warmup 6 --num-workers 12 --set gem.sequence_dtype=compute \
    --set low_precision_mlp=fp8_rowwise --out "$out/results/train_gem-large_b512_s24_fp8_inductor_gemv_bias.json"
  step bench_train_large 160 large_b512 train_gem-large_b512_s24_bf16
  step low_precision_gpu_tests 80 tests tests/gpu/test_low_precision_gpu.py  # last: the device time left is short
}
chain_s25a() {  # session 23: issue 4's short-sample bars (1.1x JFA's forward, (b)'s 400 TFLOP/s) with extra tiles
  step gdpa_short_tiles 300 python -m benchmarks.diag.gdpa_short_tiles
}
chain_s25b() {  # session 23: the 64 x 32 forward (and the backward's 32-wide tiles) shipped; issue 4's bars in one run
  step gdpa_gpu_tests 90 tests tests/gpu/test_gdpa_gpu.py
  step gdpa_a_b 240 python -m benchmarks.gdpa --workloads "a self L=256,a self L=512,b cross Q<=2048 KV=256" \
    --peers jfa,padded-compiled
  step low_precision_gpu_tests 60 tests tests/gpu/test_low_precision_gpu.py
}
chain_s26a() {  # after session 23: which bias-gradient formulation keeps dy's reductions out of the slow mix-order kernels
  step fp8_backward_reductions 240 python -m benchmarks.diag.fp8_backward_reductions
}
chain_s26b() {  # after session 23: does the 64 x 32 tile that won GDPA's forward win JFA's too?
  step jfa_forward_tiles 300 python -m benchmarks.diag.jfa_configs --sweep fwd \
    --workloads b_L512_s0.5_full,b_L512_s1.0_full,b_L1024_s0.5_full --extra-tiles 64x32x4x4,64x32x4x3,128x32x8x4
}
clock_log() {  # clock_log start|stop: the SM clock, power and throttle reasons every 200 ms into logs/clocks.csv
  if [ "$1" = start ]; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
      --format=csv -lms 200 > "$out/logs/clocks.csv" 2>&1 &
    clock_pid=$!
  else
    kill "$clock_pid" 2>/dev/null
  fi
}
chain_s27a() {  # session 24: where GDPA's op time goes beyond its kernel at L512, then issue 4's (a) bars with x_fwd_paired
  clock_log start
  step gdpa_small_overhead 200 python -m benchmarks.diag.gdpa_small_overhead
  step gdpa_a 300 python -m benchmarks.gdpa --workloads "a self L=256,a self L=512,a self L=1024" \
    --peers jfa,padded-compiled
  clock_log stop
}
chain_s27b() {  # session 24: the 32-key JFA forward tiles shipped; where GDPA's (b) forward spends its time
  clock_log start
  step jfa_gpu_tests 200 tests tests/gpu/test_jagged_attention_gpu.py
  step gdpa_activation_cost 150 python -m benchmarks.diag.gdpa_activation_cost
  step gdpa_a_jfa 120 python -m benchmarks.gdpa --workloads "a self L=256,a self L=512" --peers jfa
  step jfa_short 120 python -m benchmarks.jfa --workloads b_L512_s0.5_full,b_L512_s1.0_full,b_L1024_s0.5_full \
    --no-flex --peers torch_varlen_flash
  clock_log stop
}
chain_s27c() {  # session 24: fast_gelu in 5 instructions a score (was 8): issue 4's (a) and (b) bars
  clock_log start
  step gdpa_gpu_tests 120 tests tests/gpu/test_gdpa_gpu.py
  step gdpa_activation_cost 100 python -m benchmarks.diag.gdpa_activation_cost --activations identity,fast_gelu
  step gdpa_a_b 200 python -m benchmarks.gdpa --workloads "a self L=256,a self L=512,b cross Q<=2048 KV=256" \
    --peers jfa,padded-compiled
  clock_log stop
}
chain_s27d() {  # session 24: s27c after its fixes, within the device time left
  clock_log start
  step gdpa_gpu_tests 100 tests tests/gpu/test_gdpa_gpu.py
  step gdpa_a_b 200 python -m benchmarks.gdpa --workloads "a self L=256,a self L=512,b cross Q<=2048 KV=256" \
    --peers jfa,padded-compiled
  clock_log stop
}
chain_s28a() {  # after session 24: issue 4 in full after the smoothstep and the register cap; host time against JFA's
  clock_log start
  step gdpa_small_overhead 150 python -m benchmarks.diag.gdpa_small_overhead
  step gdpa_a 380 python -m benchmarks.gdpa --workloads "a self" --peers jfa,padded-compiled
  clock_log stop
}
chain_s28c() {  # issue 10: gem-large b512 BF16 after JFA's 32-key forward tiles and GDPA's smoothstep fast_gelu
  step bench_train_large 300 large_b512 train_gem-large_b512_s28_bf16
}
chain_s29a() {  # after session 25: JFA's backward on GDPA's narrower inner tiles (no spills at sm_90 on the CPU compile,
  # against 16-176 B for the 64 x 128 dK/dV the tuner has); the GPU tests first (they force the new tiles too)
  step jfa_gpu_tests 200 tests tests/gpu/test_jagged_attention_gpu.py
  step jfa_backward_tiles 380 python -m benchmarks.diag.jfa_configs --sweep dkdv,dq \
    --workloads c_1024_hist_64_targets,b_L1024_s0.5_causal,b_L512_s0.5_full \
    --extra-tiles 32x128x8x2,32x128x8x3,32x64x4x3,32x64x4x2,64x32x4x3,64x32x4x2,128x32x8x3
}
chain_s29b() {  # after s29a: dK/dV's 32-query-row tiles on the GEM-like batch (64 targets), then gem-large with them tuned
  step jfa_dkdv_gem_batch 200 python -m benchmarks.diag.jfa_configs --sweep dkdv --workloads c_1024_hist_64_targets \
    --extra-tiles 32x64x4x3,32x64x4x2,32x128x8x3
  step bench_train_large 300 large_b512 train_gem-large_b512_s29_bf16
}
chain_s29c() {  # issue 12: the FP8 JFA forward with P's scale and the logit scale folded into its exponent (-20% SASS in the loop)
  step fp8_jfa_gpu_tests 170 tests tests/gpu/test_fp8_attention_gpu.py -k "not gdpa and not block_attention"
  step attention_fp8_a 300 python -m benchmarks.attention_fp8 --workloads a_
}
chain_s29d() { step attention_fp8_ac 300 python -m benchmarks.attention_fp8 --workloads a_,c_; }  # s29c's (a) again, and (c)
chain_s30a() {  # after session 26: the persistent fused FP8 projection (bits and time), and the bf16 forward's tiles on (a)
  step fp8_projection_gpu_tests 150 tests tests/gpu/test_fp8_attention_gpu.py -k "persistent or fused"
  step attention_fp8_a 300 python -m benchmarks.attention_fp8 --workloads a_
  step jfa_fwd_tiles_a 150 python -m benchmarks.diag.jfa_configs --sweep fwd --workloads a_power_law_causal
}
chain_s30b() {  # session 27: does JFA's tuner (rested card) pick what runs fastest on a hot, power-capped card?
  clock_log start
  step jfa_tuning_regimes 450 python -m benchmarks.diag.jfa_tuning_regimes --workloads a_power_law_causal,c_1024
  clock_log stop
}
chain_s30c() {  # session 27: how often each tuner misses the hot-fastest tile; FP8 attention's (a) with the new tuner
  clock_log start
  step jfa_tuner_retunes 330 python -m benchmarks.diag.jfa_tuning_regimes --workloads a_power_law_causal,c_1024 --retunes 5
  clock_log stop
  step attention_fp8_a 200 python -m benchmarks.attention_fp8 --workloads a_
}
chain_s30d() {  # session 27: the JFA GPU tests (tuned through the interleaved rounds), then gem-large with them
  step jfa_gpu_tests 220 tests tests/gpu/test_jagged_attention_gpu.py
  step bench_train_large 330 large_b512 train_gem-large_b512_s30_bf16
}
chain_s30e() {  # session 27: FP8 attention GPU tests, then issue 12's ratios against the strongest bf16 forward tile
  step fp8_attention_gpu_tests 170 tests tests/gpu/test_fp8_attention_gpu.py -k "not gdpa and not block_attention"
  step attention_fp8_ac 330 python -m benchmarks.attention_fp8 --workloads a_,c_
}
chain_s31a() {  # session 28: does a second, longer look at the close finalists pick the hot-fastest tile?
  clock_log start
  step jfa_tuner_confirm 420 python -m benchmarks.diag.jfa_tuning_regimes --workloads a_power_law_causal,c_1024 --retunes 6
  clock_log stop
  step fp8_attention_gpu_tests 170 tests tests/gpu/test_fp8_attention_gpu.py -k "not gdpa and not block_attention"
}
chain_s31b() {  # session 28: issue 12's ratios with the register-capped FP8 tiles; JFA GPU tests under the new tuner
  step attention_fp8_ac 330 python -m benchmarks.attention_fp8 --workloads a_,c_
  step jfa_gpu_tests 220 tests tests/gpu/test_jagged_attention_gpu.py
}
chain_s31c() {  # session 28: gem-large b512 BF16, every kernel tuned by the confirming autotuner (issue 10)
  step bench_train_large 560 large_b512 train_gem-large_b512_s31_bf16
}
chain_s31d() {  # session 28: how fast the quantize pass can go; FP8 GDPA (issue 12's (a) and (b)) with the new tiles
  step fp8_quantize_pass 150 python -m benchmarks.diag.fp8_quantize_pass --workloads a_,c_
  step gdpa_fp8_full 420 python -m benchmarks.gdpa_fp8
}
chain_s31e() { step attention_fp8_ac 330 python -m benchmarks.attention_fp8 --workloads a_,c_; }  # session 28
chain_s31f() {  # session 28
  step embedding_gpu_tests 90 tests tests/gpu/test_embedding_gpu.py
  step fp8_gdpa_block_gpu_tests 120 tests tests/gpu/test_fp8_attention_gpu.py -k "gdpa or block_attention"
}
chain_s32a() {  # session 29: the waiting list after session 28 (items 1-3)
  step fp8_quantize_pass 120 python -m benchmarks.diag.fp8_quantize_pass --workloads a_,c_
  step gdpa_fp8_full 240 python -m benchmarks.gdpa_fp8
  step jfa_fwd_regimes 150 python -m benchmarks.diag.jfa_tuning_regimes --workloads a_power_law_causal,c_1024 --passes fwd
  step jfa_gpu_tests 170 tests tests/gpu/test_jagged_attention_gpu.py
}
chain_s32d() {  # session 29: the quantize pass's new default on the GPU (tests), issue 12's ratios with it
  step fp8_attention_gpu_tests 120 tests tests/gpu/test_fp8_attention_gpu.py -k "not gdpa and not block_attention"
  step attention_fp8_ac 330 python -m benchmarks.attention_fp8 --workloads a_,c_
}
chain_s32e() {  # session 29
  step fp8_gdpa_block_gpu_tests 100 tests tests/gpu/test_fp8_attention_gpu.py -k "gdpa or block_attention"
  step bench_train_large 240 large_b512 train_gem-large_b512_s32_bf16
}
chain_s33a() {  # after session 29: issue 10's figure at this HEAD
  step bench_train_large 560 large_b512 train_gem-large_b512_s33_bf16
}
chain_s33b() {  # session 30: issue 10's element-wise kernels, each against the copy bandwidth
  step inductor_kernel_bytes 420 python -m benchmarks.diag.inductor_kernel_bytes --out "$out/results"
}
chain_s33c() { step gdpa_gem_layers 300 python -m benchmarks.diag.gdpa_gem_layers --out "$out/results"; }
chain_s33d() {
  step gdpa_gpu_tests 170 tests tests/gpu/test_gdpa_gpu.py
  step gdpa_gem_layers 120 python -m benchmarks.diag.gdpa_gem_layers --out "$out/results"
  step inductor_kernel_bytes 300 python -m benchmarks.diag.inductor_kernel_bytes --out "$out/results"
}
chain_s33e() {
  step gdpa_gpu_tests 170 tests tests/gpu/test_gdpa_gpu.py
  step gdpa_gem_layers 120 python -m benchmarks.diag.gdpa_gem_layers --out "$out/results"
  step gdpa_b 240 python -m benchmarks.gdpa --workloads "b " --peers padded-compiled
}
chain_s33f() {
  step gdpa_gpu_tests 200 tests tests/gpu/test_gdpa_gpu.py
  step fp8_gdpa_block_gpu_tests 120 tests tests/gpu/test_fp8_attention_gpu.py -k "gdpa or block_attention"
}
chain_s33g() {
  step gdpa_gpu_tests 200 tests tests/gpu/test_gdpa_gpu.py
  step gdpa_gem_layers 120 python -m benchmarks.diag.gdpa_gem_layers --out "$out/results"
}
chain_s33h() { step bench_train_large 250 large_b512 train_gem-large_b512_s33h_bf16; }
chain_s34b() {  # session 31: the QKV bias gradient from JFA's backward kernels; gaps from a kernels-only profile
  step jfa_gpu_tests 150 tests tests/gpu/test_jagged_attention_gpu.py -k "column_sums or packed or deterministic or curated"
  step bench_train_large 280 large_b512 train_gem-large_b512_s34b_bf16
}
chain_s34c() {  # session 31: Inductor's combo kernels (the per-weight casts in fewer launches), no size asserts
  step bench_train_large_combo 520 python -m benchmarks.diag.with_inductor_config combo_kernels=True size_asserts=False \
    -- bench train --preset gem-large --batch-size 512 --compile --steps 12 --warmup 6 --num-workers 12 \
    --set gem.sequence_dtype=compute --out "$out/results/train_gem-large_b512_s34c_combo_bf16.json"
}
chain_s34d() {  # session 31: where the GPU waits for the host in the timed regime (no profiler); GPU tests of the session
  step session_gpu_tests 150 tests tests/gpu/test_jagged_attention_gpu.py tests/gpu/test_flops_gpu.py \
    tests/gpu/test_fp8_attention_gpu.py -k "qkv or bench_train"
  step host_lead 330 python -m benchmarks.diag.host_lead --out "$out/results/host_lead_gem-large_b512.json"
}
chain_s34e() { step host_lead 330 python -m benchmarks.diag.host_lead --steps 8 --out "$out/results/host_lead_gem-large_b512.json"; }
chain_s35a() {  # next session, first call, no carried cache: GDPA's projection-bias gradients, then gem-large with them
  step gdpa_gpu_tests 220 tests tests/gpu/test_gdpa_gpu.py -k "projection_bias or resident or short_query or packed"
  step bench_train_large 330 large_b512 train_gem-large_b512_s35a_bf16
}
chain_s35b() {  # next session: Hopper's programmatic dependent launch for Inductor's kernels against the default
  step bench_train_large 200 large_b512 train_gem-large_b512_s35b_default_bf16
  step bench_train_large_pdl 360 python -m benchmarks.diag.with_inductor_config triton.enable_pdl=True \
    -- bench train --preset gem-large --batch-size 512 --compile --steps 12 --warmup 6 --num-workers 12 \
    --set gem.sequence_dtype=compute --out "$out/results/train_gem-large_b512_s35b_pdl_bf16.json"
}
chain_s35c() { step host_lead 330 python -m benchmarks.diag.host_lead --steps 10 --out "$out/results/host_lead_gem-large_b512.json"; }
chain_s36a() {  # session 32: GDPA's projection-bias gradient from its kernels against a column sum, same run; gem-large
  step gdpa_bias 150 python -m benchmarks.diag.gdpa_gem_layers --bias --out "$out/results"
  step bench_train_large 260 large_b512 train_gem-large_b512_s36a_bf16
}
chain_s36b() {  # session 32: Hopper's programmatic dependent launch for Inductor's kernels against the default, same call
  step bench_train_large 150 large_b512 train_gem-large_b512_s36b_default_bf16
  step bench_train_large_pdl 330 python -m benchmarks.diag.with_inductor_config triton.enable_pdl=True \
    -- bench train --preset gem-large --batch-size 512 --compile --steps 12 --warmup 6 --num-workers 12 \
    --set gem.sequence_dtype=compute --out "$out/results/train_gem-large_b512_s36b_pdl_bf16.json"
}
chain_s36c() { step host_lead 300 python -m benchmarks.diag.host_lead --steps 10 --out "$out/results/host_lead_gem-large_b512.json"; }
chain_s36d() {  # session 32: GDPA dK/dV over chunks of long samples' query rows: GPU tests, PFFN A/B, gem-large
  step gdpa_gpu_tests 200 tests tests/gpu/test_gdpa_gpu.py -k "query_chunks or projection_bias or cross_attention"
  step gdpa_query_chunks 90 python -m benchmarks.diag.gdpa_gem_layers --query-chunks --out "$out/results"
  step bench_train_large 140 large_b512 train_gem-large_b512_s36d_bf16
  step host_lead 160 python -m benchmarks.diag.host_lead --steps 10 --out "$out/results/host_lead_gem-large_b512.json"
}
chain_s36e() {  # session 32: the chunked dK/dV's GPU tests again (s36d's test fixes), no carried cache needed
  step gdpa_gpu_tests 170 tests tests/gpu/test_gdpa_gpu.py -k "query_chunks or cross_kv or pffn_q"
}
chain_s37a() {  # next session: the forward's own host pace (drained queue) and its cProfile; gem-large with the profile
  step host_lead_drained 170 python -m benchmarks.diag.host_lead --steps 8 --drain-before-step \
    --out "$out/results/host_lead_gem-large_b512_drained.json"
  step host_lead_profiled 150 python -m benchmarks.diag.host_lead --steps 4 --drain-before-step --profile-forward \
    --out "$out/results/host_lead_gem-large_b512_profiled.json"
  step bench_train_large 250 large_b512 train_gem-large_b512_s37a_bf16
}
chain_s37b() {  # next session (after s37a's cache): gem-large with autocast's per-use weight casts, then with shadows
  step bench_train_large 140 large_b512 train_gem-large_b512_s37b_default_bf16
  step bench_train_large_shadows 330 large_b512 train_gem-large_b512_s37b_shadows_bf16 --set weight_shadows=true
}
chain_s37c() { step shadows_gpu_tests 320 tests tests/gpu/test_weight_shadows_gpu.py; }  # the shadows' GPU tests
# Session 34 changed the GEM layer's graph (Wukong's shared-operand token mixing), so the carried cache misses: each
# gem-large variant compiles cold (~185 s) once, in parts s39a-s39c; s39d then runs all three warm in one call (the
# same-run ratios), on the same machine or with the cache those calls return.
chain_s39a() { step bench_train_large 420 large_b512 train_gem-large_b512_s39a_default_bf16; }
chain_s39b() {
  step bench_train_large_shadows 420 large_b512 train_gem-large_b512_s39b_shadows_bf16 --set weight_shadows=true
}
chain_s39c() {
  step bench_train_large_fp32_grads 420 large_b512 train_gem-large_b512_s39c_fp32_grads_bf16 --set weight_shadows=true \
    --set fp32_weight_grads=true
}
chain_s39d() {  # the three in one call (same-run ratios; caps for cold compiles, ~100 s a graph in session 36)
  step bench_train_large 240 large_b512 train_gem-large_b512_s39d_default_bf16
  step bench_train_large_shadows 200 large_b512 train_gem-large_b512_s39d_shadows_bf16 --set weight_shadows=true
  step bench_train_large_fp32_grads 150 large_b512 train_gem-large_b512_s39d_fp32_grads_bf16 \
    --set weight_shadows=true --set fp32_weight_grads=true
}
chain_s39e() {  # the shadows' GPU tests, then Wukong's token mixings alone (sessions 16-33's against session 34's)
  step shadows_gpu_tests 320 tests tests/gpu/test_weight_shadows_gpu.py
  step wukong_gemms 240 python -m benchmarks.diag.wukong_gemms --out "$out/results"
}
# Session 35: s40c ran JFA's stored-dS backward (0.979x on gem-large), removed after it (code at ce0a453); s40a-b dropped
chain_s40d() {  # s39b and s39c in one call (each compiles its graph once; ran in session 36)
  step bench_train_large_shadows 285 large_b512 train_gem-large_b512_s40d_shadows_bf16 --set weight_shadows=true
  step bench_train_large_fp32_grads 285 large_b512 train_gem-large_b512_s40d_fp32_grads_bf16 \
    --set weight_shadows=true --set fp32_weight_grads=true
}
chain_s41a() {  # session 36: every JFA tile on gem-large's attention shape (the tuner's picks among them), then gem-small
  step jfa_tiles_gem_large 330 python -m benchmarks.diag.jfa_configs --sweep fwd,dkdv,dq \
    --workloads e_power_law_full_window1024 --extra-tiles 32x64x4x3,64x32x4x3,64x32x4x4
  step bench_train_small 250 small_train --out "$out/results/train_gem-small_b2048_s41a_bf16.json"
}
chain_s42b() {  # session 37: gem-small b2048 with the fp32 and the bf16 sequence stream in one call (same device)
  step bench_train_small 280 small_train --out "$out/results/train_gem-small_b2048_s42b_bf16.json"
  step bench_train_small_bf16_stream 240 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s42b_bf16_stream.json"
}
chain_s43a() {  # session 38: gem-small b2048 as it stands, then under Inductor's max-autotune (never measured), one call
  step bench_train_small 230 small_train --out "$out/results/train_gem-small_b2048_s43a_default.json"
  step bench_train_small_max_autotune 340 small_train --set compile_mode=max-autotune-no-cudagraphs \
    --out "$out/results/train_gem-small_b2048_s43a_max_autotune.json"
}
chain_s43d() {  # session 38: gem-small b2048 as set, alone: a cold compile took more than 230 s (s43a)
  step bench_train_small 540 small_train --out "$out/results/train_gem-small_b2048_s43d_default.json"
}
chain_s44a() {  # session 39: gem-small b2048 with the bf16 sequence stream alone (s42b's second step; cold compile)
  step bench_train_small_bf16_stream 540 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s44a_bf16_stream.json"
}
# Session 39: s44b and s44c ran norm_linear (a LayerNorm folded into its GEMM: 0.63x the compiled pair's forward at
# gem-small's QKV, 0.86x its feed-forward sublayer), removed after them (code at 64ffb60)
chain_s44d() {  # session 39: the shadows' GPU tests again, tolerances from s39e's run (kernel counts unchecked)
  step shadows_gpu_tests 220 tests tests/gpu/test_weight_shadows_gpu.py
}
chain_s45a() {  # session 40: issue 4 on an H100 (its acceptance device; sessions 10-33 measured GDPA on H200s)
  step gdpa_gpu_tests 200 tests tests/gpu/test_gdpa_gpu.py  # 130 s in session 40 ended at 52 of 53 (cold machine)
  step gdpa_a 380 python -m benchmarks.gdpa --workloads "a self"
}
chain_s45b() { step gdpa_bcd 480 python -m benchmarks.gdpa --workloads "b cross,c pool,d hstu"; }  # s45a's other half
chain_s45c() { step gdpa_gpu_tests_pooling_kv 150 tests tests/gpu/test_gdpa_gpu.py -k pooling_kv; }  # s45a's 53rd
chain_s45d() {  # after session 40: issue 12 on an H100 (sessions 17-33 measured FP8 attention on H200s)
  step fp8_attention_gpu_tests 200 tests tests/gpu/test_fp8_attention_gpu.py
  step attention_fp8_a 300 python -m benchmarks.attention_fp8 --workloads a_
}
chain_s45e() { step gdpa_fp8_full 300 python -m benchmarks.gdpa_fp8; }  # s45d's other half: GDPA (a) and (b) in FP8
chain_s45f() {  # after session 40: the warp-specialized Gluon GDPA forward (a diag, not wired into the op) on (a)
  step gluon_gdpa_forward 520 python -m benchmarks.diag.gluon_gdpa_forward  # smoke calls first, 120 s cap each
}
chain_s45g() { step gluon_gdpa_dkdv 500 python -m benchmarks.diag.gluon_gdpa_dkdv; }  # s45f's backward counterpart
chain_s46a() {  # session 41: the Gluon forward with a partition a warpgroup (K freed early), against session 40's best
  step gluon_gdpa_forward 330 python -m benchmarks.diag.gluon_gdpa_forward
  step gluon_gdpa_dkdv_l2048 150 python -m benchmarks.diag.gluon_gdpa_dkdv --workloads "a self L=2048"  # shared ring
}
chain_s46c() {  # session 41: the fused Gluon backward's dQ added four fp32 an instruction (red.v4) against one (atom)
  step gluon_gdpa_dkdv_red4 100 python -m benchmarks.diag.gluon_gdpa_dkdv --workloads "a self L=2048" \
    --variants gluon_m32_s3_fused_dq,gluon_m32_s3_fused_dq_red4
}
chain_s47a() {  # after session 41: the persistent two-partition Gluon forward (a program an SM) against one-item ones
  step gluon_gdpa_forward 300 python -m benchmarks.diag.gluon_gdpa_forward  # smoke calls first, 120 s cap each
}
gluon_dkdv() {  # gluon_dkdv CAP VARIANTS: the Gluon backward diag's variants (comma-separated) on (a): L1024 and L2048,
  # and the short sparsity-1.0 rows where the 2x bar is furthest (L256: 1.49x) and the op's two passes weigh most
  step gluon_gdpa_dkdv "$1" python -m benchmarks.diag.gluon_gdpa_dkdv \
    --workloads "a self L=256 s=1.0,a self L=512 s=1.0,a self L=1024,a self L=2048" --variants "$2"
}
S47_FUSED=gluon_m32_s3_fused_dq
chain_s47b() {  # after session 41: the Gluon backward in key halves or pipelined, and the fused one with a writer
  gluon_dkdv 400 "gluon_m64_s2,gluon_m32_s3,gluon_m64_s2_2wg,gluon_m32_s3_2wg,gluon_m32_s3_pipelined,\
gluon_m32_s3_2wg_pipelined,$S47_FUSED,${S47_FUSED}_red4,${S47_FUSED}_writer,${S47_FUSED}_writer_2wg"
}
chain_s47ab() {  # after session 42: s47a, then the backward's deciding variants (dQ by the writer or by TMA reduce-adds,
  # pipelined, 64-key programs two an SM), in one call (a refused start costs 90-180 s of device time)
  step gluon_gdpa_forward 240 python -m benchmarks.diag.gluon_gdpa_forward
  gluon_dkdv 340 "gluon_m32_s3,gluon_m32_s3_n64,gluon_m32_s3_pipelined,${S47_FUSED}_red4,${S47_FUSED}_writer,\
${S47_FUSED}_tma,${S47_FUSED}_tma_pipelined,gluon_m32_s2_fused_dq_tma_n64"
}
chain_s47c() {  # after session 42: the rest of s47b (key halves), `tma` again as the link, the other new forms
  gluon_dkdv 450 "gluon_m64_s2,gluon_m64_s2_2wg,gluon_m32_s3_2wg,gluon_m32_s3_2wg_pipelined,gluon_m32_s3_pipelined_n64,\
${S47_FUSED}_writer_2wg,${S47_FUSED}_tma,${S47_FUSED}_tma_2wg,${S47_FUSED}_tma_2wg_pipelined,\
gluon_m32_s2_fused_dq_tma_pipelined_n64"
}
chain_s48a() {  # session 43: the persistent Gluon forward inside opengem.ops.gdpa (a tuner candidate), its GPU tests,
  # then issue 4's (a) with it (session 40: 375 s)
  step gdpa_gluon_gpu_tests 150 tests tests/gpu/test_gdpa_gluon_gpu.py
  step gdpa_a 400 env OPENGEM_GDPA_GLUON=auto python -m benchmarks.gdpa --workloads "a self"
}
chain_s48c() {  # session 43, a short device budget: s48a with JFA as the only peer (the forward bar and the tuner's pick)
  step gdpa_gluon_gpu_tests 150 tests tests/gpu/test_gdpa_gluon_gpu.py
  step gdpa_a_jfa 280 env OPENGEM_GDPA_GLUON=auto python -m benchmarks.gdpa --workloads "a self" --peers jfa
}
chain_s48b() {  # session 43: every GDPA GPU test (activation_value's identity branch moved), then (b), (c), (d)
  step gdpa_gpu_tests 200 tests tests/gpu/test_gdpa_gpu.py
  step gdpa_bcd 400 env OPENGEM_GDPA_GLUON=auto python -m benchmarks.gdpa --workloads "b cross,c pool,d hstu"
}
chain_s49a() {  # session 44: dQ by TMA reduces in key halves with 64-row steps (one dQ slot a half, to fit), against
  # its 32-row twin and the best fused form; the 64-key dK/dV-only form, with the NaN-poisoned smoke (its inf)
  gluon_dkdv 240 "gluon_m64_s2_fused_dq_tma_2wg_1slot,${S47_FUSED}_tma_2wg,${S47_FUSED}_tma,gluon_m64_s2_2wg,\
gluon_m32_s3_n64"
}
chain_s50a() {  # session 45: GDPA's tiles ordered by keys (JFA's order: a sample's partial tile beside its full ones)
  # against rows x keys, forward and forward+backward on (a)'s s0.5 rows and the L512 s1.0 control (same tiles);
  # the Gluon forward in both orders beside the Triton one, through the op's launch
  step gdpa_work_order 200 python -m benchmarks.diag.gdpa_work_order
}
chain_s50b() {  # session 46: issue 4's (a) under the op's defaults (tiles ordered by keys, the second-look tuner,
  # the Gluon forward off): all eight rows in one call
  clock_log start  # the SM clock beside the run: L2048 s1.0's GDPA forward took 18.06 / 19.14 ms in two runs
  step gdpa_a 400 python -m benchmarks.gdpa --workloads "a self"
  clock_log stop
}
chain_s50d() {  # session 46: gem-large's two GDPA layers on its power-law batches, tiles by rows x keys against by
  # keys (the default; the query-chunked PFFN dK/dV included), twice each, alternating
  step gdpa_gem_layers_order 240 python -m benchmarks.diag.gdpa_gem_layers --work-order --out "$out/results"
}
chain_s50c() {  # session 46: the two (a) rows under 1.1x JFA in s48a3 (L1024 / L2048 s1.0), the op's defaults and
  # GDPA's second-look tuner, against JFA only (what 382 s of device time allow)
  step gdpa_a_s1 220 python -m benchmarks.gdpa --workloads "a self L=1024 s=1.0,a self L=2048 s=1.0" --peers jfa
}
chain_s46b() {  # session 41: the two-partition Gluon forward with FlashAttention-3's ping-pong (partitions take turns)
  step gluon_gdpa_forward 280 python -m benchmarks.diag.gluon_gdpa_forward
}
chain_s38a() {  # next session: gem-small b2048 as it stands (session 23: 139.8 ms, 15.4%), then with the weight shadows
  step bench_train_small 280 small_train --out "$out/results/train_gem-small_b2048_s38a_bf16.json"
  step bench_train_small_shadows 280 small_train --set weight_shadows=true \
    --out "$out/results/train_gem-small_b2048_s38a_shadows_bf16.json"
}
host_samples_at() {  # host_samples_at PRESET BATCH NAME [ARGS]: py-spy's samples of steady staged steps (20 s)
  local preset=$1 batch=$2 name=$3; shift 3
  python -m benchmarks.diag.host_samples --preset "$preset" --batch-size "$batch" --steps 4 --seconds 20 \
    --py-spy "${PY_SPY:?installed by with_py_spy}" --out "$out/results/$name.json" "$@"
}
with_py_spy() {  # py-spy (not on the GPU image) from the carried .whl/ into /tmp/site, exported as PY_SPY
  if ! python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/py_spy-*.whl; then
    echo "rc=1 py-spy install failed" >> "$out/status"
    return 1
  fi
  export PY_SPY=/tmp/site/bin/py-spy
}
chain_s59a() {  # session 54: where the host's time goes in steady steps, sampled by py-spy from outside (cProfile
  # slowed the Python it timed: session 53), gem-large b256 and gem-small b2048 on staged batches, then gem-large's
  # samples of the thread holding the interpreter lock (--gil: summed near the step's ms, Python paces the step)
  with_py_spy || return
  step host_samples_large 200 host_samples_at gem-large 256 host_samples_gem-large_b256_s59a
  step host_samples_small 170 host_samples_at gem-small 2048 host_samples_gem-small_b2048_s59a
  step host_samples_large_gil 170 host_samples_at gem-large 256 host_samples_gem-large_b256_s59a_gil --gil
}
chain_s59d() {  # session 54, after s59a: bench train gem-large b256 at HEAD (not rerun on a fast host since session
  # 51), then gem-large's samples with native frames (the CUDA driver's share of the launches)
  with_py_spy || return
  step bench_train_large_b256 220 large_at 256 train_gem-large_b256_s59d
  step host_samples_large_native 200 host_samples_at gem-large 256 host_samples_gem-large_b256_s59d_native --native
}
chain_s59c() {  # s59a's gem-large samples alone (for a device budget that fits one short call)
  with_py_spy || return
  step host_samples_large 200 host_samples_at gem-large 256 host_samples_gem-large_b256_s59a
}
chain_s60a() {  # session 55: s60b, then s58e's 16 ABBA rounds
  chain_s60b
  chain_s58e
}
chain_s60b() {  # session 55: s59d's native samples again (py-spy refuses --native with --nonblocking; the diag now
  # pauses the process for them, so fewer samples: 100 a second for 10 s)
  with_py_spy || return
  step host_samples_large_native 160 host_samples_at gem-large 256 host_samples_gem-large_b256_s60a_native --native \
    --seconds 10 --rate 100
}
chain_s60c() {  # session 55: Inductor's C++ wrapper (compile_cpp_wrapper=true: the generated code launches its
  # kernels and calls cuBLAS from C++; s59a: 45 of 75 ms under the interpreter lock a gem-large step were Inductor's
  # Python launches and lines): bench train, a cold compile of every graph with the wrappers in C++ (g++ on each
  # graph's wrapper: minutes; the cache comes back for a second call if the cap cuts it)
  cpp_wrapper_bench 560
}
cpp_wrapper_bench() {  # cpp_wrapper_bench CAP: s60c's bench train with the C++ wrapper (the setting, session 56)
  step bench_train_large_b256_cpp_wrapper "$1" large_at 256 train_gem-large_b256_s60c_cpp_wrapper \
    --set compile_cpp_wrapper=true
}
cpp_wrapper_samples() {  # cpp_wrapper_samples CAP: s60d's --gil samples with the C++ wrapper (after with_py_spy)
  step host_samples_large_gil_cpp_wrapper "$1" host_samples_at gem-large 256 \
    host_samples_gem-large_b256_s60c_gil_cpp_wrapper --gil --set compile_cpp_wrapper=true
}
chain_s60d() {  # after s60c on the same machine (its compile cache warm): the --gil samples with the C++ wrapper
  with_py_spy || return
  cpp_wrapper_samples 300
}
chain_s60f() {  # session 56, when one call is all the device time allows: s60d's samples first (they pay the cold
  # compile; their unsampled laps give the step time too), then s60c's bench on the cache they filled
  with_py_spy || return
  cpp_wrapper_samples 420
  cpp_wrapper_bench 135
}
chain_s60e() {  # session 56: after s60c on the same machine, when it is not an H100: the plain b256 baseline of that
  # machine (its cache warm from the carry), then s60d
  chain_s60g
  chain_s60d
}
chain_s60h() {  # session 56, for ~400 s of device time: s60d's samples alone, paying the cold compile (their unsampled
  # laps give the step time; the cache comes back for s60c)
  with_py_spy || return
  cpp_wrapper_samples 370
}
chain_s60g() {  # session 56: after s60f on the same machine: the plain b256 baseline (cache warm from the carry)
  step bench_train_large_b256 150 large_at 256 train_gem-large_b256_s60e_baseline
}
chain_s61a() {  # session 58: the plain b256 baseline (as s60g), then gem-large b512 with activation_memory_budget=0.35
  # on the same machine: the compiled blocks recompute the cheapest 65% of what they save (s55c's full
  # checkpointing at b512: 48.0 GB, 367.99 ms; none: ~106 GB); the new partition compiles cold
  chain_s60g
  step bench_train_large_b512_budget 380 large_at 512 train_gem-large_b512_budget035_s61a \
    --set activation_memory_budget=0.35
}
chain_s61b() {  # session 58, after s61a (b512 at budget 0.35: 350.23 ms, 65.0 GB): budget 0.5 (~72 GB predicted)
  step bench_train_large_b512_budget05 380 large_at 512 train_gem-large_b512_budget05_s61b \
    --set activation_memory_budget=0.5
}
chain_s61c() {  # session 58: s61a's b512 budget 0.35 ran JFA's forward twice a step (the partitioner took our custom
  # ops for free to recompute); with them ranked by their FLOP formulas, 0.35 again and then 0.45 (0.5: out of
  # memory)
  chain_s61d
  chain_s61e
}
chain_s61d() {  # s61c's first half, for a call with less device time (caps for a cold compile cache: session 59)
  step bench_train_large_b512_budget035 280 large_at 512 train_gem-large_b512_budget035_s61c \
    --set activation_memory_budget=0.35
}
chain_s61e() {  # s61c's second half
  step bench_train_large_b512_budget045 240 large_at 512 train_gem-large_b512_budget045_s61c \
    --set activation_memory_budget=0.45
}
chain_s62a() {  # session 59: gem-large b256 plain, then with weight_shadows + shadow_adamw (AdamW reads the shadows'
  # bf16 gradients and writes the shadows: 28 B a parameter a step instead of 40), one call, caps for a cold cache
  step bench_train_large_b256 250 large_at 256 train_gem-large_b256_s62a_plain
  step bench_train_large_b256_shadow_adamw 250 large_at 256 train_gem-large_b256_s62a_shadow_adamw \
    --set weight_shadows=true --set shadow_adamw=true
}
chain_s62b() {  # session 59: the shadow AdamW's GPU tests (the kernel against fused AdamW; a compiled gem-small
  # learner against weight_shadows alone), then its benchmark at gem-large's Linear parameters
  step tests_shadow_adamw 240 tests tests/gpu/test_adamw_gpu.py tests/gpu/test_weight_shadows_gpu.py
  step optimizer_large 120 python -m benchmarks.optimizer --preset gem-large
}
chain_s62c() {  # session 59, when starts are scarce: s62a's A/B, then the kernel's GPU tests and its benchmark (what
  # the call's 600 s cut off still comes back in results.tgz, written after each step)
  chain_s62a
  adamw_checks
}
chain_s62d() {  # session 59, after s62c (its plain run paced by the host: 59.6 ms of GPU idle a step): the kernel's
  # fp64 bias corrections and 8-block programs tested and benchmarked, then plain / shadow AdamW / plain b256 on one
  # machine (ABA: a drifting host lands on both sides), the compile cache carried from s62c
  step tests_adamw 60 tests tests/gpu/test_adamw_gpu.py
  step bench_train_large_b256_a1 170 large_at 256 train_gem-large_b256_s62d_plain_a1
  step bench_train_large_b256_shadow_adamw 170 large_at 256 train_gem-large_b256_s62d_shadow_adamw \
    --set weight_shadows=true --set shadow_adamw=true
  step bench_train_large_b256_a2 170 large_at 256 train_gem-large_b256_s62d_plain_a2
  step optimizer_large 100 python -m benchmarks.optimizer --preset gem-large
}
chain_s62e() {  # session 59, after s62b passes: gem-small b2048 (bf16 stream) plain / shadow AdamW / plain on one
  # machine (ABA), the step where launches and parameter bytes weigh more than in gem-large's (the default's question)
  step bench_train_small_a1 230 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s62e_plain_a1.json"
  step bench_train_small_shadow_adamw 230 small_train --set gem.sequence_dtype=compute --set weight_shadows=true \
    --set shadow_adamw=true --out "$out/results/train_gem-small_b2048_s62e_shadow_adamw.json"
  step bench_train_small_a2 120 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s62e_plain_a2.json"
}
chain_s63a() {  # session 60: s62b's GPU tests (without the optimizer benchmark, measured in session 59's calls 8
  # and 9), then s62e's gem-small ABA
  step tests_shadow_adamw 240 tests tests/gpu/test_adamw_gpu.py tests/gpu/test_weight_shadows_gpu.py
  chain_s62e
}
chain_s63b() {  # session 60: weight_shadows + shadow_adamw on by default for bf16 in one process on a GPU: the GPU
  # tests that build default learners, then gem-large b256 as it now runs by default and plain after it (AB, the
  # tests first: the machine's first process was host-paced in session 59)
  step tests_default_shadows 300 tests tests/gpu/test_weight_shadows_gpu.py tests/gpu/test_step_sync_gpu.py \
    tests/gpu/test_flops_gpu.py
  step bench_train_large_b256_default 200 large_at 256 train_gem-large_b256_s63b_default
  step bench_train_large_b256_plain 200 large_at 256 train_gem-large_b256_s63b_plain --set weight_shadows=false
}
chain_s63c() {  # session 60: call 3's host ran 10 us a launch and paced the default step (183.79 ms against 136 of
  # kernels; plain 220.96): Inductor's combo kernels (independent small kernels launched as one) on gem-large b256 by
  # default, then the default alone; the variant first, so a fresh machine's slow first process counts against it
  step bench_train_large_b256_combo 300 python -m benchmarks.diag.with_inductor_config combo_kernels=True -- bench \
    train --preset gem-large --batch-size 256 --compile --steps 12 --warmup 6 --num-workers 12 \
    --set gem.sequence_dtype=compute --out "$out/results/train_gem-large_b256_s63c_combo.json"
  step bench_train_large_b256_default 150 large_at 256 train_gem-large_b256_s63c_default
}
chain_s63d() {  # session 60: FP8 MLPs beside the default shadows (never run together on a GPU before the default)
  step tests_fp8_default_shadows 200 tests tests/gpu/test_weight_shadows_gpu.py -k fp8
}
chain_s64a() {  # after sessions 60-61 (no device time was left for their last CPU changes): the ops' one backend
  # switch (opengem.ops.backend), linear_forward's branch order and the shadow AdamW's bf16 moments on a GPU. The
  # weight-shadow file compiles 9 gem-small learners, two with FP8 MLPs (session 60: 128 s for one FP8 test), so the
  # tests take the call; gem-large by default runs in s64c
  step tests_backend_switch_bf16_moments 540 tests tests/gpu/test_adamw_gpu.py tests/gpu/test_weight_shadows_gpu.py \
    tests/gpu/test_embedding_gpu.py
}
between_large_defaults() {  # between_large_defaults TAG NAME SECONDS COMMAND...: the step NAME between two runs of
  # gem-large b256's default, train_gem-large_b256_TAG_default_a1 / _a2 (A/B/A on one host: a same-call ratio)
  local tag=$1; shift
  step bench_train_large_b256_default_a1 150 large_at 256 "train_gem-large_b256_${tag}_default_a1"
  step "$@"
  step bench_train_large_b256_default_a2 150 large_at 256 "train_gem-large_b256_${tag}_default_a2"
}
chain_s64c() {  # after session 61: the shadow AdamW with bf16 moments (shadow_adamw_moments=bf16; its GPU tests are
  # in s64a's files): the optimizer alone (20 against 28 B a parameter), then gem-large b256 default / bf16 moments /
  # default on one host (ABA; the same compiled graphs: the optimizer is not compiled)
  step optimizer_large 100 python -m benchmarks.optimizer --preset gem-large
  between_large_defaults s64c bench_train_large_b256_bf16_moments 150 large_at 256 \
    train_gem-large_b256_s64c_bf16_moments --set shadow_adamw_moments=bf16
}
# bf16 AdamW moments and bf16 tables (session 62: together they fit gem-large b384 on an H100, 27.80%)
NARROW_STATE=(--set shadow_adamw_moments=bf16 --set gem.embedding_dtype=bf16)
chain_s64f() {  # after session 61: what bf16 moments (4.45 GB) and bf16 tables (10.8 GB) free buys: gem-large at
  # b384 (b256 by default peaks at 68.7 GB: ~39 GB of tables and dense state, ~0.114 GB a sample of activations)
  # beside b256 with the same settings, one host (run after s64c on its machine: s64c's b256 runs are the default)
  step bench_train_large_b256_narrow 150 large_at 256 train_gem-large_b256_s64f_narrow \
    "${NARROW_STATE[@]}"
  step bench_train_large_b384_narrow 240 large_at 384 train_gem-large_b384_s64f_narrow \
    "${NARROW_STATE[@]}"
}
resumable_curve() {  # resumable_curve LABEL [ARGS]: issue 6's 2000 gem-small steps as LABEL, checkpointed in
  # runs/curve_LABEL
  local label=$1; shift
  untuned_curve --variant none --label "$label" --checkpoint-dir "runs/curve_$label" "$@"
}
curve_part1_within() {  # curve_part1_within SECONDS LABEL [--set ...]: the curve until SECONDS have passed (setup
  # included), then its checkpoint
  local seconds=$1 label=$2; shift 2
  step "lp_curve_${label}_part1" $((seconds + 140)) resumable_curve "$label" "$@" --stop-after "$seconds"
}
curve_first_part() { curve_part1_within 420 "$@"; }  # curve_first_part LABEL [--set ...]: a whole call's worth
curve_rest_against_repeat() {  # curve_rest_against_repeat LABEL [--set ...], on the first part's machine (its runs/
  # folder): the rest, then the final NE against session 20's BF16 repeat
  local label=$1; shift
  step "lp_curve_${label}_part2" 500 resumable_curve "$label" "$@" --resume
  step "lp_curves_${label}_vs_repeat" 30 untuned_curve --compare --variant none --label "$label" \
    --baseline bf16_repeat --bar 0.003
}
chain_s64d() { curve_first_part bf16_moments --set shadow_adamw_moments=bf16; }  # the shadow AdamW's bf16 moments
chain_s64e() { curve_rest_against_repeat bf16_moments --set shadow_adamw_moments=bf16; }
gpu_idle_ms() {  # gpu_idle_ms RESULT.json: a bench train run's timed GPU idle a step (0 when it cannot be read)
  local ms
  ms=$(python -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["results"]["gpu_idle_ms_timed"] or 0))' \
    "$1" 2> /dev/null)
  [[ "$ms" =~ ^[0-9]+$ ]] && echo "$ms" || echo 0
}
chain_s64b() {  # after session 60 (waiting list item 2): gem-large b256 by default; if its host paced it (over 30 ms
  # of GPU idle a step, as session 60's call 3 at 62.9), combo kernels and the default again (ABA on that host)
  step bench_train_large_b256_default_a1 150 large_at 256 train_gem-large_b256_s64b_default_a1
  if [ "$(gpu_idle_ms "$out/results/train_gem-large_b256_s64b_default_a1.json")" -gt 30 ]; then
    step bench_train_large_b256_combo 300 large_with_inductor combo_kernels=True 256 train_gem-large_b256_s64b_combo
    step bench_train_large_b256_default_a2 150 large_at 256 train_gem-large_b256_s64b_default_a2
  else
    echo "the default idled the GPU at most 30 ms a step: a GPU-paced host, the A/B left for a slow one" \
      > "$out/logs/s64b_ab_skipped.log"
  fi
}
large_expandable_at() {  # large_at with the caching allocator growing segments (b384 fragmented without it, s64f)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True large_at "$@"
}
chain_s65a() {  # session 62: s64f's b384 with bf16 moments and tables ran out of memory on fragmentation (67.1 GB
  # allocated, 11.0 GB reserved and unallocated) while s64c's host paced the default (48-83 ms of GPU idle a step).
  # The default first (is this host slow?), then b256 and b384 with both narrowings and expandable segments (one host)
  step bench_train_large_b256_default 150 large_at 256 train_gem-large_b256_s65a_default
  step bench_train_large_b256_narrow_expandable 150 large_expandable_at 256 \
    train_gem-large_b256_s65a_narrow_expandable "${NARROW_STATE[@]}"
  step bench_train_large_b384_narrow_expandable 240 large_expandable_at 384 \
    train_gem-large_b384_s65a_narrow_expandable "${NARROW_STATE[@]}"
}
adamw_checks() {  # the shadow AdamW's GPU tests and the optimizer alone (~45 s, session 63's call 9)
  step tests_adamw 90 tests tests/gpu/test_adamw_gpu.py
  step optimizer_large 100 python -m benchmarks.optimizer --preset gem-large
}
adamw_launch_shapes() {  # the kernel's launch shapes for both moment dtypes (116 s in session 63's call 9)
  step adamw_launch_configs 240 python -m benchmarks.diag.adamw_launch_configs --preset gem-large
}
chain_s65b() {  # session 62: the bf16 moments drew two hashes an element and streamed at 70.5% of a copy (10.51 ms
  # against fp32 moments' 11.30, s64c); now one hash gives both moments' bits. Its GPU tests, the optimizer, then the
  # kernel's launch shapes (block, blocks a program, warps) for both moment dtypes
  adamw_checks
  adamw_launch_shapes
}
chain_s65c() {  # session 62: s65b's shapes were timed with the shipped constants over other shapes' work items (the
  # module's constants restored before the timing); each update now sets its shape. Since s65b the kernel also
  # vectorizes (16-byte accesses where every address is aligned; it had taken one access an element, 252-255
  # registers under Triton 3.6): its GPU tests (a misaligned case added), the optimizer, then the shapes
  adamw_checks
  adamw_launch_shapes
}
# the NE run of bf16 moments and bf16 tables together (NARROW_STATE), one run for both before either becomes a default
chain_s65d() { curve_first_part narrow_state "${NARROW_STATE[@]}"; }
chain_s65e() { curve_rest_against_repeat narrow_state "${NARROW_STATE[@]}"; }
chain_s66a() {  # session 63 (its starts refused until too little was left): s65c and s65d in one call, one warm
  # handover fewer. The AdamW checks at the launch shape adopted in session 63 (2048 x 4 x 16 warps; its sweep took
  # 116 s in call 9 and is left out), then the narrow state's NE curve for 330 s (s65d gave it 420)
  adamw_checks
  curve_part1_within 330 narrow_state "${NARROW_STATE[@]}"
}
chain_s66d() { adamw_checks; }  # session 63's last device seconds: the AdamW tests and optimizer at the new shape
chain_s66b() { chain_s65e; }  # on s66a's machine: the curve's rest and its NE against the BF16 repeat
chain_s66c() {  # after session 63: Inductor's coordinate-descent tuning of its generated kernels (block sizes and
  # warps benchmarked at compile time), never tried here, on gem-large b256's element-wise work (28.5 ms a step: layer
  # norms and their backward, GELU, casts), between two runs of the default (A/B/A on one host). Its caps add up past
  # a call's 600 s and the cold tuned compile outlasted 270 s (s67a): s68a / s68b replace it
  between_large_defaults s66c bench_train_large_b256_coordinate_descent 360 large_with_inductor \
    coordinate_descent_tuning=True 256 train_gem-large_b256_s66c_coordinate_descent
}
chain_s67a() {  # session 64 (984 s lost to refused starts, too little left for the NE pair): the AdamW checks at the
  # shipped launch shape, then s66c's A/B/A with the tuned run capped so the call stays under 600 s
  adamw_checks
  between_large_defaults s67a bench_train_large_b256_coordinate_descent 270 large_with_inductor \
    coordinate_descent_tuning=True 256 train_gem-large_b256_s67a_coordinate_descent
}
chain_s68a() {  # session 64: s67a's coordinate-descent run was cut at 270 s, still compiling and tuning (cold). The
  # tuned run alone with the call's time, so its tuned configs land in the compile cache (they are cached beside the
  # kernels) for s68b's A/B/A on the same machine, or on a fresh one carrying the returned cache
  step bench_train_large_b256_coordinate_descent 560 large_with_inductor coordinate_descent_tuning=True 256 \
    train_gem-large_b256_s68a_coordinate_descent
}
chain_s68b() {  # after s68a: the default, the tuned run from the warm cache, the default (A/B/A on one host)
  between_large_defaults s68b bench_train_large_b256_coordinate_descent 220 large_with_inductor \
    coordinate_descent_tuning=True 256 train_gem-large_b256_s68b_coordinate_descent
}
chain_s68c() {  # session 65: s68a's machine with ~300 s left: the default b256 after the tuned run (same host, next call)
  step bench_train_large_b256_default_a1 150 large_at 256 train_gem-large_b256_s68c_default
}
# session 65: the narrow state passed the 0.3% bar against session 20's BF16 repeat (+0.20% / +0.22%), but that
# baseline predates the default shadows and shadow AdamW, and the gap is above the repeat's own spread (0.07% / 0.13%).
# Today's default over the same 2000 steps gives the clean A/B (only the narrow state differs) and the shadows' own
# drift from the repeat, on one warm machine across two calls
chain_s69a() { curve_part1_within 420 shadow_default; }
chain_s69b() {
  curve_rest_against_repeat shadow_default
  step lp_curves_narrow_state_vs_shadow_default 30 untuned_curve --compare --variant none --label narrow_state \
    --baseline shadow_default --bar 0.003
}
chain_s70a() {  # session 66: session 65's bad-input checks in the ops (attention scalars, the embedding's table
  # sizes, scaled_gemm's scales) had run on the CPU only: the GPU tests of those ops, and offsets given as a strided
  # view (validate_offsets accepts them; the kernels read offsets through a bare pointer)
  step offsets_and_op_gpu_tests 280 tests tests/gpu/test_offsets_layout_gpu.py tests/gpu/test_gdpa_gpu.py \
    tests/gpu/test_embedding_gpu.py tests/gpu/test_low_precision_gpu.py
}
chain_s70b() {  # session 66: s70a's strided-offsets test found NaN and ~1e34 values in the rows of the last, longest
  # (255-row) sample of a non-causal SiLU GDPA self-attention with contiguous offsets (pre_scale 1, D 128, bf16,
  # tuning off); the interpreter gives the reference. Which cases and which loads (TMA, pointer) go wrong
  step gdpa_tail_rows_default 120 python -m benchmarks.diag.gdpa_tail_rows \
    --out "$out/results/gdpa_tail_rows_default.json"
  step gdpa_tail_rows_pointer 120 env OPENGEM_GDPA_TMA=none python -m benchmarks.diag.gdpa_tail_rows \
    --out "$out/results/gdpa_tail_rows_pointer.json"
  step gdpa_longest_last_tests 120 tests tests/gpu/test_gdpa_gpu.py -k "longest_sample_last or strided_offsets" \
    tests/gpu/test_offsets_layout_gpu.py
  # session 66's CPU changes on the GPU: ShadowAdamW's per-step settings check
  step shadow_adamw_tests 180 tests tests/gpu/test_adamw_gpu.py tests/gpu/test_weight_shadows_gpu.py
}
# session 66: three runs that keep fp32 state span 0.31% in conversion NE at step 2000, so one run a setting cannot
# settle the narrow state's 0.2-0.3%: seeds 1 and 2 of today's default and of the narrow state, paired (the seed also
# draws the synthetic data, so each pair shares its held-out set). One warm machine, the calls back to back; copy each
# call's low_precision_curve_*.json into benchmarks/results before the next (a later call's compare reads them there)
curve_rest() {  # curve_rest LABEL [--set ...], on the first part's machine: the curve to its end
  local label=$1; shift
  step "lp_curve_${label}_part2" 500 resumable_curve "$label" "$@" --resume
}
seed_pair_first() { curve_part1_within 420 "shadow_default_seed$1" --set "seed=$1"; }  # seed_pair_first SEED
seed_pair_middle() {  # seed_pair_middle SEED: the default's rest, then the narrow state's first part
  curve_rest "shadow_default_seed$1" --set "seed=$1"
  curve_part1_within 240 "narrow_state_seed$1" --set "seed=$1" "${NARROW_STATE[@]}"
}
seed_pair_last() {  # seed_pair_last SEED: the narrow state's rest, then its NE against the default of the same seed
  curve_rest "narrow_state_seed$1" --set "seed=$1" "${NARROW_STATE[@]}"
  step "lp_curves_narrow_state_seed${1}_vs_default" 30 untuned_curve --compare --variant none \
    --label "narrow_state_seed$1" --baseline "shadow_default_seed$1" --bar 0.003
}
chain_s71a() { seed_pair_first 1; }
chain_s71b() { seed_pair_middle 1; }
chain_s71c() { seed_pair_last 1; }
chain_s72a() { seed_pair_first 2; }
chain_s72b() { seed_pair_middle 2; }
chain_s72c() { seed_pair_last 2; }
chain_s65f() {  # session 62 (waiting list item 3): gem-large b384 with bf16 moments, bf16 tables and expandable
  # segments between two runs of the b256 default on one host (A/B/A): a same-call ratio (call 5 ran the default first
  # on a fresh machine, once)
  between_large_defaults s65f bench_train_large_b384_narrow_expandable 200 large_expandable_at 384 \
    train_gem-large_b384_s65f_narrow_expandable "${NARROW_STATE[@]}"
}
chain_s62f() { adamw_checks; }  # session 59's last device seconds: the mended shadow AdamW kernel's tests, benchmark
chain_s58e() {  # session 53 (waiting list): the cached launcher on a slow host with 16 ABBA rounds (call 7, 8 rounds:
  # 0.948 by the median, 0.989 by the mean, the host drifting 151-211 ms); run it where host_speed reads > 8 us a launch
  step launch_ab_large_16 260 python -m benchmarks.diag.launch_ab --preset gem-large --batch-size 256 --steps 4 \
    --rounds 16 --out "$out/results/launch_ab_gem-large_b256_s58e_16.json"
}
chain_s58d() {  # session 53: does the loader beside the step slow gem-large b256? staged against streamed batches
  # in one process, ABBA (s58c: 141.0 ms a step staged, the kernels' time; bench train 150-210 ms), then with a
  # shorter GIL hand-off (the pin-memory thread shares the launching thread's interpreter), then with 4 workers
  step loader_ab 200 python -m benchmarks.diag.loader_ab --preset gem-large --batch-size 256 --steps 4 --rounds 6 \
    --out "$out/results/loader_ab_gem-large_b256_s58d.json"
  step loader_ab_switch 200 python -m benchmarks.diag.loader_ab --preset gem-large --batch-size 256 --steps 4 \
    --rounds 6 --switch-interval-ms 0.5 --out "$out/results/loader_ab_gem-large_b256_s58d_switch05.json"
  step loader_ab_w4 200 python -m benchmarks.diag.loader_ab --preset gem-large --batch-size 256 --steps 4 \
    --rounds 6 --num-workers 4 --out "$out/results/loader_ab_gem-large_b256_s58d_w4.json"
}
chain_s58c() {  # session 53: cached launcher against Triton's path in one process, ABBA rounds on staged batches
  # (s58b's two processes: 210.9 cached against 175.1 ms, the host's pace drifting between them)
  step launch_ab_large 220 python -m benchmarks.diag.launch_ab --preset gem-large --batch-size 256 --steps 4 \
    --rounds 8 --out "$out/results/launch_ab_gem-large_b256_s58c.json"
  step launch_ab_small 200 python -m benchmarks.diag.launch_ab --preset gem-small --batch-size 2048 --steps 4 \
    --rounds 8 --out "$out/results/launch_ab_gem-small_b2048_s58c.json"
}
chain_s58a() {  # session 53: the cached Triton launcher (GDPA's kernels): GPU tests, then each op call's host time
  # with the queue drained, no cProfile, cached launches and Triton's own path (s56g: 14.8 of 51 ms a step profiled)
  step launcher_gpu_tests 240 tests tests/gpu/test_gdpa_gpu.py tests/ops/test_launcher.py
  step op_host_time_cached 170 python -m benchmarks.diag.op_host_time --preset gem-large --batch-size 256 --steps 3 \
    --no-profile --out "$out/results/op_host_time_gem-large_b256_s58a_cached.json"
  step op_host_time_triton 170 env OPENGEM_TRITON_LAUNCH=triton python -m benchmarks.diag.op_host_time \
    --preset gem-large --batch-size 256 --steps 3 --no-profile \
    --out "$out/results/op_host_time_gem-large_b256_s58a_triton.json"
}
chain_s58b() {  # session 53: gem-large b256 under bench train, Triton's launch path first, then the cached launcher
  step bench_train_large_b256_triton 200 env OPENGEM_TRITON_LAUNCH=triton \
    bash -c 'large_at 256 train_gem-large_b256_s58b_triton'
  step bench_train_large_b256_cached 200 large_at 256 train_gem-large_b256_s58b_cached
}
chain_s56g() {  # session 51: each opengem op call's own host time in gem-large b256's compiled step (queue drained
  # before each call, no stack-recording profiler), and the Python functions inside them (s56f: 1.7-1.9 ms of self CPU
  # a backward call under the profiler)
  step op_host_time 240 python -m benchmarks.diag.op_host_time --preset gem-large --batch-size 256 --steps 2 \
    --out "$out/results/op_host_time_gem-large_b256_s56g.json"
}
chain_s56f() {  # session 51: where gem-large b256's host time goes (it idles the GPU 17-34 ms a step on H100 hosts):
  # launch_sources' kernels by caller and self CPU by op and Python function, one process
  step launch_sources 240 python -m benchmarks.diag.launch_sources --preset gem-large --batch-size 256 --steps 2 \
    --out "$out/results/launch_sources_gem-large_b256_s56f.json"
}
chain_s56e() {  # session 51: s56d on another machine: does the step follow the host probe across machines?
  step bench_train_small 200 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s56e.json"
  step bench_train_large_b256 160 large_at 256 train_gem-large_b256_s56e
}
chain_s56d() {  # session 51: issue 10's two presets on one H100 with the host's speed recorded (s56a's machine:
  # gem-large b256 149.5-151.6 ms; gem-small b2048 session 49: 15.5%)
  step bench_train_small 200 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s56d.json"
  step bench_train_large_b256 160 large_at 256 train_gem-large_b256_s56d
}
chain_s56c() {  # session 51: gem-large b512 BF16 on an H200 (~106 GB peak; session 41: 30.93%), as s51a, now with
  # the host's speed in the result; then b256 on the same machine
  step bench_train_large 300 large_b512 train_gem-large_b512_s56c_bf16
  step bench_train_large_b256 160 large_at 256 train_gem-large_b256_s56c
}
chain_s56a() {  # session 51: which cache slows the next process. The slow second runs of session 50 (s55c, s55d)
  # followed a different workload on the machine; a second b256 on a pristine copy of the carry was normal (s55e).
  # b256 first, the NCCL GPU tests (s55d's first process) on the same caches, then b256 on those caches as written and
  # on a copy repacked without Triton's IR files (*.llir, *.ttgir, *.ttir, *.ptx, *.source), as the carry packs them
  unpacked_cache cache_first
  step large_b256_first 160 with_cache "$PWD/cache_first" large_at 256 train_gem-large_b256_s56a_first
  step train_distributed_tests 120 with_cache "$PWD/cache_first" tests tests/gpu/test_train_distributed_gpu.py
  rm -rf cache_repacked && mkdir -p cache_repacked
  tar cf - -C cache_first --exclude='*.llir' --exclude='*.ttgir' --exclude='*.ttir' --exclude='*.ptx' \
    --exclude='*.source' . | tar xf - -C cache_repacked
  step large_b256_written 150 with_cache "$PWD/cache_first" large_at 256 train_gem-large_b256_s56a_written
  step large_b256_repacked 150 with_cache "$PWD/cache_repacked" large_at 256 train_gem-large_b256_s56a_repacked
}
chain_s55e() {  # session 50: the machine's second process ran gem-large b256 host-paced in s55c and s55d (74-76 ms of
  # GPU idle a step, kernels unchanged, nothing busy at its start). A first run, then a second one on a pristine copy
  # of the carried compile cache: if the second is normal, what the first run wrote to the caches slows the next
  # process
  unpacked_cache pristine_cache
  step large_b256_first 160 with_cache "$PWD/.compile_cache" large_at 256 train_gem-large_b256_s55e_first
  step large_b256_pristine 160 with_cache "$PWD/pristine_cache" large_at 256 train_gem-large_b256_s55e_pristine
}
chain_s55d() {  # session 50: the NCCL train-and-resume GPU tests (the held-out predictions' new in_sample_order), then
  # gem-large b256 as the machine's second process, with what else is busy logged (s55c's second run: 76 ms idle)
  step train_distributed_tests 200 tests tests/gpu/test_train_distributed_gpu.py
  step bench_train_large_b256 200 large_at 256 train_gem-large_b256_s55d
}
chain_s55c() {  # session 50: gem-large b512 on one H100 with activation checkpointing (b512 needs ~106 GB without;
  # recompute counts zero useful FLOPs), then b256 without it on the same machine (s55b: 169.05 ms, 22.7%)
  step bench_train_large_b512_ac 330 large_at 512 train_gem-large_b512_ac_s55c --set activation_checkpointing=true
  step bench_train_large_b256 200 large_at 256 train_gem-large_b256_s55c
}
chain_s55b() {  # session 50: issue 10's gem-large on its acceptance device (one H100) at batches that fit (b512 needs
  # ~106 GB and has waited for an H200 since session 41): bf16 sequence stream, as large_b512
  local batch
  for batch in 256 320; do
    step "bench_train_large_b$batch" 270 large_at "$batch" "train_gem-large_b${batch}_s55b"
  done
}
chain_s55a() {  # session 50: which op and source line launch gem-small's 2,705 kernels a step (402 memsets, 154
  # fp32 sums, ~120 eager copies in s53c), then s54a's host cProfile of the same step
  step launch_sources 220 python -m benchmarks.diag.launch_sources --preset gem-small --batch-size 2048 --steps 2 \
    --out "$out/results/launch_sources_gem-small_b2048.json"
  step step_profile_host 300 python -m benchmarks.step_profile --steps 20 --out "$out/results" \
    --runs gem-small:2048:bf16:compile:fresh:host:set=gem.sequence_dtype=compute
}
chain_s54a() {  # session 49's waiting list: where the host time of gem-small's compiled step goes (cProfile of three
  # steps, kernels, syncs), bf16 sequence stream as issue 10's runs; on a host that paces the step this is its cost
  step step_profile_host 420 python -m benchmarks.step_profile --steps 20 --out "$out/results" \
    --runs gem-small:2048:bf16:compile:fresh:host:set=gem.sequence_dtype=compute
}
chain_s53f() {  # session 49: issue 10's FP8 MLPs against BF16 on gem-small b2048 (bf16 stream) on the H100, one call
  # (sessions 22-23 measured it on an H200 only: 0.994x); FP8 first, its compile cold
  step bench_train_small_fp8 250 small_train_fp8_inductor --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s53f_fp8.json"
  step bench_train_small_bf16 115 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s53f_bf16.json"
}
chain_s53e() {  # session 49: the GPU tests of the second audit's fixes (NCCL world size 1: the launch-environment
  # checks, DCP checksums, ParallelConfig when made; the expert collectives' layout checksum; bench's up-front checks)
  step parallel_distributed_tests 330 tests tests/gpu/test_parallel_gpu.py tests/gpu/test_train_distributed_gpu.py \
    tests/gpu/test_sparse_gpu.py tests/gpu/test_multi_gpu_gpu.py
  step flops_calibrate_tests 220 tests tests/gpu/test_flops_gpu.py tests/gpu/test_calibrate_gpu.py
}
small_train_at() {  # small_train_at TREE NAME: small_train (bf16 stream) on the opengem sources under ab_src/TREE/src
  # (git-ignored; made by `git archive COMMIT src/opengem | tar -x -C ab_src/TREE` and carried: old 7f92603,
  # mid f2daa51)
  local tree=$1 name=$2
  PYTHONPATH=ab_src/$tree/src:. small_train --set gem.sequence_dtype=compute --out "$out/results/$name.json"
}
chain_s53c() {  # session 49: gem-small b2048 (bf16 stream) ran 191.67 ms in s53b with 60 ms of GPU idle a step (session
  # 41: 141.59 ms, 3 ms idle): HEAD, then session 41's sources (7f92603) on the same machine
  step bench_train_small_head 200 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s53c_head.json"
  step bench_train_small_7f92603 330 small_train_at old train_gem-small_b2048_s53c_7f92603
}
chain_s53d() {  # session 49: the same, session 47's last sources (f2daa51: after the tile-order changes, before the
  # bad-input checks), then HEAD again
  step bench_train_small_f2daa51 300 small_train_at mid train_gem-small_b2048_s53d_f2daa51
  step bench_train_small_head 200 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s53d_head.json"
}
chain_s53a() {  # session 49: the block-attention GPU tests session 48's call 11 did not reach, and the step-sync, GEM
  # and data GPU tests under the batch's history-length check (host copies only: still no device sync)
  step block_attention_tests 300 tests tests/gpu/test_block_attention_gpu.py
  step sync_gem_data_tests 240 tests tests/gpu/test_step_sync_gpu.py tests/gpu/test_gem_gpu.py \
    tests/gpu/test_data_gpu.py
}
chain_s53b() {  # session 49: gem-small b2048 with the bf16 sequence stream, as session 41's s42b (15.21% E2E MFU),
  # after sessions 42-49's changes (tile order, the bad-input checks' host work in the step)
  step bench_train_small_bf16_stream 540 small_train --set gem.sequence_dtype=compute \
    --out "$out/results/train_gem-small_b2048_s53b_bf16_stream.json"
}
chain_s52f() {  # session 48: the GPU tests of the later checks (FP8 GEMM operands and bias, LowPrecisionLinear's
  # input, SequentialRecommender's offsets, block_attention_from_hidden, GDPA's argument types)
  step lp_hstu_block_tests 240 tests tests/gpu/test_low_precision_gpu.py tests/gpu/test_hstu_gpu.py \
    tests/gpu/test_block_attention_gpu.py
}
chain_s52e() {  # session 48: the two weakest (a) rows with JFA alone too: each kernel at the clock its own power
  # draw sets, against both at one clock (call by call)
  clock_log start
  step gdpa_power_window_alone 240 python -m benchmarks.diag.gdpa_power_window \
    --workloads "a self L=1024 s=1.0,a self L=2048 s=1.0" --seconds 2 --rest 3 --out "$out/results"
  clock_log stop
}
chain_s52d() {  # session 48: the GPU tests of what the bad-input checks touched (embedding_lookup's offsets and id
  # checks, LookupLayout, GEM's config and batch checks, Parquet passes) and that the GEM step still runs without a sync
  step embedding_data_sparse_tests 180 tests tests/gpu/test_embedding_gpu.py tests/gpu/test_data_gpu.py \
    tests/gpu/test_sparse_gpu.py
  step sync_gem_tests 240 tests tests/gpu/test_step_sync_gpu.py tests/gpu/test_gem_gpu.py
}
chain_s52c() {  # session 48: the power window on all eight (a) rows (forward x JFA interleaved call by call, sustained)
  # and (b) K/V 256 again, now with the sustained mean
  clock_log start
  step gdpa_power_window_a 420 python -m benchmarks.diag.gdpa_power_window \
    --workloads "a self,b cross Q<=2048 KV=256" --seconds 2 --rest 3 --out "$out/results"
  clock_log stop
}
chain_s52b() {  # session 48: GDPA's forward from rested to sustained (4 s windows after 5 s idle), (b) K/V 256 alone
  # and (a) L2048 s1.0 interleaved with JFA call by call, the SM clock logged
  clock_log start
  step gdpa_power_window 240 python -m benchmarks.diag.gdpa_power_window --out "$out/results"
  clock_log stop
}
chain_s52a() {  # session 48: (b) with the compiled padded peer and (a) L2048 s1.0 against JFA, the SM clock logged:
  # the two bars that sit inside the power cap's spread (K/V 256 forward 400 TFLOP/s; forward 1.1x JFA)
  clock_log start
  step gdpa_b 240 python -m benchmarks.gdpa --workloads "b cross" --peers padded-compiled
  mv benchmarks/results/gdpa.json "$out/results/gdpa_s52a_b.json"  # the next step rewrites gdpa.json
  step gdpa_a_l2048 200 python -m benchmarks.gdpa --workloads "a self L=2048 s=1.0" --peers jfa
  clock_log stop
}
chain_s51a() {  # session 47: gem-large b512 once under the GDPA defaults of session 46 (needs an H200: ~106 GB peak)
  step bench_train_large 420 large_b512 train_gem-large_b512_s51a_bf16
}
chain_s51b() {  # session 47: GDPA's GPU tests under the keys order's tie-break (the sample's rows, longest first)
  step gdpa_gpu_tests 200 tests tests/gpu/test_gdpa_gpu.py tests/gpu/test_gdpa_gluon_gpu.py
}
chain_s34a() {  # session 31: gem-large twice in one call; idle now from the timed laps of the profiled batches
  step bench_train_large 250 large_b512 train_gem-large_b512_s34a1_bf16
  step bench_train_large_again 200 large_b512 train_gem-large_b512_s34a2_bf16
  step flops_gpu_tests 120 tests tests/gpu/test_flops_gpu.py -k bench_train
}
chain_6a() { step gdpa_full 580 python -m benchmarks.gdpa; }  # issue 4: every workload, compiled padded peers
chain_6b() { step block_attention_full 580 python -m benchmarks.block_attention; }  # issue 5: the power-law workload too
chain_3a() { step curve_single_fp32 580 curves_single --set precision=fp32 --out "$out/results/curve_single_fp32.json"; }
chain_3b() {
  step curve_single 200 curves_single --out "$out/results/curve_single.json"
  step max_autotune_train 300 train bench train --preset gem-small --batch-size 2048 --compile \
    --set compile_mode=max-autotune-no-cudagraphs --steps 20 --warmup 8 --num-workers 12 \
    --out "$out/results/train_gem-small_max_autotune.json"
}
chain_k() {
  step block_attention_full 250 python -m benchmarks.block_attention
  step low_precision 150 python -m benchmarks.low_precision
  step embedding 90 python -m benchmarks.embedding --quick
}
chain_plan() {
  step calibrate 200 train bench calibrate --quick --out "$out/results/calibration_quick.json"
  step predict 60 predict "$out/results/calibration_quick.json"
  step large_single 290 large_single 256 multi_gpu_single
}
chain_k2() {
  step block_attention_full 270 python -m benchmarks.block_attention
  step large_b256_phases 300 train bench train --preset gem-large --batch-size 256 --compile --steps 8 --warmup 8 \
    --out "$out/results/train_gem-large_b256.json"
}
chain_s6c() {  # session 6, call 3: every backward config alone, then BlockAttention full and its GPU tests
  step block_attention_configs 150 python -m benchmarks.diag.block_attention_configs
  step block_attention_full 270 python -m benchmarks.block_attention
  step block_attention_gpu_tests 150 tests tests/gpu/test_block_attention_gpu.py
}
chain_s6d() {  # session 6, call 4: both training harnesses, now counting kernel loads / graphs / GC while timed
  step large_single 290 large_single 256 multi_gpu_single
  step small_b2048 200 train bench train --preset gem-small --batch-size 2048 --compile --steps 10 --warmup 8 \
    --num-workers 12 --out "$out/results/train_gem-small_b2048.json"
}
chain_s6e() {  # session 6, call 5: the backward's recomputed cos/sin (4 warps), gem-large with GDPA's fix, GPU tests
  step block_attention_full 200 python -m benchmarks.block_attention
  step large_single 240 large_single 256 multi_gpu_single
  step block_attention_gpu_tests 120 tests tests/gpu/test_block_attention_gpu.py
}
chain_s7a() {  # session 7, call 1: the early dK/dV stores (issue 5), then JFA autotuned on (a), (d), L1024 s0.5 (issue 3)
  step block_attention_full 270 python -m benchmarks.block_attention
  step block_attention_gpu_tests 150 tests tests/gpu/test_block_attention_gpu.py
  step jfa_subset 200 python -m benchmarks.jfa --workloads a_,d_,b_L1024_s0.5 --no-flex
  step block_attention_configs 90 python -m benchmarks.diag.block_attention_configs
}
chain_s7b() {  # session 7, call 2: block-relative given positions and the shared inverse rotation (issue 5), JFA's configs on (b)
  step block_attention_full 230 python -m benchmarks.block_attention
  step jfa_configs 200 python -m benchmarks.diag.jfa_configs
  step block_attention_gpu_tests 150 tests tests/gpu/test_block_attention_gpu.py
  step block_attention_configs 110 python -m benchmarks.diag.block_attention_configs
}
chain_s7c() {  # session 7, call 3: BlockAttention's polynomial cos/sin configs, JFA's fused delta and short tiles, GPU tests
  step block_attention_full 280 python -m benchmarks.block_attention
  step jfa_subset 110 python -m benchmarks.jfa --workloads a_,b_L512_s0.5_causal,b_L1024_s0.5_causal,d_ --no-flex
  step block_attention_gpu_tests 180 tests tests/gpu/test_block_attention_gpu.py
}
chain_s7d() {  # session 7, call 4 (what device time was left): JFA against varlen flash on all of workload (b)
  step jfa_b_grid 180 python -m benchmarks.jfa --workloads b_ --no-flex --peers torch_varlen_flash
}
chain_s8a() {  # next session, call 1: where JFA's causal backward trails flash, then JFA full with the Flex pass
  step jfa_configs 240 python -m benchmarks.diag.jfa_configs --workloads b_L1024_s0.5_causal,b_L2048_s0.5_causal
  step jfa_full 340 python -m benchmarks.jfa
}
chain_s8b() {  # session 8, call 2: TMA loads or pointer loads, then (a) and (d) against flash, nested SDPA and Flex
  step jfa_tma 330 python -m benchmarks.diag.jfa_tma
  step jfa_a_flex 240 python -m benchmarks.jfa --workloads a_,d_ --peers torch_varlen_flash,nested_sdpa
}
chain_s8c() {  # session 8, call 3: JFA's GPU tests (TMA loads), then the full JFA benchmark, Flex on (a) and (d)
  step jfa_gpu_tests 140 tests tests/gpu/test_jagged_attention_gpu.py
  step jfa_full 420 python -m benchmarks.jfa --flex-workloads a_,d_
}
chain_s9a() {  # next session, call 1: the load paths and the sequence-owned backward beside flash, JFA's GPU tests
  step jfa_tma 320 python -m benchmarks.diag.jfa_tma --workloads b_L512_s1.0_causal,b_L1024_s1.0_causal,b_L2048_s0.5_causal
  step jfa_gpu_tests 260 tests tests/gpu/test_jagged_attention_gpu.py
}
chain_s9b() {  # next session, call 2: the full JFA benchmark (issue 3's acceptance run)
  step jfa_full 560 python -m benchmarks.jfa --flex-workloads a_,d_
}
chain_s9d() {  # session 9, call 4: JFA's GPU tests without the sequence-owned backward, GDPA's default configs
  step jfa_gpu_tests 230 tests tests/gpu/test_jagged_attention_gpu.py
  step gdpa_quick 250 python -m benchmarks.gdpa --quick
}
chain_s10a() {  # session 10, call 1: GDPA's new default configs against session 9's quick run, the GPU tests
  step gdpa_quick 90 python -m benchmarks.gdpa --quick
  step gpu_tests_gdpa_lp_embedding 260 tests tests/gpu/test_gdpa_gpu.py tests/gpu/test_low_precision_gpu.py tests/gpu/test_embedding_gpu.py
  step embedding_quick 150 python -m benchmarks.embedding --quick  # issue 8: the lookup's tuned step size
}
chain_s10b() {  # session 10, call 2: GDPA tuned over tiles and load paths on (a) L1024 and (b), JFA and compiled peers
  step gdpa_a_b 420 python -m benchmarks.gdpa --workloads "a self L=1024 s=1.0,b " --peers jfa,padded-compiled
}
chain_s10c() {  # session 10, call 2: which GDPA TMA candidates are wrong (s10a's failing tests), then part s10b
  step gdpa_candidates 170 python -m benchmarks.diag.gdpa_candidates
  step gdpa_a_b 400 python -m benchmarks.gdpa --workloads "a self L=1024 s=1.0,b " --peers jfa,padded-compiled
}
chain_s10d() {  # session 10, call 3: GDPA's workload (a) tuned (square masked tiles off TMA), JFA and padded peers
  step gdpa_a 560 python -m benchmarks.gdpa --workloads "a " --peers jfa,padded-eager,padded-compiled
}
chain_s10e() {  # session 10, call 4: the candidates at D 64 too, GDPA's GPU tests, workloads (b)-(d) with every peer
  step gdpa_candidates 120 python -m benchmarks.diag.gdpa_candidates
  step gdpa_gpu_tests 120 tests tests/gpu/test_gdpa_gpu.py
  step gdpa_bcd 330 python -m benchmarks.gdpa --workloads "b ,c ,d "
}
chain_s10f() {  # session 10, call 5: GDPA's GPU tests (BLOCK_N = D masked tiles on pointer loads, D 64 candidates), then 2b's first step
  step gdpa_gpu_tests 150 tests tests/gpu/test_gdpa_gpu.py
  step large_bf16_sequence 300 large_single 512 multi_gpu_single_b512_bf16_sequence --set gem.sequence_dtype=compute
}
chain_s9c() {  # next session: BlockAttention's rotary backward at three programs per SM (LATE_V), GPU tests
  step block_attention_full 300 python -m benchmarks.block_attention
  step block_attention_gpu_tests 260 tests tests/gpu/test_block_attention_gpu.py
}
export out
export -f tests train large_at large_expandable_at large_with_inductor host_samples_at unpacked_cache with_cache \
  small_train small_train_at small_train_fp8_inductor small_train_expandable small_train_fixed_segments untuned_curve \
  fp8_attention_curve bf16_repeat_curve bf16_seed1_curve fp8_late_bf16_curve resumable_curve multi large_single \
  large_b512 curves_single predict
case "$part" in
  1) on_gpu 0 chain_1a; on_gpu 1 chain_1b; wait ;;
  2) on_gpu 0 chain_2a; on_gpu 1 chain_2b; wait ;;
  3) on_gpu 0 chain_3a; on_gpu 1 chain_3b; wait ;;
  6) on_gpu 0 chain_6a; on_gpu 1 chain_6b; wait ;;
  4)
    step curve_fsdp 240 multi "$gpus" --curve --preset gem-small --layouts fsdp --batch-per-gpu $((1024 / gpus)) \
      --warmup 1 --steps 199 --set compile=false --out "$out/results/curve_fsdp.json"
    step curve_compare 30 python -m benchmarks.multi_gpu_curves --single "${CURVES_DIR:?the folder of part 3 curve files}/curve_single.json" \
      --single-fp32 "$CURVES_DIR/curve_single_fp32.json" --distributed "$out/results/curve_fsdp.json" \
      --out "$out/results/multi_gpu_curves.json"
    step copy_engine 300 multi "$gpus" --preset gem-large --layouts fsdp --batch-per-gpu 512 --warmup 4 --steps 8 \
      --collectives copy_engine --single-gpu-mfu "${SINGLE_GPU_MFU:?the 1-GPU E2E MFU of part 2a}" \
      --out "$out/results/multi_gpu_copy_engine.json" ;;
  5)
    step layouts 580 multi "$gpus" --preset gem-large --layouts fsdp,hsdp,expert,sparse2d,sparse1d --batch-per-gpu 512 \
      --warmup 4 --steps 8 --single-gpu-mfu "${SINGLE_GPU_MFU:?the 1-GPU E2E MFU of part 2a}" \
      --out "$out/results/multi_gpu.json" ;;
  *)  # every chain_NAME above is part NAME
    if declare -F "chain_$part" >/dev/null; then "chain_$part"; else echo "unknown part $part" >&2; exit 2; fi ;;
esac
collect_checkout_results  # a part with no steps of its own may have written there too
tar czf "$final/results.tgz" -C "$out" logs results status 2>/dev/null
# the compile cache in pieces of 13.9 MB (a returned file's limit is 16 MiB), at most 4: 55.6 MB (53 MiB) comes back
# beside results.tgz within the returned 64 MiB, and travels beside the ~8.5 MiB checkout within the carry's 64 MiB
# (session 20's cache, over 3 pieces of 15 MB, did not come back). Of each Triton kernel only what loading it needs
# comes back, its .json and .cubin (Triton 3.6's cache hit reads those; Inductor's launcher the cubin): the IR files
# (.llir, .ttgir, .ttir, .ptx, .source) were 405 of session 33's 490 MB, and that cache packs to 17.5 MB without them
# against 49.7 with them (sessions 35-36's caches, over 55.6 MB, did not come back). A tool reading a kernel's IR
# from `asm` would need TRITON_ALWAYS_COMPILE=1 on this cache (benchmarks/sass.py runs on the CPU host, its own cache).
if [ -d .compile_cache ]; then
  tar czf "$out/compile_cache.tgz" -C .compile_cache --exclude='*.llir' --exclude='*.ttgir' --exclude='*.ttir' \
    --exclude='*.ptx' --exclude='*.source' . 2>/dev/null
  split -b 13900000 -d -a 1 "$out/compile_cache.tgz" "$final/compile_cache.tgz.part"
  if [ -e "$final/compile_cache.tgz.part4" ]; then
    rm -f "$final"/compile_cache.tgz.part*
    echo "note: the compile cache is over 55.6 MB compressed: not returned" >> "$out/status"
  fi
fi
cp "$out/status" "$final/status"
rm -rf "$out"
cat "$final/status"
