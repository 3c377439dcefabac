#!/usr/bin/env bash
# One device call for a whole GPU check (the device tool allows 10 minutes a call):
#   1) a call carrying .fa4a:   mkdir -p /root/fa4 && cp .fa4a/* /root/fa4/
#   2) within 30 s, a call carrying .fa4b and .gpudeps:   bash benchmarks/gpu_session.sh tests|kernel|kernel2|d64|bench|bench1|bench2|retune|retuneshards|prefillfloor|kernelab|kvprocs|timing|quick|hostbound|overhead|probe|e100|kvappend|e101|e102sweep|patchab|features|probe512|d512fwd|d512|ncu|decode|decodeab|rows|fa4host|parallel|fuzz|xformers [SHA]
# (prepare those folders here with ../shared/gpu/fetch-deps.sh and ../shared/gpu/fetch-fa4.sh).
# A call carries at most 64 MiB with the working tree: when .fa4a or .fa4b with .gpudeps no longer
# fit, move .fa4a's wheels to a third ignored folder and copy them, unpacking .gpudeps, in a call
# between the two (`cp <folder>/* /root/fa4/ && source .gpudeps/gpu-env.sh`); the last call then
# carries .fa4b alone and starts with `export PYTHONPATH=/tmp/gpudeps` (gpu-env.sh's unpack).
# Issue these calls one at a time and check each rc: a refused call (tree + carry over 64 MiB, session
# 19) does not stop the next, which then runs without flash-attn 4. Raw grids stay gzipped for this.
# Everything lands under $OUT; the last lines printed are the short summary.
# SHA: pass this machine's `git rev-parse --short HEAD`; the device's copy of .git can lag the
# working tree it runs (session 10: it reported the previous session's commit).
set -uo pipefail
what=${1:-quick}
sha=${2:-unknown}
out=${OUT:-/tmp/out}
mkdir -p "$out"
source .gpudeps/gpu-env.sh
source .fa4b/fa4-env.sh || echo "flash-attn 4 not prepared: its rows and tests are skipped"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
# pytest for the summaries below: each failure's assertion message on one line (--tb=line), the FAILED and
# ERROR lines (-rfE) 300 columns wide; run under `timeout -s INT`, so a run cut by its limit still prints them
pytest_lines="env COLUMNS=300 python3 -m pytest -m gpu -q -rfE --tb=line -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::UserWarning"
# a summary's lines of $pytest_lines logs: each log's last line, each FAILED or ERROR line, and each failure's
# message ("file.py:N: Error: message"), cut at 600 characters
test_lines() {
  tail -qn1 "$@"
  grep -h -E "^(FAILED|ERROR) " "$@" | cut -c1-300 | head -12
  grep -h -E "^[^ ]+\.py:[0-9]+: " "$@" | cut -c1-600 | head -12
}
# features.py lines ("<turn> bf16 ...", a turn = a tree's name and 1 or 2): each variant's ms and x of plain
# per turn, then the median of each tree's turns
features_medians() {
  python3 - "$1" <<'EOF'
import collections, statistics, sys
ratios, ms = collections.defaultdict(list), collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    c = "causal" in f  # the label has one more word
    key = ("causal" if c else "dense", f[6 + c], f[7 + c], f[0].rstrip("12"))
    ratios[key].append(float(f[12 + c].lstrip("x")))
    ms[key].append(float(f[8 + c]))
for (band, mode, name, tree), xs in sorted(ratios.items()):
    t = " ".join(f"{m:.3f}" for m in ms[(band, mode, name, tree)])
    print(f"{band:6s} {mode:8s} {name:9s} {tree:7s} ms {t}  x of plain {' '.join(f'{x:.3f}' for x in xs)}"
          f"  median {statistics.median(xs):.3f}")
EOF
}
# a scratch copy of the working tree at $1 (not git archive: the device's .git can lag the tree, see SHA above)
# with the patch $2 applied
scratch_copy() {
  rm -rf "$1" && mkdir -p "$1" && tar --exclude='./.*' -cf - . | tar -x -C "$1" && (cd "$1" && git apply "$2")
}
# one untimed features.py round in each tree ($3...) for the bands $2 ("dense causal") and variants $1, in the
# background (the caller waits): the timed turns then find their kernels compiled
features_warm() {
  local variants=$1 bands=$2 dir band; shift 2
  for dir in "$@"; do
    for band in $bands; do
      (cd "$dir" && timeout 200 python3 benchmarks/features.py --rounds 1 --budget 0 --variants "$variants" \
         $([ "$band" = causal ] && echo --causal) > /dev/null 2>&1) &
    done
  done
}
# features.py turns of an A/B into $1 (the lines features_medians reads): variants $2, past $3 s of this call
# the turns left are skipped (a line in $summary), bands $4, then the turns as NAME=DIR in their order
features_turns() {
  local file=$1 variants=$2 limit=$3 bands=$4 band spec; shift 4
  for band in $bands; do
    for spec in "$@"; do
      [ $SECONDS -gt "$limit" ] && { echo "$band ${spec%%=*}: skipped (time)" >> "$summary"; continue; }
      local log=$out/features_turn.log  # $out: one per GPU under `parallel`
      (cd "${spec#*=}" && timeout 100 python3 benchmarks/features.py --rounds 2 --budget 20 --variants "$variants" \
         $([ "$band" = causal ] && echo --causal)) > "$log" 2>&1
      # a turn without its lines says why in the summary (session 41: a rejected --variants printed nothing)
      grep -a "^bf16" "$log" | sed "s/^/${spec%%=*} /" >> "$file" \
        || echo "$band ${spec%%=*}: no lines: $(grep -a -v -i warn "$log" | tail -1 | cut -c1-300)" >> "$summary"
    done
  done
}
case "$what" in
  tests)     # the adapters and the capability claims (the kernel's own tests: `kernel`; both together
             # outgrew one call: 102 of ~110 in 570 s at 7a3041f)
    timeout -s INT 570 python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::UserWarning \
      tests/test_adapters.py tests/test_capabilities.py \
      2>&1 | tee "$out/gpu_tests.log" | tail -15 ;;
  bench)     # the full grid alone (kernels compiled first by 8 worker processes: --precompile-workers):
             # a cold grid of 2026-11-23 with Flex at every config took 512 s of its 520 s budget, on a
             # normal host, so the host overhead (`overhead`, ~37 s) has a device call of its own
    timeout 585 python3 benchmarks/bench.py --budget-s 550 --out "$out/bench" --doc "$out/bench/benchmarks.md" \
      --commit "$sha" 2>&1 | tee "$out/bench_stdout.txt" | tail -55 ;;
  bench1|bench2)   # the grid in two device calls (bf16 rows, then fp16 rows + host overhead); merge here with
                   #   python benchmarks/bench.py --from-json <part1>/bench.json <part2>/bench.json
                   # (run them in separate calls or GPUs, never beside tune: see docs/decisions.md)
    # plots and precompile logs stay on the device: a call brings back only ~8 files from $OUT (session 38
    # lost a bench.json that way)
    part=$([ "$what" = bench1 ] && echo bf16- || echo fp16-)
    rm -rf "/tmp/grid_$what"
    timeout 545 python3 benchmarks/bench.py --budget-s 500 --rows "$part" --no-plot --out "/tmp/grid_$what" \
      --doc "$out/benchmarks.md" --commit "$sha" 2>&1 | tee "$out/bench_stdout.txt" | tail -30
    cp "/tmp/grid_$what/bench.json" "$out/"
    if [ "$what" = bench2 ]; then
      timeout 120 python3 benchmarks/overhead.py --json "$out/overhead.json" 2>&1 | tail -9
    fi ;;
  retune)    # the shipped table re-measured: tune's full grid alone on this GPU (~5:30 on an H100; nothing else
             # running on the host: side by side, shards timed flash-attn 4 up to 1.6x slow, docs/decisions.md);
             # commit $OUT/table.json as attention_dispatch/tables/<gpu>-torch<version>.json, then bench1 + bench2
    timeout 560 python3 -m attention_dispatch tune --out "$out/table.json" 2>&1 | tail -3 ;;
  retuneshards) # tune's full grid in TUNE_SHARDS (default 2) parts on this one GPU, each resumed from a committed
             # benchmarks/results/tune-*-shard<k>of<N>.json (tune resumes a file of its own environment; another GPU's
             # is overwritten), one after the other within the call's time; every part finished: merged into
             # $OUT/table.json (commit it as attention_dispatch/tables/<gpu>-torch<version>.json, drop the shards), else
             # commit the $OUT shards over the old ones and call again
    n=${TUNE_SHARDS:-2} finished=1
    for k in $(seq 1 "$n"); do
      shard="$out/tune-shard${k}of${n}.json"
      prev=$(ls benchmarks/results/tune-*-shard"${k}of${n}".json 2>/dev/null | head -1)
      [ -n "$prev" ] && cp "$prev" "$shard"
      left=$((570 - SECONDS))  # timeout 0 would mean no limit
      [ "$left" -gt 10 ] && timeout -s INT "$left" python3 -m attention_dispatch tune --shard "$k/$n" --out "$shard" \
        > "$out/tune_shard$k.log" 2>&1 || finished=0
      grep -E "^tune:" "$out/tune_shard$k.log" 2>/dev/null | tail -2
      [ "$finished" = 1 ] || { echo "shard $k/$n: stopped by the call's time (rc != 0): commit the shards, call again"; break; }
    done
    [ "$finished" = 1 ] && python3 -m attention_dispatch tune --merge "$out"/tune-shard*of"$n".json --out "$out/table.json" 2>&1 | tail -1 ;;
  quick)     # bf16 hdim 128 + feature rows, ~3 minutes
    timeout 300 python3 benchmarks/bench.py --quick --out "$out/bench" --doc "$out/bench/benchmarks.md" --commit "$sha" \
      2>&1 | tee "$out/bench_stdout.txt" | tail -45 ;;
  hostbound) # the S=512 rows, where training calls are host-bound and policy="fastest" chooses between
             # near-ties (experiment 73), the whole grid's timing on 8 rows (~2-3 minutes), then the
             # host overhead (`overhead`, which `bench` no longer runs); then
             # `python benchmarks/fastest_statistics.py <files_at>/hostbound/bench.json` here
    timeout 400 python3 benchmarks/bench.py --budget-s 300 --no-doc --out "$out/hostbound" --commit "$sha" \
      --rows 'bf16-d64-s512-*' 'fp16-d64-s512-*' 'bf16-d128-s512-*' 'fp16-d128-s512-*' \
      2>&1 | tee "$out/hostbound_stdout.txt" | grep -A12 "^targets"
    timeout 60 python3 benchmarks/overhead.py --json "$out/overhead.json" 2>&1 | tail -3 ;;
  kernel)    # the kernel's first half (relaunch cache, dense, head dims, features: 59 tests), then the
             # host overhead; `kernel2` runs the warp-specialised paths and the training plan.
             # In one call all 126 outgrew its 480 s on a slow host (83 ran, session 23)
    timeout ${KERNEL_TESTS_S:-480} python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::UserWarning \
      tests/test_compiled_cache.py tests/test_triton_kernel.py tests/test_compile.py -k "not warp_specialized and not training_plan" \
      2>&1 | tee "$out/gpu_tests.log" | tail -8
    timeout 120 python3 benchmarks/overhead.py --json "$out/overhead.json" 2>&1 | tail -11 ;;
  kernel2)   # the kernel's warp-specialised paths and the training plan's replays
    timeout ${KERNEL_TESTS_S:-560} python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::UserWarning \
      tests/test_triton_kernel.py -k "warp_specialized or training_plan" 2>&1 | tee "$out/gpu_tests.log" | tail -8 ;;
  d64)       # head dim 64's Gluon kernels (experiments 76-81; ~6-8 minutes): their GPU tests against float64,
             # then forward and forward+backward against the tl kernels (and d128's forward, which the
             # forward consumer's code shares)
    timeout -s INT 340 python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::UserWarning \
      tests/test_triton_kernel.py -k "d64 or (warp_specialized and 64) or fused_dq or training_plan" \
      2>&1 | tee "$out/gpu_tests.log" | tail -6
    timeout 240 python3 benchmarks/forward_ab.py --rows "d64,bf16 d128 4k causal,bf16 d128 16k causal" --impls ws,tl,ws-no-fuse,ws-fuse-banded --rounds 5 \
      --json "$out/ab.json" --commit "$sha" 2>&1 | tail -14 ;;
  fuzz)      # trust: test_fuzz.py's gpu items (~250-300 s cold), then FUZZ_SECONDS (default 50) of each random GPU
             # campaign (tests/fuzz_campaign.py: new examples each run; a failure prints the shrunk call).
             # FUZZ_TARGETS: other campaigns than the three below (e.g. gpu_layouts,kv_gpu_layouts); the limit
             # is FUZZ_SECONDS a target plus 40 s
    targets=${FUZZ_TARGETS:-gpu_large,gpu_features,kv_gpu}
    n_targets=$(( $(tr -cd , <<< "$targets" | wc -c) + 1 ))
    timeout -s INT 290 $pytest_lines -rfEs tests/test_fuzz.py > "$out/fuzz_tests.log" 2>&1  # -rfEs: the skips too
    timeout -s INT $(( n_targets * ${FUZZ_SECONDS:-50} + 40 )) python3 tests/fuzz_campaign.py --seconds "${FUZZ_SECONDS:-50}" \
      --chunk 5 --targets "$targets" > "$out/fuzz_campaign.log" 2>&1
    # a Gluon example compiles for 10-20 s: rounds of 2
    timeout -s INT 90 python3 tests/fuzz_campaign.py --seconds "${FUZZ_SECONDS:-50}" --chunk 2 \
      --targets gluon_large >> "$out/fuzz_campaign.log" 2>&1
    grep -v -E "Warning|warn\(|^  out = " "$out/fuzz_campaign.log" | tail -40
    test_lines "$out/fuzz_tests.log"
    grep -h "^SKIPPED" "$out/fuzz_tests.log" | cut -c1-200 | head -6
    grep -h -E "^[a-z_]+: (no failure|FAILED|nothing checked)" "$out/fuzz_campaign.log" ;;
  xformers)  # trust: the xformers adapter on the real library (~2-5 min). The call also carries .gpuxf, which
             # benchmarks/fetch-xformers.sh prepares (xformers' wheel and the CUDA 12 runtime its extensions load:
             # the device has CUDA 13 only); every GPU test naming xformers, then XF_SECONDS (default 60) of each
             # random GPU campaign over xformers alone. Not after flash-attn 4 on the same machine (its flash_attn
             # package, without flash_attn_interface, stops xformers' import): a fresh machine, no .fa4a/.fa4b
    for w in .gpuxf/*.whl; do python3 -m zipfile -e "$w" /tmp/gpuxf; done
    export LD_LIBRARY_PATH=/tmp/gpuxf/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PYTHONPATH=$PYTHONPATH:/tmp/gpuxf
    python3 -c "import attention_dispatch as ad; b = ad.get_backend('xformers'); print('xformers', b.version(), b.unavailable_reason() or 'available')"
    timeout -s INT 200 $pytest_lines -k xformers tests/ > "$out/xformers_tests.log" 2>&1
    timeout -s INT $(( 3 * ${XF_SECONDS:-60} + 40 )) python3 tests/fuzz_campaign.py --seconds "${XF_SECONDS:-60}" \
      --targets gpu_features,gpu_large,gpu_layouts --gpu-backends xformers > "$out/xformers_campaign.log" 2>&1
    grep -v -E "Warning|warn\(" "$out/xformers_campaign.log" | tail -40
    test_lines "$out/xformers_tests.log"
    grep -h -E "^[a-z_]+: (no failure|FAILED|nothing checked)" "$out/xformers_campaign.log" ;;
  overhead)  # sdpa() against F.sdpa and the decision cache on CUDA (~37 s; the issue's host targets)
    python3 benchmarks/overhead.py --json "$out/overhead.json" 2>&1 | tail -12 ;;
  probe)     # experiment 67's diagnostics (~90 s): flash-attn 4 on its layout and through sdpa(), then
             # where a training call's host time goes (S=512)
    timeout 240 python3 benchmarks/fa4_layout.py --json "$out/fa4_layout.json" 2>&1 | grep -v -i warn | tail -20
    timeout 120 python3 benchmarks/host_split.py 512 2>&1 | grep -v -i warn | tail -30 ;;
  e100)      # perf-notes E100's dK/dV+dQ order (docs/experiments/patches/e100-dkdv-fa3-order.patch) in a scratch
             # copy: its warp-specialised GPU tests (four processes: compiling dominates), then fwd+bwd against
             # this tree's Gluon kernels ("base") in interleaved rounds
    # the working tree, not git archive: the device's .git can lag it (see SHA above)
    rm -rf /tmp/e100 && mkdir -p /tmp/e100 && tar --exclude='./.*' -cf - . | tar -x -C /tmp/e100 \
      && patch -d /tmp/e100 -p1 < docs/experiments/patches/e100-dkdv-fa3-order.patch || exit 1
    W="test_gpu_forward_warp_specialized and not inference"
    for sel in "$W and dtype1 and not causal" "$W and dtype1 and causal" "test_gpu_warp_specialized_fused_dq and 128" \
               "test_gpu_warp_specialized_bias or test_gpu_warp_specialized_window"; do
      (cd /tmp/e100 && timeout -s INT 300 python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning \
         -W ignore::UserWarning tests/test_triton_kernel.py -k "$sel" > "$out/e100_$(echo "$sel" | tr -c 'a-z0-9' _).log" 2>&1) &
    done
    wait
    tail -qn1 "$out"/e100_*.log; grep -h "^FAILED" "$out"/e100_*.log | head
    (cd /tmp/e100 && PYTHONPATH=.:$PYTHONPATH timeout 240 python3 benchmarks/forward_ab.py --impls ws,base --ref base \
       --base-module "$OLDPWD/attention_dispatch/kernels/gluon" --rows "bf16 d128 4k,bf16 d128 16k causal" --rounds 5 --json "$out/e100_ab.json" \
       --commit "$sha+e100" 2>&1 | tail -14) ;;
  kvappend)  # issue 34: the one-launch KV append's GPU tests, then the append rows with the append apart
    timeout -s INT 300 python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::UserWarning \
      tests/test_kv_append.py tests/test_kv_prefill.py 2>&1 | tee "$out/gpu_tests.log" | tail -4
    timeout 200 python3 benchmarks/decode.py --rows append,Sq=512 --json "$out/decode_append.json" --commit "$sha" \
      2>&1 | grep -v -i warn | tail -12 ;;
  e101)      # perf-notes E101: the KV-cache forward's length read off each program's first copies
             # (docs/experiments/patches/e101-kv-length-off-path.patch) in a scratch copy: the GPU tests of
             # the KV-cache (LENS_TENSOR) and one-length forwards there, then the chunked-prefill rows, the
             # patched kernels against this tree's ("base") and flash-attn 4 in interleaved rounds
    # the working tree, not git archive: the device's .git can lag it (see SHA above)
    rm -rf /tmp/e101 && mkdir -p /tmp/e101 && tar --exclude='./.*' -cf - . | tar -x -C /tmp/e101 \
      && patch -d /tmp/e101 -p1 < docs/experiments/patches/e101-kv-length-off-path.patch || exit 1
    (cd /tmp/e101 && timeout -s INT 330 python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning \
       -W ignore::UserWarning tests/test_kv_prefill.py tests/test_gluon_one_length.py tests/test_kv_past_lengths.py \
       tests/test_kernel_features.py -k "gluon_route or kv_cache or chunked_prefill or (one_length_forward and 128) or (past_the_lengths and triton)" \
       2>&1 | tee "$out/e101_tests.log" | tail -4)
    (cd /tmp/e101 && PYTHONPATH=.:$PYTHONPATH timeout 200 python3 benchmarks/kv_ab.py --base-module "$OLDPWD/attention_dispatch/kernels/gluon" \
       --rounds 15 --json "$out/e101_ab.json" --commit "$sha+e101" 2>&1 | grep -v -i warn | tail -6) ;;
  e102sweep) # perf-notes E102's LPT group sizes on this tree (forward_ab: ws as shipped, ws-lpt0 the grid's
             # order before 3cac568, ws-lptN groups of N rows) on the causal rows the rule must serve (~3 min)
    timeout 400 python3 benchmarks/forward_ab.py --fwd-only --impls ws,ws-lpt0,ws-lpt8,ws-lpt16,ws-lpt32,ws-lpt64 \
      --ref ws --rows "bf16 d256 512 causal,bf16 d256 4k causal,bf16 d128 512 causal,bf16 d128 2k causal,bf16 d128 4k causal" \
      --rounds 9 --json "$out/e102_sweep.json" --commit "$sha" 2>&1 | grep -v -i warn | tail -8 ;;
  probe512)  # issue 36: the d512 Gluon forward probe's no-loader layout (head-dim-512.md "Probe"), then the shipped
             # loader layout with the tl forward as baseline (~6 minutes)
    P=benchmarks/probe_d512_gluon.py
    for args in "--layout no-loader --mode s-only" "--layout no-loader --mode full" \
                "--layout no-loader --mode full --pv-n 256" "--mode full --baseline"; do
      echo "== $args"; timeout 150 python3 $P $args 2>&1 | grep -v -i warn | tail -4
    done ;;
  d512fwd)   # issue 36: the Gluon d512 forward's GPU tests (tests/test_gluon_d512.py: dense and causal, bf16 and fp16,
             # output, logsumexp and the tl backward through it against float64; test_head_dim_512.py's d512 calls and
             # route), then its forward at B=2 H=16 S=4096 dense and causal through ad.sdpa(backend='triton') against the
             # tl forward (the d512 route off) in the same process (~3-5 minutes)
    timeout -s INT 360 python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::UserWarning \
      tests/test_gluon_d512.py tests/test_head_dim_512.py 2>&1 | tee "$out/gpu_tests.log" | tail -8
    COMMIT=$sha timeout 180 python3 benchmarks/head_dim_512.py --forward 2>&1 | grep -v -i warn | tail -7 \
      | tee "$out/d512fwd_summary.txt" ;;
  d512)      # issue 36's d512 report: head_dim_512.py's table (bf16 B=2 H=16 S=4096 d512, dense and causal, forward and
             # training: ours as routed, PyTorch's efficient and math paths, FlexAttention; ~3-5 minutes)
    COMMIT=$sha OUT=$out timeout 420 python3 benchmarks/head_dim_512.py 2>&1 | grep -v -i warn | tail -16 \
      | tee "$out/d512_summary.txt" ;;
  prefillfloor) # where chunked prefill's gap to flash-attn 4 comes from (issue 34): kv_device_ab.py's rows and its
             # --extra ones (31 waves, not causal, MHA, square causal through the cache path), device-only and idle
    timeout 500 python3 benchmarks/kv_device_ab.py --extra --rounds 5 --json "$out/prefillfloor.json" --commit "$sha" \
      2>&1 | grep -v -i warn | tee "$out/prefillfloor.log" | tail -32 ;;
  patchab)   # a forward kernel patch against this tree: PATCH=docs/experiments/patches/NAME.patch bash gpu_session.sh
             # patchab SHA (E118's A/B). In a scratch copy with the patch: the Gluon forward's GPU tests (routes,
             # features) while both trees' kernels compile, then benchmarks/kv_device_ab.py (the chunked-prefill rows,
             # device-only and from idle, and against flash-attn 4) and features.py plain and softcap, dense and causal,
             # patched and this tree in ABBA turns (~8 minutes); $OUT/patchab_summary.txt. Side by side on several GPUs
             # (`PATCH=... bash gpu_session.sh parallel SHA 0:patchab 1:patchab`): each run has its own scratch copy
             # and logs, so the GPUs give independent repeats. AB_VARIANTS: the features.py variants (plain,softcap).
             # AB_PARTS: which of "tests kv features" run (all by default; "features" for a diagnostic patch whose
             # results are wrong by design, ~5 minutes).
    [ -f "${PATCH:-}" ] || { echo "patchab: set PATCH to a patch file (got '${PATCH:-}')"; exit 2; }
    ab_variants=${AB_VARIANTS:-plain,softcap}  # features.py variants of the turns, e.g. plain,softcap,softcap-large
    ab_parts=" ${AB_PARTS:-tests kv features} "
    dir=/tmp/patchab_gpu${CUDA_VISIBLE_DEVICES:-0}
    scratch_copy "$dir" "$PWD/$PATCH" || exit 1
    if [[ $ab_parts == *" tests "* ]]; then
      (cd "$dir" && timeout -s INT 300 $pytest_lines tests/test_kv_prefill.py tests/test_gluon_one_length.py \
         -k "gluon_route or chunked_prefill or (one_length_forward and 128)" > "$out/patchab_tests_routes.log" 2>&1) &
      # the dense Gluon forward at d128 and d256, plain and with every score feature (softcap, ALiBi, sinks, lse)
      (cd "$dir" && timeout -s INT 300 $pytest_lines tests/test_triton_kernel.py tests/test_kernel_features.py \
         -k "forward_warp_specialized or (gluon and (softcap or bounded or alibi or sinks))" \
         > "$out/patchab_tests_dense.log" 2>&1) &
      # a patch's own GPU tests (e.g. e107b's tests/test_gluon_persistent.py: persistent bit-equal to per-unit)
      for t in $(awk '/^diff --git/ {f = $4} /^new file mode/ && f ~ /^b\/tests\/test_.*\.py$/ {print substr(f, 3)}' "$PATCH"); do
        (cd "$dir" && timeout -s INT 300 $pytest_lines "$t" > "$out/patchab_tests_own_$(basename "$t" .py).log" 2>&1) &
      done
    fi
    features_warm "$ab_variants" "dense causal" "$PWD" "$dir"
    wait
    summary="$out/patchab_summary.txt"
    { nvidia-smi -L | head -1; [[ $ab_parts == *" tests "* ]] && test_lines "$out"/patchab_tests_*.log; } > "$summary"
    # kv_device_ab.py times the tree it runs from: the two trees in turns, 3 rounds a turn (~40 s a turn)
    for spec in patched1="$dir" base1="$PWD" base2="$PWD" patched2="$dir"; do
      [[ $ab_parts == *" kv "* ]] || continue
      [ $SECONDS -gt 380 ] && { echo "kv ${spec%%=*}: skipped (time)" >> "$summary"; continue; }
      (cd "${spec#*=}" && timeout 90 python3 benchmarks/kv_device_ab.py --rows "Sq=512 8k causal,Sq=128" --rounds 3 \
         --json "$out/patchab_kv_${spec%%=*}.json" --commit "$sha ${spec%%=*}" > "$out/patchab_kv_${spec%%=*}.log" 2>&1)
    done
    python3 - "$out" <<'EOF' | tee -a "$summary"
import glob, json, os, statistics, sys
ours = {}  # (row, tree) -> device and idle TFLOP/s of each turn
for f in sorted(glob.glob(os.path.join(sys.argv[1], "patchab_kv_*.json"))):
    tree = os.path.basename(f)[len("patchab_kv_") : -len(".json")].rstrip("12")
    for r in json.load(open(f))["results"]:
        ours.setdefault((r["row"], tree), []).append((r["tflops_device"]["ours"], r["tflops_idle"]["ours"]))
for row in sorted({k[0] for k in ours}):
    p, b = ours.get((row, "patched"), []), ours.get((row, "base"), [])
    if p and b:
        dev = statistics.median(x[0] for x in p) / statistics.median(x[0] for x in b)
        idle = statistics.median(x[1] for x in p) / statistics.median(x[1] for x in b)
        print(f"kv {row:<32} patched / base: device {dev:.3f}  idle {idle:.3f}  (turns, TFLOP/s device/idle: {p} vs {b})")
EOF
    grep -h "vs fa4" "$out"/patchab_kv_*.log | sed 's/^/kv /' >> "$summary"
    if [[ $ab_parts == *" features "* ]]; then
      features_turns "$out/patchab_features.txt" "$ab_variants" 560 "dense causal" patched1="$dir" base1="$PWD" \
        base2="$PWD" patched2="$dir"
      features_medians "$out/patchab_features.txt" | tee -a "$summary"
    fi
    ;;
  kernelab)  # forward kernel patches against this tree in one process (benchmarks/kernel_ab.py: the trees' kernels
             # in rotating turns, KAB_ROUNDS (31) rounds; the drift between patchab's turns cancels): PATCH="p1.patch
             # [p2.patch ...]" bash gpu_session.sh kernelab SHA (each patch a tree B1, B2, ...); without PATCH an A/A
             # run (the same tree twice: the tool's own spread). KAB_CASES: kv (issue 34's chunked-prefill rows),
             # program-cost, one-length (those rows as plain sdpa() calls), fwd (issue 36's plain and softcap
             # forwards), bwd (their backward passes); KAB_ROWS: substrings of the row labels; KAB_TIMER: kernel
             # (CUPTI durations, E148) or b2b.
             # No tests: a patch to adopt still needs patchab's (AB_PARTS=tests)
    b_args=()
    i=0
    for patch in ${PATCH:-}; do
      i=$((i + 1))
      [ -f "$patch" ] || { echo "kernelab: no patch file '$patch'"; exit 2; }
      dir=/tmp/kernelab_gpu${CUDA_VISIBLE_DEVICES:-0}_$i
      scratch_copy "$dir" "$PWD/$patch" || exit 1
      b_args+=(--b "$dir")
    done
    if [ $i -eq 0 ]; then
      dir=/tmp/kernelab_gpu${CUDA_VISIBLE_DEVICES:-0}_aa
      rm -rf "$dir" && mkdir -p "$dir" && cp -r attention_dispatch "$dir/"
      b_args=(--b "$dir")
    fi
    timeout 540 python3 benchmarks/kernel_ab.py "${b_args[@]}" --cases "${KAB_CASES:-kv,fwd}" --rows "${KAB_ROWS:-}" \
      --rounds "${KAB_ROUNDS:-31}" --timer "${KAB_TIMER:-kernel}" --json "$out/kernelab.json" --commit "$sha ${PATCH:-A/A}" 2>&1 | grep -v -i warn | tail -40 ;;
  kvprocs)   # issue 34's rows over several processes (a ratio moved up to ~3% between processes, E144): KVP_N (7)
             # runs of kv_device_ab.py, KVP_ROUNDS (5) rounds each, rows KVP_ROWS, then each ratio against flash-attn 4
             # as the median (min-max) over the runs (--across); ~25 s a run warm. Needs flash-attn 4
    for i in $(seq 1 "${KVP_N:-7}"); do
      timeout 120 python3 benchmarks/kv_device_ab.py --rows "${KVP_ROWS:-Sq=512 8k causal,Sq=128}" \
        --rounds "${KVP_ROUNDS:-5}" --json "$out/kvprocs_$i.json" --commit "$sha" > "$out/kvprocs_$i.log" 2>&1 \
        || echo "run $i: rc $? ($(grep -v -i warn "$out/kvprocs_$i.log" | tail -1 | cut -c1-200))"
    done
    python3 benchmarks/kv_device_ab.py --across "$out"/kvprocs_*.json ;;
  features)  # issue 36's cost table alone on this GPU: benchmarks/features.py plain, softcap, alibi, sinks, lse-grad and
             # flash-attn 4 plain / softcap / sinks, dense then causal (bf16 d128 B4 H16 S=4k, 3 interleaved rounds,
             # ~4-5 minutes); $OUT/features_summary.txt (the lines, then each variant's x of plain); FEATURES_TIMER=kernel:
             # CUPTI kernel durations instead of do_bench (E148)
    summary="$out/features_summary.txt"
    nvidia-smi -L | head -1 > "$summary"
    for band in dense causal; do
      timeout 280 python3 benchmarks/features.py --rounds 3 --budget 200 --timer "${FEATURES_TIMER:-do_bench}" \
        --variants plain,softcap,alibi,sinks,lse-grad,fa4,fa4-softcap,fa4-sinks $([ "$band" = causal ] && echo --causal) \
        > "$out/features_$band.log" 2>&1 || echo "$band: features.py rc $?: $(grep -v -i warn "$out/features_$band.log" | tail -1)" >> "$summary"
      grep -a "^bf16" "$out/features_$band.log" >> "$summary"
    done
    tail -n 40 "$summary" ;;
  timing)    # issue 36's forward rows and issue 34's chunked-prefill rows (ours and flash-attn 4 where prepared) timed
             # six ways (back to back, an event pair a call, flushed, do_bench, sustained with each turn's SM clock and
             # power, the kernels' own CUPTI durations over short bursts) in one process (benchmarks/timing_methods.py;
             # TM_CASES (fwd,kv; train: the forward rows with their backward), TM_WAYS, TM_ROUNDS (6): ~2-3 minutes
             # warm; E147, E148)
    python3 benchmarks/timing_methods.py --cases "${TM_CASES:-fwd,kv}" --ways "${TM_WAYS:-b2b,each,flushed,do_bench,sustained,kernel}" \
      --rounds "${TM_ROUNDS:-6}" --json "$out/timing.json" --commit "$sha" 2>&1 | grep -v -i warn | tail -n 24 ;;
  ncu)       # perf-notes E113 (issues 34, 36): Nsight Compute's ground truth, one call of each benchmarks/ncu_target.py
             # case (plain softcap plain-causal softcap-causal kv-chunk fa4-chunk; NCU_CASES="..." for others, e.g.
             # "plain-train softcap-train softcap-causal-train" for the backward's dK/dV pass): tensor,
             # XU (MUFU), FMA and ALU pipes, issue, occupancy, stall reasons per kernel and per SASS instruction. The
             # cases compile side by side first; then one ncu run a case (clocks left alone), its report exported as
             # raw and source CSV (~5-7 minutes); $OUT/ncu_summary.txt (short table last), $OUT/ncu_csv.tar.gz (CSVs,
             # logs) and $OUT/ncu_reps.tar.gz (the .ncu-rep reports for the GUI, where under 15 MB). A case named
             # CASE@patch runs in a scratch copy with PATCH applied (PATCH=docs/experiments/patches/NAME.patch
             # NCU_CASES="softcap softcap@patch"): the summary sets it beside CASE (why a patch moved what it moved)
    dir=/tmp/ncu summary="$out/ncu_summary.txt" cases=${NCU_CASES:-plain softcap plain-causal softcap-causal kv-chunk fa4-chunk}
    rm -rf "$dir" && mkdir -p "$dir"
    if [[ " $cases" == *@patch* ]]; then
      [ -f "${PATCH:-}" ] || { echo "ncu: a CASE@patch case needs PATCH (got '${PATCH:-}')" | tee "$summary"; exit 2; }
      scratch_copy /tmp/ncu_patched "$PWD/$PATCH" || exit 1
    fi
    tree_of() { [[ "$1" == *@patch ]] && echo /tmp/ncu_patched || echo "$PWD"; }
    ncu_bin=$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | tail -1)
    [ -n "$ncu_bin" ] || { echo "ncu: not found on this machine (PATH, /opt/nvidia/nsight-compute)" | tee "$summary"; exit 1; }
    for c in $cases; do
      (cd "$(tree_of "$c")" && timeout 240 python3 benchmarks/ncu_target.py --case "${c%@patch}" --warm-only \
         > "$dir/warm_$c.log" 2>&1 \
         || echo "$c: warm-up failed (rc $?): $(grep -v -i warn "$dir/warm_$c.log" | tail -1 | cut -c1-200)" >> "$dir/warm_$c.log") &
    done
    "$ncu_bin" --version > "$dir/ncu_version.txt" 2>&1
    # a metric name this ncu lacks would fail every profile: ask only for the names it lists
    timeout 60 "$ncu_bin" --query-metrics > "$dir/query_metrics.txt" 2>&1
    wait
    metrics=$(python3 benchmarks/ncu_metrics.py metrics "$dir/query_metrics.txt")
    for c in $cases; do
      left=$((520 - SECONDS))
      [ $left -lt 40 ] && { echo "skipped: no time left in this call ($SECONDS s)" > "$dir/ncu_$c.log"; continue; }
      (cd "$(tree_of "$c")" && timeout $((left < 150 ? left : 150)) "$ncu_bin" --clock-control none \
        --profile-from-start off --target-processes all $(python3 benchmarks/ncu_metrics.py sections) \
        ${metrics:+--metrics "$metrics"} -f -o "$dir/ncu_$c" python3 benchmarks/ncu_target.py --case "${c%@patch}") \
        > "$dir/ncu_$c.log" 2>&1 || echo "ncu rc $?" >> "$dir/ncu_$c.log"
      [ -f "$dir/ncu_$c.ncu-rep" ] || continue
      "$ncu_bin" -i "$dir/ncu_$c.ncu-rep" --page raw --csv --print-units base > "$dir/ncu_$c.csv" 2>> "$dir/ncu_$c.log"
      "$ncu_bin" -i "$dir/ncu_$c.ncu-rep" --page source --csv --print-source sass > "$dir/ncu_$c.source.csv" \
        2>> "$dir/ncu_$c.log"
    done
    { nvidia-smi -L | head -1; grep -i version "$dir/ncu_version.txt" | head -1
      echo "explicit metrics this ncu knows: $(echo "$metrics" | tr , '\n' | grep -c .)"
      grep -h "warm-up failed" "$dir"/warm_*.log; python3 benchmarks/ncu_summary.py "$dir"/ncu_*; } 2>&1 | tee "$summary"
    (cd "$dir" && tar -czf "$out/ncu_csv.tar.gz" --exclude='*.ncu-rep' .)
    if ls "$dir"/*.ncu-rep > /dev/null 2>&1; then
      (cd "$dir" && tar -czf "$out/ncu_reps.tar.gz" ./*.ncu-rep)
      # a call brings back files of up to 16 MB
      [ "$(stat -c %s "$out/ncu_reps.tar.gz")" -gt 15000000 ] \
        && { rm -f "$out/ncu_reps.tar.gz"; echo "the .ncu-rep reports are over 15 MB: left in $dir on the device"; }
    fi ;;
  decode)    # issue 34's report: benchmarks/decode.py's every row (dense, paged, uneven, append, chunked prefill; ours,
             # the dispatcher, F.sdpa, flash-attn 4, copy) into $OUT/decode.md (commit it as docs/decode.md) and
             # $OUT/decode.json, alone on the GPU (its cells time device loops, but ad.sdpa_with_kvcache's include host time;
             # DECODE_TIMER=kernel: the kernels' CUPTI durations, E148)
    timeout 540 python3 benchmarks/decode.py --doc "$out/decode.md" --json "$out/decode.json" --commit "$sha" \
      --timer "${DECODE_TIMER:-events}" 2>&1 \
      | grep -v -i warn | tail -30 ;;
  decodeab)  # a decode-kernel patch against this tree (E123): PATCH=docs/experiments/patches/NAME.patch bash
             # gpu_session.sh decodeab SHA. In a scratch copy with the patch: the decode GPU tests, then decode.py's rows
             # (DECODE_ROWS, default the append rows) patched and this tree in ABBA turns (~4 minutes);
             # $OUT/decodeab_summary.txt: each row's `ours` TB/s per turn and the patched / base ratio of the medians
    [ -f "${PATCH:-}" ] || { echo "decodeab: set PATCH to a patch file (got '${PATCH:-}')"; exit 2; }
    dir=/tmp/decodeab_gpu${CUDA_VISIBLE_DEVICES:-0} summary="$out/decodeab_summary.txt"
    scratch_copy "$dir" "$PWD/$PATCH" || exit 1
    (cd "$dir" && timeout -s INT 240 $pytest_lines tests/test_kvcache.py tests/test_kv_append.py tests/test_decode_plan.py \
       tests/test_kv_past_lengths.py > "$out/decodeab_tests.log" 2>&1)
    { nvidia-smi -L | head -1; test_lines "$out/decodeab_tests.log"; } > "$summary"
    for spec in patched1="$dir" base1="$PWD" base2="$PWD" patched2="$dir"; do
      [ $SECONDS -gt 500 ] && { echo "${spec%%=*}: skipped (time)" >> "$summary"; continue; }
      (cd "${spec#*=}" && timeout 150 python3 benchmarks/decode.py --rows "${DECODE_ROWS:-append}" \
         --json "$out/decodeab_${spec%%=*}.json" --commit "$sha ${spec%%=*}" > "$out/decodeab_${spec%%=*}.log" 2>&1)
    done
    python3 - "$out" <<'EOF' | tee -a "$summary"
import glob, json, os, statistics, sys
tbs = {}  # (row, tree) -> ours TB/s of each turn
for f in sorted(glob.glob(os.path.join(sys.argv[1], "decodeab_*.json"))):
    tree = os.path.basename(f)[len("decodeab_") : -len(".json")].rstrip("12")
    for r in json.load(open(f))["rows"]:
        tbs.setdefault((r["row"], tree), []).append(r["ours_tbs"])
for row in sorted({k[0] for k in tbs}):
    p, b = tbs.get((row, "patched"), []), tbs.get((row, "base"), [])
    if p and b:
        print(f"{row:<32} patched / base {statistics.median(p) / statistics.median(b):.3f}  (TB/s {p} vs {b})")
EOF
    ;;
  rows)      # grid rows re-measured alone (issue 35: a row a side-by-side run disturbed), e.g.
             #   bash gpu_session.sh rows SHA bf16-d256-s512-causal fp16-d256-s512-causal   (~1-2 min a row)
    shift 2
    timeout 540 python3 benchmarks/bench.py --rows "$@" --no-doc --no-plot --budget-s 480 --out /tmp/rows \
      --commit "$sha" 2>&1 | grep -v -i warn | tail -20
    cp /tmp/rows/bench.json "$out/" ;;
  fa4host)   # issue 35: flash-attn 4's host time per call through our relaunch, split (~30 s)
    timeout 120 python3 benchmarks/fa4_host_probe.py 2>&1 | grep -v -i warn | tail -9 ;;
  parallel)  # kernel-against-kernel A/Bs side by side on a multi-GPU host, one GPU each: bash gpu_session.sh
             # parallel SHA 0:e103 1:e102sweep,e101 2:probe512 3:fa4host,e102. Never tune or the grid this way
             # (side by side, flash-attn 4's host-heavy calls slow down: perf-notes E104). Brings back each GPU's
             # log and the modes' *summary* files (a call returns ~8 files); the rest stays in /tmp/par.
    shift 2
    rm -rf /tmp/par
    for job in "$@"; do
      gpu=${job%%:*}
      (
        for mode in $(echo "${job#*:}" | tr , ' '); do
          echo "=== $mode on GPU $gpu"
          CUDA_VISIBLE_DEVICES=$gpu OUT=/tmp/par/gpu$gpu/$mode bash "$0" "$mode" "$sha" 2>&1
        done > "$out/gpu$gpu.log"
      ) &
    done
    wait
    # one file per GPU and mode: the same mode on several GPUs writes the same summary name
    for f in /tmp/par/gpu*/*/*summary*; do [ -f "$f" ] && cp "$f" "$out/$(echo "${f#/tmp/par/}" | tr / _)"; done
    for log in "$out"/gpu*.log; do echo "##### $log"; grep -v -i warn "$log" | tail -25; done ;;
  *) echo "usage: $0 tests|kernel|kernel2|d64|bench|bench1|bench2|retune|retuneshards|prefillfloor|kernelab|kvprocs|timing|quick|hostbound|overhead|probe|e100|kvappend|e101|e102sweep|patchab|features|probe512|d512fwd|d512|ncu|decode|decodeab|rows|fa4host|parallel|fuzz|xformers [SHA]"; exit 2 ;;
esac
