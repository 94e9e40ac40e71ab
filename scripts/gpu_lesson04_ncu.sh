#!/usr/bin/env bash
# Lesson 04 under Nsight Compute (lent GPU): what the DRAM, L2 and warps do in SDPA's default kernel (cuDNN)
# and in our paged decode on the same data (and on SDPA's own contiguous tensors). One call, about 2 minutes.
#   OUT=out bash scripts/gpu_lesson04_ncu.sh
#   NCU_SHAPES=32x8x4096 OUT=out bash scripts/gpu_lesson04_ncu.sh
# Writes $OUT/ncu.log (the sections, human readable) and $OUT/ncu_raw.csv (every metric, one row per kernel).
# The clocks are left as the GPU sets them (--clock-control none), as in the benchmarks.
set -uo pipefail
OUT=${OUT:-out_ncu}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU ($("$NCU" --version | tail -1))" | tee "$OUT/ncu.log"
python3 -c "import torch, triton; print('gpu', torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/ncu.log"
echo "commit ${YAIE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee -a "$OUT/ncu.log"
# Only the timed calls (the workload switches the profiler on around them), only the attention kernels.
FILTER=(--profile-from-start off -k "regex:sdpa|paged_decode")
SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
          --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats)
timeout 400 "$NCU" --clock-control none "${FILTER[@]}" "${SECTIONS[@]}" \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum \
    --export "$OUT/profile" --force-overwrite \
    python3 scripts/gpu_lesson04_ncu.py >> "$OUT/ncu.log" 2>&1
echo "ncu exit $?" | tee -a "$OUT/ncu.log"
"$NCU" --import "$OUT/profile.ncu-rep" --page raw --csv > "$OUT/ncu_raw.csv" 2>> "$OUT/ncu.log"
"$NCU" --import "$OUT/profile.ncu-rep" --print-summary none >> "$OUT/ncu.log" 2>&1
rm -f "$OUT/profile.ncu-rep"
tail -5 "$OUT/ncu.log"
