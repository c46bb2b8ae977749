#!/usr/bin/env bash
# The lead's batched GPU session on the lent machine: GPU tests and the benchmarks of
# issues 17 and 19, one stage per argument, outputs in $OUT. Usage:
#   bash scripts/gpu_wave.sh tests fused fp8gemm   # then: engine8b, fp8engine, prefix, quality
#   bash scripts/gpu_wave.sh tp2                   # on nvidia-h100-x2
#   bash scripts/gpu_lanes.sh "0,1:tp2sm" "2:mixed prefix_on" "3:fp8gemm"   # lanes on nvidia-h100-x4
set -u
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

# each file's tests ($3...) in a pytest of its own, marked $2 (e.g. "-m gpu"), at most FILE_S seconds
# (default $1); its log in $OUT, its summary line here
test_files() {
  local limit=${FILE_S:-$1} mark=$2 f; shift 2
  for f in "$@"; do
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider $mark "$f" --tb=short -rfE \
      > "$OUT/$(basename "$f" .py).log" 2>&1
    echo "$f: $(grep -E "passed|failed|error" "$OUT/$(basename "$f" .py).log" | tail -1)"
  done
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests)  # one process per file: a failed graph capture leaves the CUDA RNG broken for the rest of its process
      for f in $(python3 -m pytest --collect-only -q -p no:cacheprovider -m gpu tests/kernels tests/engine tests/models \
                   2>/dev/null | grep "::" | cut -d: -f1 | sort -u); do
        python3 -m pytest -q -p no:cacheprovider -m gpu "$f" --tb=line -rfE > "$OUT/gpu_tests.log" 2>&1
        echo "$f: $(grep -E "passed|failed|error|no tests ran" "$OUT/gpu_tests.log" | tail -1)"
        grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests.log" | cut -c1-240
      done ;;
    tp2) python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_tp_gpu.py tests/engine/test_tp_gpu.py \
           tests/engine/test_tp_failures.py --tb=line --timeout 240 2>&1 | tail -12  # pytest-timeout is there
         python3 -m benchmarks.tp_decode 2>&1 | tail -12 ;;
    tp2sm)  # 2+ GPUs: the symmetric all-reduce and TP graph tests, the all-reduce micro table
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/layers/test_symm_allreduce_gpu.py \
        tests/models/test_tp_gpu.py tests/engine/test_tp_gpu.py --tb=line -rfE --timeout 120 2>&1 | tail -12
      timeout 60 python3 -m benchmarks.allreduce_micro --worlds 2 2>&1 | tail -14 ;;
    tptests)  # 2+ GPUs: tensor-parallel engine, decoder and symmetric all-reduce GPU tests (TP_TESTS: a subset)
      timeout ${STAGE_S:-170} python3 -m pytest -q -p no:cacheprovider -m gpu ${TP_TESTS:-tests/engine/test_tp_gpu.py \
        tests/models/test_tp_gpu.py tests/layers/test_symm_allreduce_gpu.py} --durations=8 --tb=short -rfE --timeout ${TEST_TIMEOUT:-100} 2>&1 \
        | tee "$OUT/tptests.log" | grep -E "^(FAILED|ERROR)|passed|failed|s (call|setup) " | tail -20 ;;
    tpclose)  # 2+ GPUs: the TP GPU tests (closes between them, a killed worker's broken group), then an 8B's close
      # timed; every rank's stacks go to $OUT/tp_close.log whole if the close runs past 30 s
      timeout ${STAGE_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_tp_gpu.py \
        tests/engine/test_tp_failures.py --durations=6 --tb=short -rfE --timeout 100 2>&1 | tail -14
      timeout 150 python3 -m benchmarks.tp_decode --sizes 2 --adapters 8 --all-reduce auto --stall-dump 60 \
        > "$OUT/tp_close.log" 2>&1; grep -n 'closed in\|still leaving\|step ' "$OUT/tp_close.log" | tail -6 ;;
    graphtests)  # 1 GPU: graph inputs staging, the engine against transformers with graphs, mixed graphs
      timeout ${STAGE_S:-170} python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_host_copy.py \
        tests/engine/test_gpu.py tests/engine/test_mixed_graphs_gpu.py --tb=short -rfE --timeout ${TEST_TIMEOUT:-100} 2>&1 \
        | tee "$OUT/graphtests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -12 ;;
    tp8b1)  # 1 GPU: the 8B at TP 1 (the reference for the TP rows: step, floor, adapter tax)
      timeout ${STAGE_S:-170} python3 -m benchmarks.tp_decode --sizes 1 ${TP_ARGS:-} 2>&1 | tee "$OUT/tp8b1.log" | grep -v '^\[{' | tail -40 ;;
    pinning)  # what pinning costs here, one GPU's context and every GPU's (as under tensor parallelism)
      python3 benchmarks/host_pinning.py 2>&1 | tail -9; python3 benchmarks/host_pinning.py --all-devices 2>&1 | tail -9 ;;
    scale2)  # 2 GPUs, Ray installed (scripts/ray_wheels.sh): 2 replicas, adapter affinity against pow2
      PYTHONPATH=/tmp/site:. RAY_AUTH_MODE=disabled timeout ${STAGE_S:-560} python3 benchmarks/scale.py --model 8b \
        --replicas 2 --routing adapter pow2 --requests-per-replica 256 --grpc-port 50151 --workdir /dev/shm/scale2 \
        --out "$OUT/scale2.md" 2>&1 | tail -12 ;;
    scale1)  # 1 GPU, Ray installed: the 1-replica baseline (run beside scale2 on the same host)
      PYTHONPATH=/tmp/site:. RAY_AUTH_MODE=disabled timeout ${STAGE_S:-560} python3 benchmarks/scale.py --model 8b \
        --replicas 1 --requests-per-replica 256 --grpc-port 50161 --workdir /dev/shm/scale1 --out "$OUT/scale1.md" \
        2>&1 | tail -40 ;;
    overhead)  # 1 GPU, Ray installed: the server path, two tiers against direct, paired with the engine
      PYTHONPATH=/tmp/site:. RAY_AUTH_MODE=disabled timeout ${STAGE_S:-560} python3 benchmarks/server_overhead.py \
        --model 1b --device cuda --no-inproc 2>&1 | tail -30 ;;
    overhead_relay)  # 1 GPU, Ray installed, alone on the host: direct mode, the engine in its own process and in the
      # replica's, with the relay's chunk pacing off and on; then the per-hop medians from the server's spans
      for ms in 0 0.5; do PYTHONPATH=/tmp/site:. RAY_AUTH_MODE=disabled timeout ${STAGE_S:-200} python3 \
        benchmarks/server_overhead.py --model 1b --device cuda --direct on --relay-chunk-ms $ms 2>&1 | tail -14; done
      PYTHONPATH=/tmp/site:. RAY_AUTH_MODE=disabled timeout ${STAGE_S:-200} python3 benchmarks/server_overhead.py \
        --model 1b --device cuda --direct on --trace 2>&1 | tail -30 ;;
    stall70b)  # 4 GPUs: the 70B at TP 4, base then 64 adapters and distinct64, with every rank's stacks after 45 s of a
      # workload (carry .scratch/py-spy: cp .venv/bin/py-spy .scratch/ here first); MODULE_LOADING=EAGER: CUDA loads
      # every kernel at start (a first launch beside a spinning all-reduce barrier can wait for ever)
      CUDA_MODULE_LOADING=${MODULE_LOADING:-LAZY} PATH=$PWD/.scratch:$PATH timeout ${STAGE_S:-285} python3 -m benchmarks.tp_decode --shape 70b --sizes 4 \
        --all-reduce auto --stall-dump ${STALL_S:-45} ${TP_ARGS:-} > "$OUT/stall70b.log" 2>&1
      grep -n 'stall watch\|warm-up run\|added in\|built in\|step \|rror' "$OUT/stall70b.log" | tail -40 ;;
    server16)  # 1 GPU, Ray installed, alone on the host: the server path at 16 streams under py-spy, then the pacing
      PYTHONPATH=/tmp/site:. RAY_AUTH_MODE=disabled timeout ${STAGE_S:-300} python3 benchmarks/server_overhead.py \
        --model 1b --device cuda --direct on --no-inproc --concurrency 16 --requests 512 --profile "$OUT/server_prof" \
        2>&1 | tail -110
      for ms in ${PACING:-0 0.5 2}; do PYTHONPATH=/tmp/site:. RAY_AUTH_MODE=disabled timeout 200 python3 \
        benchmarks/server_overhead.py --model 1b --device cuda --direct on --relay-chunk-ms $ms 2>&1 | tail -8; done ;;
    procs16)  # 1 GPU, Ray installed: the server path through the replica's own port, the loop against 4 front
      # workers, both up at once, the streams from 16 client processes
      PYTHONPATH=/tmp/site:. RAY_AUTH_MODE=disabled timeout ${STAGE_S:-330} python3 benchmarks/server_overhead.py \
        --model 1b --device cuda --direct on --no-inproc --via own --front-workers 0 4 --client-processes 16 \
        2>&1 | tail -16 ;;
    hops16)  # 1 GPU, Ray installed (with the OTLP exporter): each hop of a call and how far a group of 16 spreads,
      # from the server's spans, the calls from 16 client processes; WORKERS: replica_grpc.workers per run
      for w in ${WORKERS:-0}; do PYTHONPATH=/tmp/site:. RAY_AUTH_MODE=disabled timeout ${STAGE_S:-240} python3 \
        benchmarks/server_overhead.py --model 1b --device cuda --direct on --via own --trace --concurrency 1 16 \
        --requests ${REQUESTS:-128} --client-processes 16 --front-workers $w 2>&1 | tail -22; done ;;
    overlap)  # 4 GPUs: a row-parallel GEMM and its all-reduce, serial against pipelined in column chunks
      timeout ${STAGE_S:-200} python3 -m benchmarks.tp_overlap --world 4 2>&1 | tail -14 ;;
    tp8b)  # 4 GPUs: the 8B decode step at TP 1, 2, 4, NCCL against the symmetric all-reduce (engines build cold)
      timeout ${STAGE_S:-540} python3 -m benchmarks.tp_decode --sizes 1,2,4 ${TP_ARGS:-} 2>&1 | tee "$OUT/tp8b.log" | grep -v '^\[{' | tail -30 ;;
    tp70b)  # 4 GPUs: the 70B at TP 4 (base and 64 distinct adapters)
      timeout ${STAGE_S:-540} python3 -m benchmarks.tp_decode --shape 70b --sizes 4 ${TP_ARGS:-} 2>&1 | tee "$OUT/tp70b.log" | grep -v '^\[{' | tail -20 ;;
    mixed) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_mixed_graphs_gpu.py \
             tests/kernels/test_prefill_attention.py tests/engine/test_warmup_gpu.py --tb=line -rfE 2>&1 | tail -12 ;;
    prefix_on) timeout 240 python3 benchmarks/prefix_cache.py --model 1b --workloads spread --mixed-graphs on 2>&1 | tail -20 ;;
    fused) timeout ${STAGE_S:-300} python3 benchmarks/fused_update.py 2>&1 | tail -30 ;;
    fp8gemm) python3 benchmarks/fp8_gemm.py 2>&1 | tail -30 ;;
    fp8dec)  # 1 GPU: FP8 on our decode GEMM against the engine's FP8 kernels (its GPU tests: the fp8tests stage)
      timeout ${BENCH_S:-240} python3 benchmarks/fp8_decode_gemm.py 2>&1 | tail -48 ;;
    fp8tests)  # 1 GPU: the FP8 decode GEMM's and PDL kernel tests, then the FP8 engine tests; a log per file in $OUT
      test_files 240 "-m gpu" tests/kernels/test_fp8_decode_gemm.py tests/kernels/test_pdl.py \
        tests/models/test_fp8_kernels.py tests/models/test_fp8_gpu.py ;;
    engine8b) python3 benchmarks/engine_throughput.py --models 8b --hf-models '' --budget-s 480 \
                --first-request --workloads base,one,one+st,uniform8,uniform8+st,distinct,distinct+st,zipf,families --out "$OUT/et8b.md" 2>&1 | tail -25 ;;
    table8b)  # 1 GPU: issue 17's engine table, one part a call (TABLE_DTYPE bfloat16|fp8, TABLE_WORKLOADS, TABLE_BATCHES;
      # TABLE_HF=8b adds transformers + PEFT): e.g. the workloads at B=64, then base,distinct at 1,256. The engines skip
      # their own warm-up (40-126 s each on the H200) unless TABLE_ENGINE_WARMUP=1; a row whose timed run then met a
      # kernel variant or graph first says so in its note
      timeout ${STAGE_S:-560} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --dtype ${TABLE_DTYPE:-bfloat16} \
        $([ "${TABLE_ENGINE_WARMUP:-0}" = 1 ] || echo --no-engine-warmup) \
        --hf-models "${TABLE_HF:-}" --budget-s ${TABLE_BUDGET_S:-520} --batches-8b ${TABLE_BATCHES:-64} \
        --workloads ${TABLE_WORKLOADS:-base,one,uniform8,distinct,zipf,ranks,families} \
        --out "$OUT/et8b_table_${TABLE_DTYPE:-bfloat16}.md" > "$OUT/table8b.log" 2>&1
      grep -E ": 8b|hf" "$OUT/table8b.log" | tail -16 ;;
    rowlimit)  # 1 GPU: the fused linear's row limit: the engine GPU tests it touches, then one adapter above 63 idle
      # ones (one-over-64: the separate kernels by the limit) against below them (fused) and the kernels alone, per dtype
      test_files ${FILE_S:-150} "-m gpu" tests/engine/test_lora_stacked.py tests/engine/test_warmup_gpu.py
      for dtype in ${DTYPES:-bfloat16 fp8}; do
        timeout ${STAGE_S:-200} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --dtype $dtype \
          --no-engine-warmup --hf-models '' --budget-s ${BUDGET_S:-170} --max-tokens 64 \
          --workloads base,one-of-64,one-over-64,one-over-64+ke --out "$OUT/et8b_rowlimit_$dtype.md" \
          > "$OUT/rowlimit_$dtype.log" 2>&1; grep -E ": 8b" "$OUT/rowlimit_$dtype.log" | tail -4
      done ;;
    window)  # 1 GPU: the fused linear's row windows (each slice's from the step's lowest row): its kernel and
      # engine GPU tests, then one adapter above 63 idle ones (one-over-64) against one alone, per dtype
      test_files ${FILE_S:-150} "-m gpu" tests/kernels/test_stacked_fused.py tests/kernels/test_stacked_fused_apart.py \
        tests/models/test_fp8_lora_fused_gpu.py tests/engine/test_lora_stacked.py ${WINDOW_TESTS:-}
      for dtype in ${DTYPES:-bfloat16 fp8}; do
        timeout ${STAGE_S:-150} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --dtype $dtype \
          --no-engine-warmup --hf-models '' --budget-s ${BUDGET_S:-120} \
          --workloads ${WINDOW_WORKLOADS:-base,one,one-over-64} --out "$OUT/et8b_window_$dtype.md" \
          > "$OUT/window_$dtype.log" 2>&1; grep -E ": 8b" "$OUT/window_$dtype.log" | tail -4
      done ;;
    families)  # 1 GPU: steps with (IA)^3 and bottleneck rows: the engine GPU tests that run those rows (FAMILY_TESTS;
      # test_gpu.py needs over 215 s on a fresh machine, its Triton cache cold), then base and families per dtype
      # (FAMILY_WORKLOADS: e.g. fam-ia3, fam-bottleneck, fam-lora, each family's rows of families alone)
      test_files ${FILE_S:-330} "-m gpu" ${FAMILY_TESTS:-tests/engine/test_gpu.py tests/engine/test_mixed_graphs_gpu.py \
        tests/engine/test_warmup_gpu.py tests/models/test_fp8_gpu.py}
      for dtype in ${DTYPES:-bfloat16 fp8}; do
        TABLE_DTYPE=$dtype TABLE_WORKLOADS=${FAMILY_WORKLOADS:-base,families} STAGE_S=${TABLE_S:-150} \
          TABLE_BUDGET_S=${TABLE_BUDGET_S:-130} bash "$0" table8b | grep ": 8b"
        cp "$OUT/table8b.log" "$OUT/families_$dtype.log"
      done ;;
    fp8engine)  # the 8B in FP8 (FP8_WORKLOADS), then bf16 base; logs in $OUT as they grow (a timeout keeps them)
      timeout ${STAGE_S:-330} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --dtype fp8 --hf-models '' \
        --budget-s ${FP8_BUDGET_S:-300} --workloads ${FP8_WORKLOADS:-base,one,distinct} --max-tokens ${MAX_TOKENS:-128} \
        --out "$OUT/et8b_fp8.md" > "$OUT/fp8engine.log" 2>&1; tail -16 "$OUT/fp8engine.log"
      timeout ${BF16_S:-200} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --hf-models '' --budget-s 100 \
        --workloads base --max-tokens ${MAX_TOKENS:-128} --out "$OUT/et8b_bf16_base.md" > "$OUT/bf16base.log" 2>&1
      tail -12 "$OUT/bf16base.log" ;;
    attn)  # 1 GPU: decode attention, float32 against bf16 products, the bf16 against the FP8 cache (table in $OUT),
      # then the 8B engine with both products (ATTN_WORKLOADS)
      timeout ${BENCH_S:-200} python3 benchmarks/attention_decode.py > "$OUT/attention_decode.log" 2>&1
      tail -60 "$OUT/attention_decode.log"
      timeout ${STAGE_S:-330} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --hf-models '' --budget-s 250 \
        --workloads ${ATTN_WORKLOADS:-base,base+ad,base+kv8,base+kv8+ad} --max-tokens ${MAX_TOKENS:-64} \
        --out "$OUT/et8b_attn.md" > "$OUT/attnengine.log" 2>&1; tail -12 "$OUT/attnengine.log" ;;
    attnsweep)  # 1 GPU: decode attention's tile shapes with bf16-input products (DOTS), whole contexts
      timeout ${BENCH_S:-200} python3 benchmarks/attention_decode.py --sweep --dots ${DOTS:-input} \
        > "$OUT/attention_sweep.log" 2>&1; grep -E "^\||GB/s" "$OUT/attention_sweep.log" ;;
    newtests)  # 1 GPU: the sixteenth session's GPU tests not yet run there (a log per file in $OUT)
      test_files 110 "" tests/engine/test_pdl_engine_gpu.py tests/engine/test_attention_dots_gpu.py \
        tests/kernels/test_attention.py tests/kernels/test_kv_fp8.py tests/engine/test_kv_fp8_gpu.py ;;
    kvfp8)  # 1 GPU: the FP8 KV cache's GPU tests (logs in $OUT), then the 8B with and without it
      test_files 150 "-m gpu" tests/kernels/test_kv_fp8.py tests/engine/test_kv_fp8_gpu.py
      timeout ${STAGE_S:-330} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --hf-models '' --budget-s 280 \
        --workloads ${KV_WORKLOADS:-base,base+kv8,distinct,distinct+kv8} --max-tokens ${MAX_TOKENS:-128} \
        --out "$OUT/et8b_kv8.md" > "$OUT/kvfp8.log" 2>&1; tail -14 "$OUT/kvfp8.log" ;;
    fp8lora)  # 1 GPU: the fused LoRA linear with A rows apart: GPU tests, the stack table (both dtypes)
      test_files 150 "-m gpu" tests/kernels/test_stacked_fused_apart.py tests/models/test_fp8_lora_fused_gpu.py
      timeout ${BENCH_S:-220} python3 benchmarks/fp8_lora_fused.py > "$OUT/fp8_lora_fused.log" 2>&1
      tail -9 "$OUT/fp8_lora_fused.log" ;;
    bf16lora)  # 1 GPU: the fused LoRA linear with A rows apart on bf16: its GPU tests
      test_files 120 "-m gpu" tests/engine/test_lora_stacked.py tests/kernels/test_stacked_fused.py \
        tests/engine/test_warmup_gpu.py ;;
    fp8sweep)  # 1 GPU: fp8 fused's loop choices with one adapter (shrink loop, base stages: 2 programs a multiprocessor?)
      timeout ${STAGE_S:-200} python3 benchmarks/fp8_lora_fused.py --sweep 2>&1 | tail -30 ;;
    projections)  # 1 GPU: the fused linear projection by projection; RESIDENT (e.g. 1,8,16,32,64): also one adapter's
      # tokens while that many adapters are resident, against the separate kernels (the fused linear covers their rows)
      timeout ${STAGE_S:-240} python3 benchmarks/fused_linear_projections.py --resident "${RESIDENT:-}" 2>&1 | grep "|" ;;
    lora8b)  # 1 GPU: the 8B's one-adapter tax, the fused linear (the default on Hopper) against the separate kernels
      # (each dtype's engines take about 90 s a workload with warm-up: STAGE_S/BUDGET_S for three)
      for dtype in ${DTYPES:-fp8 bfloat16}; do
        timeout ${STAGE_S:-280} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --dtype $dtype --hf-models '' \
          --budget-s ${BUDGET_S:-230} --workloads ${LORA_WORKLOADS:-base,one,one+ke} --max-tokens ${MAX_TOKENS:-64} \
          --out "$OUT/et8b_${dtype}_lora.md" > "$OUT/lora8b_$dtype.log" 2>&1; tail -10 "$OUT/lora8b_$dtype.log"
      done ;;
    autotests)  # 1 GPU: the fused linear's kernel tests and the engine's GPU tests under lora_decode "auto" (fused)
      test_files 120 "-m gpu" ${AUTO_TESTS:-tests/kernels/test_stacked_fused_apart.py tests/kernels/test_stacked_fused.py \
        tests/kernels/test_pdl.py tests/engine/test_lora_stacked.py tests/models/test_fp8_lora_fused_gpu.py \
        tests/engine/test_gpu.py tests/engine/test_warmup_gpu.py} ;;
    firstreq)  # 1 GPU: the 8B's first request after ready against steady state, and what the first two paid
      timeout ${STAGE_S:-300} python3 benchmarks/engine_throughput.py --models 8b --hf-models '' --first-request \
        --workloads base --budget-s 120 --out "$OUT/firstreq.md" 2>&1 | grep -E "first request|request:|^    |start-up|warm-up:" | head -40 ;;
    profile)  # 1 GPU: each kernel's time in the 8B's decode step (B=64), graph replays traced, per dtype (DTYPES);
      # PDL=off: each kernel's own time (with PDL a kernel's time includes its wait for the one before)
      for dtype in ${DTYPES:-bfloat16 fp8}; do
        timeout ${STAGE_S:-200} python3 benchmarks/step_profile.py --kernels --in-graphs --dtype $dtype \
          --workloads ${PROFILE_WORKLOADS:-base,one} --steps 20 --top ${TOP:-24} --pdl ${PDL:-auto} \
          > "$OUT/profile_${dtype}_${PDL:-auto}.log" 2>&1
        tail -$((${TOP:-24} + 3)) "$OUT/profile_${dtype}_${PDL:-auto}.log"
      done ;;
    rowops)  # 1 GPU: the FP8 quantizing row ops in one pass: their GPU tests, against the row loops, then the
      # 8B's FP8 step traced (PDL off: each kernel's own time)
      test_files 120 "" tests/models/test_fp8_fused.py tests/models/test_fp8_kernels.py tests/kernels/test_pdl.py
      timeout ${BENCH_S:-120} python3 benchmarks/fp8_row_ops.py 2>&1 | tail -10
      PDL=off DTYPES=fp8 PROFILE_WORKLOADS=base TOP=12 bash "$0" profile ;;
    taxsplit)  # 1 GPU: the fused linear's GPU tests (-k TEST_K), then projection by projection (SPLITS: shrink
      # split factors to sweep; TAIL=40 shows the compiled forms), where its tax goes (the ablation, both dtypes); ENGINE_TESTS:
      # engine GPU test files to run after (then: taxengine)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_stacked_fused.py \
        tests/kernels/test_stacked_fused_apart.py -k "${TEST_K:-fused}" --tb=line -rfE 2>&1 | tail -4
      timeout ${BENCH_S:-200} python3 benchmarks/fused_linear_projections.py --splits "${SPLITS:-}" 2>&1 \
        | sed -n '/us per projection/,$p' | head -${TAIL:-12}
      for dtype in bf16 fp8; do  # ABLATION_ADAPTERS: the tokens over that many adapters (default 1)
        timeout ${BENCH_S:-200} python3 benchmarks/fused_ablation.py --dtype $dtype --adapters ${ABLATION_ADAPTERS:-1} \
          2>&1 | tail -7
      done
      [ -n "${ENGINE_TESTS:-}" ] && test_files 200 "-m gpu" $ENGINE_TESTS ;;
    fusedtests)  # 1 GPU: the fused linear's kernel GPU tests and the FP8 engine's (FUSED_TESTS: other files), a log
      # per file in $OUT, each file at most FILE_S seconds (default 280)
      test_files 280 "-m gpu" ${FUSED_TESTS:-tests/kernels/test_stacked_fused.py tests/kernels/test_stacked_fused_apart.py \
        tests/models/test_fp8_lora_fused_gpu.py tests/models/test_fp8_gpu.py} ;;
    prefetch)  # 1 GPU: weight prefetch before the PDL wait: the GEMMs' graph tests (prefetch gives the same bits),
      # the projection table (base pfC, fused 1 pfC), then the 8B engines (PF_WORKLOADS, FP8_PF_WORKLOADS)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_decode_gemm.py \
        tests/kernels/test_fp8_decode_gemm.py tests/kernels/test_stacked_fused.py tests/kernels/test_stacked_fused_apart.py \
        -k "chain_in_a_graph" --tb=short -rfE 2>&1 | tail -4
      timeout ${BENCH_S:-200} python3 benchmarks/fused_linear_projections.py 2>&1 | sed -n '/us per projection/,/^$/p'
      timeout ${STAGE_S:-300} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --hf-models '' \
        --budget-s 260 --workloads ${PF_WORKLOADS:-base,one+pe,one+pe+pf4,one+pe+pf8} --max-tokens 64 \
        --out "$OUT/et8b_pf.md" > "$OUT/pf.log" 2>&1; grep -E "B=64 .*: 8b" "$OUT/pf.log" | tail -6 ;;
    prefetch8)  # 1 GPU: the FP8 8B with and without weight prefetch (PDL is on there by default)
      timeout ${STAGE_S:-300} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --dtype fp8 \
        --hf-models '' --budget-s 260 --workloads ${FP8_PF_WORKLOADS:-base,base+pf4,one,one+pf4} --max-tokens 64 \
        --out "$OUT/et8b_fp8_pf.md" > "$OUT/pf8.log" 2>&1; grep -E "B=64 .*: 8b" "$OUT/pf8.log" | tail -6 ;;
    attnpdl)  # 1 GPU: decode attention in the PDL chain (the default) against kept out (ADAPTERSERVE_ATTENTION_PDL=0):
      # the whole-engine bits tests, then the FP8 8B both ways, prefetch with it (ATTN_PDL_WORKLOADS)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_pdl_engine_gpu.py --tb=short -rfE \
        2>&1 | tail -3
      for in_chain in 0 1; do
        ADAPTERSERVE_ATTENTION_PDL=$in_chain timeout ${STAGE_S:-300} python3 benchmarks/engine_throughput.py --models 8b \
          --no-hotswap --dtype fp8 --hf-models '' --budget-s 260 --workloads ${ATTN_PDL_WORKLOADS:-base,base+pf4,one} \
          --max-tokens 64 --out "$OUT/et8b_attn_pdl$in_chain.md" > "$OUT/attnpdl$in_chain.log" 2>&1
        echo "attention in the chain: $in_chain"; grep -E "B=64 .*: 8b" "$OUT/attnpdl$in_chain.log" | tail -6
      done ;;
    bf16pdl)  # 1 GPU: the bf16 8B with PDL early against off (bf16's "auto" is off), base and one adapter, paired
      timeout ${STAGE_S:-400} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --hf-models '' \
        --budget-s 360 --workloads ${BF16_PDL_WORKLOADS:-base,base+pe,one,one+pe} --max-tokens 64 \
        --out "$OUT/et8b_bf16_pdl.md" > "$OUT/bf16pdl.log" 2>&1; grep -E "B=64 .*: 8b" "$OUT/bf16pdl.log" | tail -6 ;;
    attnpipe)  # 1 GPU: decode attention's pipelined loop (pages read a tile ahead): its GPU tests (bits of the
      # loop as it was; against the twin), then the tile sweep of both loops, bf16 products
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_attention.py --tb=short -rfE 2>&1 | tail -3
      timeout ${BENCH_S:-300} python3 benchmarks/attention_decode.py --sweep --dots input 2>&1 | grep "|" ;;
    splits)  # 1 GPU: decode attention's GPU tests, then the engine's launch against contexts split in 2 and 4
      # parts, in CUDA graphs, both caches
      timeout ${TEST_S:-270} python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_attention.py \
        --tb=short -rfE 2>&1 | tail -3
      timeout ${BENCH_S:-270} python3 benchmarks/attention_decode.py --splits 2>&1 | grep "|" ;;
    attnlaunch)  # 1 GPU: the 8B (ATTN_DTYPE, default fp8) with decode attention's launch as it is, with
      # ADAPTERSERVE_ATTENTION_SPLITS=2 (ATTN_MODES: more SPLITS=n), base, a process each
      for mode in ${ATTN_MODES:-default SPLITS=2}; do
        env $([ $mode = default ] || echo ADAPTERSERVE_ATTENTION_$mode) timeout ${STAGE_S:-180} python3 \
          benchmarks/engine_throughput.py --models 8b --no-hotswap --dtype ${ATTN_DTYPE:-fp8} --hf-models '' \
          --budget-s 150 --workloads ${ATTN_WORKLOADS:-base} --max-tokens 64 --out "$OUT/et8b_attn_${mode/=/_}.md" \
          > "$OUT/attn_${mode/=/_}.log" 2>&1  # no "=" in a file name: the device's $OUT leaves those out
        echo "attention $mode"; grep -E "B=64 .*: 8b" "$OUT/attn_${mode/=/_}.log" | tail -2
      done ;;
    attntiles)  # 1 GPU: the 8B engine with decode attention's tiles as they are against ATTN_TILES (keys,warps,stages:
      # the pipelined loop needs 3 stages or more), FP8 then bf16, base and one adapter, a process each
      for dtype in fp8 bf16; do for tiles in "" ${ATTN_TILES:-64,4,3}; do
        ADAPTERSERVE_ATTENTION_TILES=$tiles timeout ${STAGE_S:-200} python3 benchmarks/engine_throughput.py --models 8b \
          --no-hotswap --dtype $dtype --hf-models '' --budget-s 170 --workloads ${TILES_WORKLOADS:-base,one} \
          --max-tokens 64 --out "$OUT/et8b_tiles_${dtype}_${tiles:-engine}.md" > "$OUT/tiles_${dtype}_${tiles:-engine}.log" 2>&1
        echo "$dtype, attention tiles: ${tiles:-default}"; grep -E "B=64 .*: 8b" "$OUT/tiles_${dtype}_${tiles:-engine}.log" | tail -3
      done; done ;;
    ncu)  # 1 GPU, a Firecracker machine (hardware counters; H200.md): the step's kernels furthest above their floor,
      # timed, then each under Nsight Compute (NCU_TARGETS; full reports in $OUT, key lines here; NCU_STALLS=1: also
      # each stall reason's cycles and the source lines stalled at)
      python3 benchmarks/ncu_targets.py --time --targets ${NCU_TARGETS:-attention,attention_s3,attention_n64,attention_kv8,fp8_gate_up,fp8_down,fp8_silu_quant,fp8_norm_quant} \
        2>&1 | grep "|"
      for t in $(echo ${NCU_TARGETS:-attention,attention_s3,attention_n64,attention_kv8,fp8_gate_up,fp8_down,fp8_silu_quant,fp8_norm_quant} | tr , " "); do
        timeout ${NCU_S:-120} ncu --clock-control none -k regex:"_decode_kernel|_decode_split_kernel|_decode_gemm_kernel|_quant_kernel" --launch-skip 2 \
          --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
          --section MemoryWorkloadAnalysis --section SchedulerStats python3 benchmarks/ncu_targets.py --targets $t \
          > "$OUT/ncu_$t.txt" 2>&1
        echo "--- $t"; grep -E "^  [^ ]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Per Block|Block Limit|Waves Per SM|Issued Warp|Eligible Warps|No Eligible|Warp Cycles Per Issued" \
          "$OUT/ncu_$t.txt" | head -30
        if [ "${NCU_STALLS:-0}" = 1 ]; then  # cycles a warp waits per issued instruction, by stall reason, and the
          # source lines the sampled warps stalled at most (SourceCounters)
          timeout ${NCU_S:-120} ncu --clock-control none -k regex:"_decode_kernel|_decode_split_kernel|_decode_gemm_kernel|_quant_kernel" \
            --launch-skip 2 --launch-count 1 --section SourceCounters \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
            python3 benchmarks/ncu_targets.py --targets $t > "$OUT/ncu_stalls_$t.txt" 2>&1
          grep -E "issue_stalled" "$OUT/ncu_stalls_$t.txt" | awk '{v = $NF; gsub(",", "", v); if (v + 0 >= 0.1) print v, $1}' \
            | sort -g -r | head -8
        fi
      done ;;
    tiles)  # 1 GPU: the fused linear's tiles swept per projection, one adapter (TILE_DTYPES, TILE_KINDS)
      timeout ${BENCH_S:-300} python3 benchmarks/fused_tiles.py --dtypes ${TILE_DTYPES:-bf16,fp8} \
        --kinds "${TILE_KINDS:-q|k|v,o,gate|up,down}" 2>&1 | grep "|" ;;
    taxengine)  # 1 GPU: the bf16 8B's one-adapter tax: base, one adapter (the fused linear);
      # TAX_WORKLOADS=base,base+dgt,one splits it as in BENCHMARKS (our decode GEMM against cuBLAS)
      timeout ${STAGE_S:-330} python3 benchmarks/engine_throughput.py --models 8b --no-hotswap --hf-models '' \
        --budget-s ${BUDGET_S:-270} --workloads ${TAX_WORKLOADS:-base,one} --max-tokens ${MAX_TOKENS:-64} \
        --out "$OUT/et8b_taxsplit.md" > "$OUT/taxsplit.log" 2>&1; grep -E "B=64 .*: 8b" "$OUT/taxsplit.log" | tail -6 ;;
    metaprof)  # 1 GPU: the one-launch adapter metadata's GPU tests, then (if they passed) the bf16 8B's traced
      # decode step with the metadata from the torch ops and from one launch
      if test_files 150 "-m gpu" tests/kernels/test_metadata.py | tee /dev/stderr | grep -q " passed" \
         && ! grep -q "failed" "$OUT/test_metadata.log"; then
        for build in torch one-launch; do
          timeout ${STAGE_S:-200} python3 benchmarks/step_profile.py --kernels --in-graphs --dtype bfloat16 \
            --workloads base,one --steps 20 --top ${TOP:-20} --metadata $build > "$OUT/profile_meta_$build.log" 2>&1
          tail -$((${TOP:-20} + 3)) "$OUT/profile_meta_$build.log"
        done
      fi ;;
    prefix) python3 benchmarks/prefix_cache.py --model 1b 2>&1 | tail -25 ;;
    quality) python3 benchmarks/fp8_quality.py --shape 8b 2>&1 | tail -20 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
