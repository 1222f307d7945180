#!/usr/bin/env bash
# Hardware counters (Nsight Compute, Firecracker H200 machines) for one launch of each of our
# GDN kernels at its benchmark shape: speed of light, occupancy, launch stats, warp stalls, memory.
#   bash benchmarks/ncu_kernels.sh [OUTDIR]
set -u
out=${1:-${OUT:-gpu-logs}}; mkdir -p "$out"
ncu_one() {  # ncu_one NAME KERNEL_REGEX SKIP COUNT TARGET
  ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section WarpStateStats --section MemoryWorkloadAnalysis \
      -k "regex:$2" --launch-skip "$3" --launch-count "$4" \
      python3 -m benchmarks.profile_targets "$5" >"$out/ncu_$1.txt" 2>&1
  echo "== ncu $1 rc=$?"
  grep -E '^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit (Reg|Shared)|Warp Cycles Per Issued|L2 Hit|L1/TEX Hit|Grid Size|Block Size|Stall|stall' \
      "$out/ncu_$1.txt" | grep -v '^==PROF==' | head -60
}
ncu_one replay_step replay_step_kernel 20 1 replay
ncu_one replay_flush replay_fold_kernel 20 1 replay
ncu_one decode _gdn_decode 2 1 decode
ncu_one prefill 'chunk_wy|state_pass|chunk_output' 3 3 prefill
