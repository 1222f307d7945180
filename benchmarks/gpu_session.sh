#!/usr/bin/env bash
# One device call = one plan: run GPU tests and benchmarks, each under its own time limit,
# full logs under $OUT (or ./gpu-logs), the tail of each at the end.
#   bash benchmarks/gpu_session.sh tests kernels      # first call
#   bash benchmarks/gpu_session.sh model engine       # second call
#   bash benchmarks/gpu_session.sh engine_full        # 64 layers, all arms, transformers baseline
# To run a committed snapshot while the tree is being edited: git archive HEAD -o .snap/head.tar
# (ignored), carry .snap, and on the device extract it and run from there.
set -u
out=${OUT:-gpu-logs}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
GEN='x8192x1024@auto/row_tokens=9216'  # the 8k / 1k job of SGLang's published rows, max_running the engine's
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$out/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s" | tee -a "$out/summary.txt"
}
jobs8k() {  # jobs8k NAME SECONDS PRESET GENS: long_context's 8k / 1k jobs (no prefill table), one process
  local name=$1 secs=$2 preset=$3; shift 3
  step "$name" "$secs" python3 -m benchmarks.long_context --preset "$preset" --prefill '' --policies sdpa-cudnn:split \
    --track-intervals 8192 --gemm-reps 1 --json "$out/$name.json" --gen "$@"
}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader | tee "$out/summary.txt"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$out/summary.txt"
for part in "$@"; do
  case $part in
    tests)   step gpu_tests 200 python3 -m pytest -q --tb=short tests/kernels/test_kernels_gdn.py tests/kernels/test_kernels_gdn_decode.py tests/kernels/test_kernels_conv_norm.py \
               tests/kernels/test_kernels_replay.py tests/kernels/test_kernels_attention.py tests/models/test_model_gpu.py tests/engine/test_engine_gpu.py ;;
    kernels) step kernels 420 python3 -m benchmarks.kernels ;;
    kernels_table) step kernels_table 300 python3 -m benchmarks.kernels --no-sweep ;;
    profile) step breakdown 120 python3 -m benchmarks.profile_targets breakdown
             step ncu 240 bash benchmarks/ncu_kernels.sh "$out" ;;
    sanitize) step sanitize 150 compute-sanitizer --tool memcheck --print-limit 5 python3 -c \
               'import tests.kernels.test_kernels_gdn as t; t._check_launches_at_model_shapes([t.WY_FOUR_WARPS_MIX], repeats=1)' ;;
    engine_tests) step engine_tests 150 python3 -m pytest -q --tb=short tests/engine/test_engine_gpu.py tests/models/test_model_gpu.py ;;
    model)   step model_gpu 240 python3 -m benchmarks.model_gpu ;;
    engine)  step engine_arms 330 python3 -m benchmarks.engine_arms --quick ;;
    decode_profile) step decode_profile 200 python3 -m benchmarks.decode_profile ;;
    engine_full) step engine_full 560 python3 -m benchmarks.engine_arms --hf --json "$out/engine_full.json" ;;
    new_kernel_tests) step new_kernel_tests 80 python3 -m pytest -q --tb=short tests/kernels/test_fp8_gemm.py tests/kernels/test_attention_prefill.py tests/kernels/test_attention_prefill_backends.py ;;
    long)    step long_context 230 python3 -m benchmarks.long_context --json "$out/long_context.json" ;;
    attn8k)  step attn8k 60 python3 -m benchmarks.attention_backends --shapes 4x8192,1x32768 --backends sdpa --reps 5 ;;
    fp8)     step fp8_parity 150 python3 -m benchmarks.fp8_parity --parts parity,speed ;;
    next80b) step next80b 170 python3 -m benchmarks.fp8_parity --parts next80b ;;
    grammar) step grammar 90 python3 -m benchmarks.grammar_overhead --layers 16 ;;
    demo_parity) step demo_parity 330 python3 -m benchmarks.demo_parity --device cuda --dtype bfloat16 ;;
    grammar64) step grammar64 240 python3 -m benchmarks.grammar_overhead --layers 64 ;;
    grammar64_defaults) step grammar64_defaults 200 python3 -m benchmarks.grammar_overhead --layers 64 --arms none,json,logprobs5,logprobs5@torch ;;
    grammar64_lp) step grammar64_lp 200 env BATCHINFER_FUSED_LOGPROBS=1 python3 -m benchmarks.grammar_overhead --layers 64 --reps 2 ;;
    floor_bf16) step floor_bf16 90 python3 -m benchmarks.engine_arms --layers 16 --arms replay+extra_buffer --json "$out/floor_bf16.json" ;;
    floor_fp8) step floor_fp8 90 python3 -m benchmarks.engine_arms --layers 16 --preset qwen3.5-27b-fp8 --arms replay+extra_buffer --json "$out/floor_fp8.json" ;;
    fp8gemm) step fp8gemm_tests 60 python3 -m pytest -q --tb=short tests/kernels/test_fp8_gemm.py
             step fp8gemm 90 python3 -m benchmarks.bench_fp8_gemm --no-sweep ;;
    prefill_profile) step prefill_profile 120 bash -c "python3 -m benchmarks.prefill_profile && python3 -m benchmarks.prefill_profile --prompts 1 --length 32768" ;;
    moe35)   step moe35 240 python3 -m benchmarks.engine_arms --preset qwen3.5-35b-a3b --arms replay+extra_buffer --hf --hf-prompts 32 --hf-batch 32 --json "$out/moe35.json" ;;
    bench_moe) step bench_moe 60 python3 -m benchmarks.bench_moe --json "$out/bench_moe.json" ;;
    sampling) step sampling_tests 90 python3 -m pytest -q --tb=short tests/kernels/test_kernels_sampling.py tests/engine/test_sampler.py
              step bench_sampling 60 python3 -m benchmarks.bench_sampling ;;
    cold)    step cold_start 170 python3 -m benchmarks.cold_start --folder /tmp/cold --cold-libraries --no-load --json "$out/cold_start.json" ;;
    attn_tests) step attn_tests 120 python3 -m pytest -q -x --tb=short tests/kernels/test_kernels_attention.py tests/engine/test_engine_precompile_gpu.py ;;
    attn_prefix) step attn_prefix_tests 120 python3 -m pytest -q --tb=short tests/kernels/test_attention_prefill.py tests/kernels/test_attention_prefill_backends.py
             step attn_prefix 150 python3 -m benchmarks.attention_backends --shapes prefix1x8k+8k,prefix1x24k+8k --backends sdpa,op --reps 5 ;;
    long_split) step long_split 240 python3 -m benchmarks.long_context --prefill 8x8192,1x32768 --policies sdpa-cudnn:lower_right,sdpa-cudnn:split --track-intervals 8192 --gen '' --json "$out/long_split.json" ;;
    split_test) step split_test 90 python3 -m pytest -q -rA --tb=short tests/kernels/test_attention_prefill.py tests/kernels/test_attention_prefill_backends.py -k "gpu and (split or op_matches)" ;;
    grammar64_ab) step grammar64_ab 330 python3 -m benchmarks.grammar_overhead --layers 64 --reps 3 --arms none,json,json@16,json_unbounded,logprobs5@torch,logprobs5@fused ;;
    gen_floor) step gen_floor 120 python3 -m benchmarks.decode_floor --batch 48 --context 8704
             step gen8k 240 python3 -m benchmarks.long_context --prefill '' --policies sdpa-cudnn:split --track-intervals 8192 --gen 48x8192x1024 --json "$out/gen8k.json" ;;
    gen_batch) step gen_floor48 60 python3 -m benchmarks.decode_floor --batch 48 --context 8704
             step gen_floor96 60 python3 -m benchmarks.decode_floor --batch 96 --context 8704
             step gen_batch 430 python3 -m benchmarks.long_context --prefill '' --policies sdpa-cudnn:split --track-intervals 8192 --gen 48x8192x1024,96x8192x1024@96,104x8192x1024@104 --json "$out/gen_batch.json" ;;
    gen_default) step gen_default 400 python3 -m benchmarks.long_context --prefill '' --policies sdpa-cudnn:split --track-intervals 8192 --gen 96x8192x1024@256,192x8192x1024@96 --json "$out/gen_default.json" ;;
    fp8_64)  step fp8_64 260 python3 -m benchmarks.fp8_parity --parts speed --layers 64 ;;
    floor64_bf16) step floor64_bf16 250 python3 -m benchmarks.engine_arms --arms replay+extra_buffer --json "$out/floor64_bf16.json" ;;
    floor64_fp8) step floor64_fp8 250 python3 -m benchmarks.engine_arms --preset qwen3.5-27b-fp8 --arms replay+extra_buffer --json "$out/floor64_fp8.json" ;;
    gen96)   step gen96 200 python3 -m benchmarks.long_context --prefill '' --policies sdpa-cudnn:split --track-intervals 8192 --gen 96x8192x1024@96 --json "$out/gen96.json" ;;
    floor_check) step floor_check96 90 python3 -m benchmarks.decode_floor --batch 96 --context 8704 --check-gemms
             step floor_check256 90 python3 -m benchmarks.decode_floor --batch 256 --context 2208 --check-gemms ;;
    long_track) step long_track 240 python3 -m benchmarks.long_context --prefill 8x8192,1x32768 --track-intervals 256,8192 --json "$out/long_track.json" ;;
    # 8k in / 1k out at the engine's defaults against one setting changed (docs/BENCHMARKS.md, "Next on the GPU")
    fp8kv_tests) step fp8kv_tests 150 python3 -m pytest -q --tb=short tests/kernels/test_attention_fp8_kv.py tests/engine/test_engine_gpu.py ;;
    steps27) jobs8k steps27 560 qwen3.5-27b "96$GEN,96$GEN/max_batch_tokens=32768,96$GEN/kv_cache_dtype=fp8_e4m3" ;;
    steps35fp8) jobs8k steps35fp8 560 qwen3.5-35b-a3b-fp8 "256$GEN,256$GEN/max_batch_tokens=65536,256$GEN/kv_cache_dtype=fp8_e4m3" ;;
    steps35) jobs8k steps35 560 qwen3.5-35b-a3b "256$GEN/max_batch_tokens=8192,256$GEN" ;;
    # The prefill forward on a second stream beside the decode forward (EngineConfig.concurrent_prefill):
    # first each step pair alone, in turn and at once, then whole jobs with more rows than run at once
    # (so prefill keeps coming while rows decode), 16 of the 27B's 64 layers; the first job pays the compiles
    overlap16) step concurrent_tests 150 python3 -m pytest -q --tb=short tests/engine/test_engine_concurrent_prefill.py
             step overlap16 200 python3 -m benchmarks.step_cost --layers 16 --concurrent --tokens 512,1024,2048,4096,8192 \
               --rows 32,96 --mixed-rows 96 --reps 5 ;;
    concurrent16) step concurrent16 560 python3 -m benchmarks.long_context --layers 16 --prefill '' \
               --policies sdpa-cudnn:split --track-intervals 8192 --gemm-reps 1 --json "$out/concurrent16.json" \
               --gen "288x8192x1024@96/concurrent_prefill=1,288x8192x1024@96,288x8192x1024@96/concurrent_prefill=1,288x8192x1024@96/concurrent_prefill=1/max_batch_tokens=2048" ;;
    # The MoE layout as a counting sort (kernels/moe_align): its GPU tests, then where an FP8 MoE decode step
    # goes at 8 layers (the profile before it: argsort 0.233, index_add 0.206 ms per step of 8 layers)
    moe_layout) step moe_layout_tests 150 python3 -m pytest -q --tb=short tests/kernels/test_kernels_moe_align.py \
               tests/kernels/test_kernels_moe_fp8.py tests/kernels/test_kernels_moe_combine.py
             step moe_decode_profile 150 python3 -m benchmarks.decode_profile --preset qwen3.5-35b-a3b-fp8 --layers 8 \
               --batch 256 --prompt-len 8192 --output-tokens 12 ;;
    # The FP8 KV pool's decode (attention dots in fp16 over it): its GPU tests, the kernel against the bf16
    # pool's with its launch configs swept, the decode step profiled with
    # the model-dtype pool and the FP8 one side by side (8-layer FP8 35B-A3B at 256 rows, 16-layer 27B at 96),
    # then the 8k / 1k jobs at the defaults against FP8 KV
    fp8kv_decode) step fp8kv_tests 150 python3 -m pytest -q --tb=short tests/kernels/test_attention_fp8_kv.py tests/engine/test_engine_gpu.py
             step fp8kv_kernel 200 python3 -m benchmarks.bench_replay_attn --fp8-kv
             for kv in auto fp8_e4m3; do
               step kv_moe_$kv 150 python3 -m benchmarks.decode_profile --preset qwen3.5-35b-a3b-fp8 --layers 8 \
                 --batch 256 --prompt-len 8192 --output-tokens 12 --kv-cache-dtype $kv
               step kv_27b_$kv 150 python3 -m benchmarks.decode_profile --preset qwen3.5-27b --layers 16 \
                 --batch 96 --prompt-len 8192 --output-tokens 12 --kv-cache-dtype $kv
             done ;;
    fp8kv_jobs) jobs8k fp8kv_jobs35 300 qwen3.5-35b-a3b-fp8 "256$GEN,256$GEN/kv_cache_dtype=fp8_e4m3"
             jobs8k fp8kv_jobs27 290 qwen3.5-27b "96$GEN,96$GEN/kv_cache_dtype=fp8_e4m3" ;;
    # The decode attention on the engine's own last-step inputs beside variants (why it reads its KV
    # below the kernel benchmark's rate): FP8 35B-A3B at 8 layers with each KV dtype, 27B at 16 layers
    attn_probe) for kv in auto fp8_e4m3; do
               step probe_moe_$kv 150 python3 -m benchmarks.decode_profile --preset qwen3.5-35b-a3b-fp8 --layers 8 \
                 --batch 256 --prompt-len 8192 --output-tokens 12 --kv-cache-dtype $kv --attention-probe
             done
             step probe_27b 150 python3 -m benchmarks.decode_profile --preset qwen3.5-27b --layers 16 \
               --batch 96 --prompt-len 8192 --output-tokens 12 --attention-probe ;;
    # The FP8 expert GEMMs at prefill shapes (~1,024 rows an expert at 32,768-token steps, ~390 TFLOP/s in the
    # engine's 8k step profile): the row tile and warps swept (128 rows: gate|up spills 192 B at 8 warps offline),
    # programs column block fastest (the default) against row tile fastest (':rows')
    moe_prefill_launches) step moe_prefill_launches 240 python3 -m benchmarks.bench_moe_fp8 --preset qwen3.5-35b-a3b \
               --tokens 8192,32768 --launches 64:8:3,64:8:3:rows,64:8:4,64:8:4:rows,128:8:3,128:4:3,32:4:3
             step moe_decode_launches 120 python3 -m benchmarks.bench_moe_fp8 --preset qwen3.5-35b-a3b \
               --tokens 256,1024 --launches 16:4:3,16:4:3:rows,64:8:3,64:8:3:rows ;;
    # One short call for the FP8 35B-A3B: the expert GEMMs' program order (column block fastest, the
    # default, against row tile fastest) at prefill and decode shapes, the 8k / 1k job at the defaults
    # against FP8 KV (128-key tiles over it), then the decode attention probe over each pool
    owed_moe) step moe_order 100 python3 -m benchmarks.bench_moe_fp8 --preset qwen3.5-35b-a3b --tokens 8192,32768 \
               --launches 64:8:3,64:8:3:rows,64:8:4,128:8:3
             step moe_order_decode 50 python3 -m benchmarks.bench_moe_fp8 --preset qwen3.5-35b-a3b --tokens 256,1024 \
               --launches 16:4:3,16:4:3:rows
             jobs8k jobs35fp8 230 qwen3.5-35b-a3b-fp8 "256$GEN,256$GEN/kv_cache_dtype=fp8_e4m3"
             for kv in fp8_e4m3 auto; do
               step probe_moe_$kv 75 python3 -m benchmarks.decode_profile --preset qwen3.5-35b-a3b-fp8 --layers 8 \
                 --batch 256 --prompt-len 8192 --output-tokens 12 --kv-cache-dtype $kv --attention-probe
             done ;;
    # The FP8 expert kernels each on its own launch (gate|up / down row tiles, 16 warps at 128 rows, a
    # 256-column down tile) and the W8A16 pair (+a16: dots kept in flight) at prefill-sized steps
    moe_tiles) step moe_fp8_tests 120 python3 -m pytest -q --tb=short tests/kernels/test_kernels_moe_fp8.py
             step moe_tiles 420 python3 -m benchmarks.bench_moe_fp8 --preset qwen3.5-35b-a3b --tokens 8192,32768 \
               --launches 64:8:4,64:8:3+a16,64:8:3+f16,64:8:4+a16,128:16:3/64:8:3+a16,128:16:3+a16,128:16:3+f16,32:8:3+a16,128:16:3/64:8:4,64:4:2/64:8:4,64:8:4/128:8:3,64:8:4/128:16:3,64:8:4/64:8:3:256 ;;
    # The same at decode sizes, then the whole MoE block with its shared expert separate against in the
    # grouped kernel (BATCHINFER_MOE_SHARED_IN_GROUPED), side by side
    moe_block) step moe_decode_a16 150 python3 -m benchmarks.bench_moe_fp8 --preset qwen3.5-35b-a3b --tokens 256,1024 \
               --launches 16:4:3,16:8:3+a16,16:8:3+f16,32:8:3+a16
             step moe_shared_block 150 python3 -m benchmarks.bench_moe_fp8 --preset qwen3.5-35b-a3b \
               --tokens 256,512,1024,8192,32768 --shared-in-grouped ;;
    # The FP8 35B-A3B 8k / 1k job at the defaults against the shared expert in the grouped kernel at every
    # step and at decode-sized steps only (<= 1,024 tokens), one process
    moe_jobs) jobs8k moe_jobs 420 qwen3.5-35b-a3b-fp8 "256$GEN,256$GEN/env.BATCHINFER_MOE_SHARED_IN_GROUPED=all,256$GEN/env.BATCHINFER_MOE_SHARED_IN_GROUPED=1024" ;;
    # The FP8 35B-A3B 8k / 1k job at the expert defaults against the ones before them (gate|up 64:8:4 in
    # prefill, the shared expert separate), one process
    moe_defaults_ab) jobs8k moe_defaults_ab 420 qwen3.5-35b-a3b-fp8 "256$GEN/env.BATCHINFER_MOE_PREFILL_LAUNCH=64:8:4/env.BATCHINFER_MOE_SHARED_IN_GROUPED=0,256$GEN" ;;
    # The FP8 35B-A3B 8k / 1k job at SGLang's published concurrency (1,024 prompts; 256 prompts leave
    # a third of the ~384 rows the engine sizes empty); benchmarks/job_schedule predicts ~44,800 total tok/s
    peer35fp8) jobs8k peer35fp8 560 qwen3.5-35b-a3b-fp8 "1024$GEN" ;;
    # The FP8 experts at decode sizes (256 / 384 / 512 / 1,024 tokens; the FP8 35B-A3B decodes 384 rows):
    # each part of the path alone against its byte floor, then launches: the weights on the dots' M side
    # (+swap: e4m3 wgmma, no conversions), down on 256 columns, other tiles and stages
    moe_decode_parts) step moe_decode_parts 240 python3 -m benchmarks.bench_moe_fp8 --preset qwen3.5-35b-a3b \
               --tokens 256,384,512,1024 --parts --launches 16:4:3,16:4:3+swap,16:4:2+swap,16:4:4+swap,16:8:3+swap,32:4:3+swap,32:8:3+swap,16:4:3/16:4:3:256+swap,16:4:3/16:4:3:256,64:8:4 ;;
    # One call for the FP8 MoE: the expert kernels' GPU tests, the decode sweep on the H200 (the swapped pair,
    # the decode default, was measured on an H100), then the 1,024-prompt job
    moe_round) step moe_gpu_tests 100 python3 -m pytest -q --tb=short tests/kernels/test_kernels_moe_align.py \
               tests/kernels/test_kernels_moe_fp8.py -k "cuda or graph"
             step moe_decode_sweep 80 python3 -m benchmarks.bench_moe_fp8 --preset qwen3.5-35b-a3b --tokens 256,384,1024 \
               --parts --launches 16:4:3,16:4:3+swap,16:4:2+swap,32:4:3+swap,64:8:4
             jobs8k peer35fp8 340 qwen3.5-35b-a3b-fp8 "1024$GEN" ;;
    # moe_round without its GPU tests: the decode sweep and the 1,024-prompt job alone (~7 min)
    moe_job) step moe_decode_sweep 80 python3 -m benchmarks.bench_moe_fp8 --preset qwen3.5-35b-a3b --tokens 256,384,1024 \
               --parts --launches 16:4:3,16:4:3+swap,32:4:3+swap,64:8:4
             jobs8k peer35fp8 340 qwen3.5-35b-a3b-fp8 "1024$GEN" ;;
    # The FP8 35B-A3B 8k / 1k job at the defaults (the swapped decode experts) against the row-major pair, one process
    moe_swap_ab) jobs8k moe_swap_ab 420 qwen3.5-35b-a3b-fp8 "256$GEN,256$GEN/env.BATCHINFER_MOE_DECODE_LAUNCH=16:4:3" ;;
    # The same job at the defaults against the W8A16 experts (bf16 dots, fp16 dots), one process
    moe_jobs_a16) jobs8k moe_jobs_a16 420 qwen3.5-35b-a3b-fp8 "256$GEN,256$GEN/env.BATCHINFER_MOE_W8A16=1,256$GEN/env.BATCHINFER_MOE_W8A16=fp16" ;;
    # Where the FP8 MoE's prefill (40 layers, 8k steps) and decode (8 layers, 256 rows, the attention
    # probe) steps go, kernel by kernel
    moe_profiles) step prefill_moe40 150 python3 -m benchmarks.prefill_profile --preset qwen3.5-35b-a3b-fp8 --layers 40 \
               --prompts 4 --policies sdpa-cudnn
             step probe_moe 150 python3 -m benchmarks.decode_profile --preset qwen3.5-35b-a3b-fp8 --layers 8 \
               --batch 256 --prompt-len 8192 --output-tokens 12 --attention-probe ;;
    # The dense 27B: the engine_arms regression check at 64 layers (8,192 tokens a step, the issue's
    # reference, then rag at the 32,768-token default), then where its 8k prefill step (bf16, FP8)
    # and its FP8 decode step at 96 rows go, kernel by kernel (16 layers)
    dense_round) step arms64 250 python3 -m benchmarks.engine_arms --layers 64 --arms replay+extra_buffer --json "$out/arms64.json"
             step arms64_32k 90 python3 -m benchmarks.engine_arms --layers 64 --arms replay+extra_buffer --workloads rag \
               --max-batch-tokens 32768 --no-floor --json "$out/arms64_32k.json"
             for preset in qwen3.5-27b qwen3.5-27b-fp8; do
               step prefill_$preset 70 python3 -m benchmarks.prefill_profile --preset $preset --layers 16 --prompts 2 --policies sdpa-cudnn
             done
             step decode_fp8_96 90 python3 -m benchmarks.decode_profile --preset qwen3.5-27b-fp8 --layers 16 \
               --batch 96 --prompt-len 8192 --output-tokens 12 ;;
    # The swapped FP8 GEMM for decode rows (kernels/fp8_gemm/swapped.py): its tests, the GEMMs alone
    # against cuBLAS's at the 27B's shapes, then FP8 27B 8k / 1k jobs in one process: 96 rows at the
    # defaults, 16 rows with cuBLAS at every row count against the defaults (the swapped GEMM), 96 rows
    # with FP8 KV
    fp8_decode_gemm) step fp8gemm_tests 80 python3 -m pytest -q --tb=short tests/kernels/test_fp8_gemm.py
             step fp8_decode_gemm 90 python3 -m benchmarks.bench_fp8_gemm --decode 8,32,48 --swapped 128:4:3,64:4:3,64:4:4
             jobs8k fp8_decode_jobs 380 qwen3.5-27b-fp8 \
               "96$GEN,16x8192x1024@16/env.BATCHINFER_FP8_GEMM=cublas,16x8192x1024@16,96$GEN/kv_cache_dtype=fp8_e4m3" ;;
  esac
done
for f in "$out"/*.log; do echo "---- $(basename "$f")"; tail -n 25 "$f"; done
cat "$out/summary.txt"
