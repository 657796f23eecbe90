#!/usr/bin/env bash
# The GPU acceptance runs in one device call, stage by stage, each under its own time limit; every log in $OUT/logs.tgz, a
# one-line result per stage at the end (the numbers a closing note cites come from these logs).
#   STAGES="tests dist diagnose train1 train2 bench" bash tools/gpu_acceptance.sh
# Stages:
#   gate      the GPU test each waiting kernel waits for (minite.strict.fused.WAITS_FOR), one pytest run each;
#             $OUT/gate.txt says "passed NAME" or "failed NAME" (a test that skipped has not passed). With
#             GATE_ROUTE="name,..." the later stages of this run route the named ones that passed
#             (MINITE_TRY_KERNELS, which the benchmarks' commit then names: tools/bench/provenance.py)
#   tests     every `gpu`-marked test, plus the kernel and op-kernel tests compiled on the GPU
#   dist      the distributed tests (`distributed` marker) over NCCL: TP/EP/DP=2 vs one GPU, checkpoint/resume, strict EP=2
#   diagnose  strict mode on a medium model (hidden 1024, 4 layers, 32 experts): `minite diagnose --fail-above 0`
#   train1    `minite train examples/h200/moe-nvfp4.yaml` on one GPU (TRAIN_STEPS RL steps), then its strict twin
#   train2    `tools/launch/torchrun.sh examples/h200/moe-ep2-nvfp4.yaml` on two GPUs (EP=2)
#   killresume  the tiny job with EP=2 on two ranks: an uninterrupted run, and the same run killed (SIGKILL to every
#             rank) after its 5th step and resumed; tools/compare_runs.py compares metrics and checkpoints bitwise
#   bench     tools/bench/bench_rl_step.py rows into $OUT/rl-step-$CARD.json (one GPU and EP=2; BF16/NVFP4, strict)
#   slice     tools/bench/bench_learner_slice.py on one GPU: one sequence and the RL-sized 8-sequence step
#   block     tools/bench/bench_nvfp4.py --sections block: the expert-block quantisation kernels and their ratios
#             (not in the default STAGES)
#   scale     the same with EP over NPROC GPUs (one sequence per GPU), against the slice stage's one-GPU rows
#   sync      tools/bench/bench_weight_sync.py: learner -> engine weight sync vs a device copy (EP too with SYNC_EP=1,
#             EP alone with SYNC_EP=only)
#   rollout   tools/bench/bench_rollout.py: decode step against its HBM floor (BATCHES, default 64,1,8,256;
#             ROLLOUT_ARGS: more of its arguments, e.g. "--repeats 3 --precisions nvfp4")
#   ab        a waiting kernel's worth: bench_rollout.py's default-mode rows without and with the kernels GATE_ROUTE
#             routed (the gate stage passed them), alternating AB_ROUNDS times (default 2) on this machine (BATCHES,
#             default 64,8,1 here); one file, $OUT/rollout-ab-$CARD.json (tools/bench/merge_runs.py), each row with
#             its `run` (off1, on1, ...). E.g. STAGES="gate ab" GATE_ROUTE=qk_norm_rope bash tools/gpu_acceptance.sh
#             (not in the default STAGES)
#   lengths   tools/bench/bench_rollout_lengths.py: responses that end at different lengths, with and without the
#             stop and the compaction (LENGTHS_ARGS; not in the default STAGES)
#   (SLICE_ARGS, SCALE_ARGS, SYNC_ARGS: more arguments of those benchmarks, e.g. "--profile 25" or "--precisions nvfp4")
#   sglang    tools/sglang_gpu_probe.sh (needs .sglwhl/ carried): how far SGLang's GPU path runs with the plugin
#             (SGLANG_ARGS: more probe arguments, e.g. "--phases graphs,eager")
# The device has no registry: megatron-core travels as a wheel in .whl/ (carried with the call), installed to
# /tmp/site; kernels/ and megatron_patches/ are linked into minite/ as setup.py installs them.
set -uo pipefail
OUT=${OUT:-/tmp/out}; LOGS=${LOGS:-/tmp/acceptance-logs}; mkdir -p "$OUT" "$LOGS"
STAGES=${STAGES:-gate tests dist diagnose train1 train2 killresume bench slice scale sync rollout sglang}
TRAIN_STEPS=${TRAIN_STEPS:-60}
NPROC=${NPROC:-2}  # ranks of the multi-rank stages
python3 -c "import megatron.core" 2>/dev/null ||  # the device: no megatron-core until the carried wheel is in
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  >"$LOGS/pip.log" 2>&1 || { echo "wheel install failed"; cat "$LOGS/pip.log"; exit 1; }
if ! python3 -c "import minite.kernels, minite.megatron_patches" 2>/dev/null; then  # not installed (the device)
  [ -e minite/kernels ] || ln -s ../kernels minite/kernels
  [ -e minite/megatron_patches ] || ln -s ../megatron_patches minite/megatron_patches
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 MINITE_COMMIT=${MINITE_COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOGS/device.txt"
# the card's model names the benchmark files ($OUT/rollout-h200.json on an H200, -h100 on an H100): a lent machine
# may be another card than asked for, and its numbers never go into an H200 file (docs/benchmarks.md)
CARD=$(head -n 1 "$LOGS/device.txt" | grep -o 'H[0-9]\+' | head -n 1 | tr 'H' 'h'); CARD=${CARD:-gpu}
export CARD; echo "benchmark files: *-$CARD.json"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" \
  | tee -a "$LOGS/device.txt"
MEDIUM="--set model.vocab_size=8192 --set model.hidden_size=1024 --set model.num_layers=4 --set model.num_attention_heads=16
 --set model.num_query_groups=4 --set model.head_dim=64 --set model.num_experts=32 --set model.moe_router_topk=4
 --set model.moe_ffn_hidden_size=512 --set model.max_position_embeddings=256"
SUMMARY=()
stage() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return ;; esac
  local t0=$SECONDS
  # every process of the stage inherits this tag, also torchrun's workers, which run in sessions of their own and
  # outlive a timeout of their launcher (still on the GPUs for the next stage's measurement): they are found by it
  export MINITE_STAGE_TAG="$name-$$-$RANDOM"
  if declare -F "$1" >/dev/null; then  # a function of this script: run it in a child bash that knows it
    export -f "$1" rewards; export OUT LOGS GPU_TESTS GPU_TESTS_K ROLLOUT_ARGS LENGTHS_ARGS DIST_TESTS TRAIN_STEPS TRAIN1_SETS TRAIN2_SETS SYNC_EP BATCHES SGLANG_BUDGET SGLANG_ARGS NPROC BENCH_1GPU BENCH_EP2 SYNC_ARGS SLICE_ARGS SCALE_ARGS AB_ROUNDS
    timeout "$limit" bash -c "$*" >"$LOGS/$name.log" 2>&1
  else
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  fi
  local rc=$?
  kill_leftovers "$MINITE_STAGE_TAG" "$name" >>"$LOGS/$name.log" 2>&1
  SUMMARY+=("$name rc=$rc $((SECONDS - t0))s: $(grep -E 'passed|failed|error|max \|logp|reward|scaling|same|DIFFERENT|sync_over|nvfp4_over|render|engine' "$LOGS/$name.log" | tail -1)")
  echo "== $name rc=$rc $((SECONDS - t0))s"; tail -n 4 "$LOGS/$name.log"
}
kill_leftovers() {  # tag, stage: SIGKILL every process still carrying the stage's tag (a timed-out stage's workers)
  local p n=0
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = "$$" ] && continue
    if { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qx "MINITE_STAGE_TAG=$1"; then kill -KILL "${p#/proc/}" 2>/dev/null && n=$((n + 1)); fi
  done
  [ "$n" = 0 ] || echo "== $2: killed $n leftover processes of the stage"
}
rewards() {  # metrics.jsonl -> mean reward of the first and last 5 RL steps, max |gap| over all steps
  python3 - "$1" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
r = [x["reward/mean"] for x in rows]
gap = max(x["mismatch/logp_abs_max"] for x in rows)
w = max(rows, key=lambda x: x["mismatch/logp_abs_max"])
if "mismatch/max_at_train_logp" in w:
    print(f"largest gap at step {w['step']}: learner logp {w['mismatch/max_at_train_logp']:.3f}, rollout "
          f"{w['mismatch/max_at_rollout_logp']:.3f}, response position {w['mismatch/max_at_position']:.0f}; tokens over "
          f"1 nat per step: {[int(x['mismatch/tokens_over_1']) for x in rows]}")
differ = [x["rollout/rows_differ"] for x in rows if "rollout/rows_differ" in x]  # multi-rank runs only
print(f"steps {len(rows)}  reward first5 {sum(r[:5]) / 5:.3f}  last5 {sum(r[-5:]) / 5:.3f}  max |logp gap| {gap:.3e}"
      f"  step_s median {sorted(x['time/step_s'] for x in rows)[len(rows) // 2]:.2f}"
      + (f"  rows_differ max {max(differ)} (steps with any: {sum(d > 0 for d in differ)})" if differ else ""))
EOF
}
gate() {  # each waiting name's GPU test; passed only on a GPU, where pytest's summary says passed (and warnings) alone
  # (tools/pytest_verdict.py: the summary line wherever it is; a warning printed at exit once made a pass a failure)
  local name node out result passed=() failed=()
  python3 -c "from minite.strict import fused; print('\n'.join(f'{n} {t}' for n, t in sorted(fused.WAITS_FOR.items())))" \
    >"$LOGS/gate-nodes.txt" || return 1
  : >"$OUT/gate.txt"
  local cuda=1; python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || { cuda=0; echo "no CUDA device"; }
  while read -r name node; do
    [ -n "$name" ] || continue  # (an empty node id would make pytest collect everything)
    echo "== $name: $node"
    out=$(set -f; python3 -m pytest -q -p no:cacheprovider -rA $node 2>&1); echo "$out"  # one or more node ids
    if [ "$cuda" = 1 ] && python3 tools/pytest_verdict.py <<<"$out"; then
      result=passed; passed+=("$name")
    else result=failed; failed+=("$name"); fi
    echo "$result $name" >>"$OUT/gate.txt"
  done <"$LOGS/gate-nodes.txt"
  echo "gate: passed ${passed[*]:--}; failed ${failed[*]:--}"
  [ ${#failed[@]} = 0 ]
}
gpu_tests() {  # GPU_TESTS: pytest arguments of a shorter selection instead
  if [ -n "${GPU_TESTS:-}" ]; then
    python3 -m pytest -q -p no:cacheprovider -rs $GPU_TESTS ${GPU_TESTS_K:+-k "$GPU_TESTS_K"}; return
  fi
  python3 -m pytest -q -p no:cacheprovider -rs tests/kernels tests/ops/test_ops_kernels.py
  local a=$?
  python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests --ignore=tests/kernels
  return $(( a || $? ))
}
stage gate ${T_GATE:-240} gate
case " $STAGES " in *" gate "*) gate_ran=1 ;; *) gate_ran=0 ;; esac
if [ -n "${GATE_ROUTE:-}" ] && [ "$gate_ran" = 1 ]; then  # the named kernels whose test passed here, for the stages below
  for n in ${GATE_ROUTE//,/ }; do
    grep -q " $n$" "$OUT/gate.txt" || echo "== gate: GATE_ROUTE names $n, which waits for no test"
  done
  MINITE_TRY_KERNELS=$(for n in ${GATE_ROUTE//,/ }; do grep -qx "passed $n" "$OUT/gate.txt" && echo "$n"; done | paste -sd, -)
  export MINITE_TRY_KERNELS; echo "== gate: the stages below route MINITE_TRY_KERNELS=${MINITE_TRY_KERNELS:-(none)}"
elif [ -n "${GATE_ROUTE:-}" ]; then
  echo "== gate: GATE_ROUTE without the gate stage in STAGES: nothing routed"
fi
stage tests ${T_TESTS:-300} gpu_tests
DIST_TESTS=${DIST_TESTS:-tests/learner tests/rl tests/alignment}
stage dist ${T_DIST:-240} python3 -m pytest -q -p no:cacheprovider -rs -m distributed $DIST_TESTS
stage diagnose ${T_DIAG:-120} python3 -m minite.cli diagnose --config examples/tiny/nvfp4.yaml --b embedded $MEDIUM \
  --set alignment.strict=true --json "$LOGS/diagnose-strict-medium.json" --fail-above 0
train1() {
  python3 -m minite.cli train examples/h200/moe-nvfp4.yaml --fresh --set rl.steps="$TRAIN_STEPS" \
    --set logging.dir=/tmp/r1 --set checkpoint.dir=/tmp/r1/ck ${TRAIN1_SETS:-} && rewards /tmp/r1/metrics.jsonl &&
  python3 -m minite.cli train examples/h200/moe-nvfp4.yaml --fresh --set rl.steps=8 --set alignment.strict=true \
    --set logging.dir=/tmp/r1s --set checkpoint.dir=/tmp/r1s/ck ${TRAIN1_SETS:-} && rewards /tmp/r1s/metrics.jsonl
}
stage train1 ${T_TRAIN:-300} train1
train2() {
  NPROC_PER_NODE=2 LOG_DIR=/tmp/logs2 tools/launch/torchrun.sh examples/h200/moe-ep2-nvfp4.yaml --fresh \
    --set rl.steps="$TRAIN_STEPS" --set logging.dir=/tmp/r2 --set checkpoint.dir=/tmp/r2/ck ${TRAIN2_SETS:-} &&
    rewards /tmp/r2/metrics.jsonl
}
stage train2 ${T_TRAIN:-300} train2
killresume() {
  local args="examples/tiny/nvfp4.yaml --set parallel.ep=2 --set rl.steps=10 --set rl.warmup_steps=2 --set checkpoint.every=3"
  rm -rf /tmp/kr
  NPROC_PER_NODE=$NPROC LOG_DIR=/tmp/kr/logs-a tools/launch/torchrun.sh $args --fresh --set logging.dir=/tmp/kr/a \
    --set checkpoint.dir=/tmp/kr/a/ck || return 1
  NPROC_PER_NODE=$NPROC LOG_DIR=/tmp/kr/logs-b tools/launch/torchrun.sh $args --fresh \
    --set logging.dir=/tmp/kr/b --set checkpoint.dir=/tmp/kr/b/ck & local pid=$!
  until [ "$(cat /tmp/kr/b/metrics.jsonl 2>/dev/null | wc -l)" -ge 5 ]; do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  # torchrun's workers run in sessions of their own: SIGKILL every process of the run (as a lost node would)
  pkill -KILL -f "logging.dir=/tmp/kr/b"; wait $pid
  local logged; logged=$(wc -l < /tmp/kr/b/metrics.jsonl)
  echo "killed after $logged logged steps; checkpoints: $(ls /tmp/kr/b/ck)"
  [ "$logged" -lt 10 ] || { echo "the kill came too late: the run had finished"; return 1; }
  NPROC_PER_NODE=$NPROC LOG_DIR=/tmp/kr/logs-c tools/launch/torchrun.sh $args --set logging.dir=/tmp/kr/b \
    --set checkpoint.dir=/tmp/kr/b/ck || return 1
  python3 tools/compare_runs.py /tmp/kr/a /tmp/kr/b
}
stage killresume ${T_KILL:-240} killresume
bench() {
  # rows merge into the committed file's (each row names its commit); BENCH_1GPU / BENCH_EP2: which rows to measure
  [ ! -e "docs/benchmarks/rl-step-$CARD.json" ] || cp "docs/benchmarks/rl-step-$CARD.json" "$OUT/rl-step-$CARD.json"
  local few="--set rl.warmup_steps=1 --steps 3 --skip 1 --out $OUT/rl-step-$CARD.json" run
  for run in ${BENCH_1GPU-nvfp4 bf16 nvfp4,strict}; do
    python3 tools/bench/bench_rl_step.py examples/h200/moe-nvfp4.yaml --set precision.mode=${run%,strict} \
      $([ "${run#*,}" = strict ] && echo --set alignment.strict=true) $few || return 1
  done
  for run in ${BENCH_EP2-nvfp4 bf16 nvfp4,strict}; do
    python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" tools/bench/bench_rl_step.py \
      examples/h200/moe-ep2-nvfp4.yaml --set precision.mode=${run%,strict} \
      $([ "${run#*,}" = strict ] && echo --set alignment.strict=true) $few || return 1
  done
  python3 tools/bench/bench_rl_step.py --render "$OUT/rl-step-$CARD.json"
}
stage bench ${T_BENCH:-300} bench
slice() {  # the learner slice on one GPU: one 4096-token sequence and the RL-sized 8 x 4096 step, BF16 and NVFP4
  TORCHDYNAMO_DISABLE=1 python3 tools/bench/bench_learner_slice.py --layers 4 --seq 4096 --steps 3 --warmup 1 \
    --micro-batches 1,8 ${SLICE_ARGS:-} --out "$OUT/learner-slice-$CARD.json"
}
stage slice ${T_SLICE:-200} slice
block() {  # the expert-block section of the kernel benchmark (quant_dyT_rht_sr, quant_aT_rht and the block ratios)
  TORCHDYNAMO_DISABLE=1 python3 tools/bench/bench_nvfp4.py --sections block --out "$OUT/kernels-block.json"
}
stage block ${T_BLOCK:-90} block
scale() {  # EP over NPROC GPUs, one sequence per GPU, against the one-GPU rows of the slice stage
  TORCHDYNAMO_DISABLE=1 python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    tools/bench/bench_learner_slice.py --ep "$NPROC" --layers 4 --seq 4096 --steps 3 --warmup 1 ${SCALE_ARGS:-} \
    --out "$OUT/slice-ep$NPROC.json" &&
  python3 - "$OUT/learner-slice-$CARD.json" "$OUT/slice-ep$NPROC.json" <<'EOF'
import json, sys
one, many = (json.load(open(f)) for f in sys.argv[1:3])
one = {r["precision"]: r for r in one["rows"] if r.get("micro_batches", 1) == 1 and "error" not in r}
for b in many["rows"]:
    a = one[b["precision"]]
    print(f"{b['precision']}: learner scaling {b['tokens_per_s'] / a['tokens_per_s']:.3f}x ({a['tokens_per_s']:.0f} -> "
          f"{b['tokens_per_s']:.0f} tokens/s; fwd+bwd {a['fwd_bwd_s']:.3f} -> {b['fwd_bwd_s']:.3f} s)")
EOF
}
stage scale ${T_SCALE:-200} scale
syncbench() {
  if [ "${SYNC_EP:-0}" != only ]; then
    TORCHDYNAMO_DISABLE=1 python3 tools/bench/bench_weight_sync.py --layers 4 ${SYNC_ARGS:-} --out "$OUT/sync-1gpu.json" ||
      return 1
  fi
  [ "${SYNC_EP:-0}" != 0 ] || return 0
  TORCHDYNAMO_DISABLE=1 python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    tools/bench/bench_weight_sync.py --ep "$NPROC" --layers 4 ${SYNC_ARGS:-} --out "$OUT/sync-ep$NPROC.json"
}
stage sync ${T_SYNC:-120} syncbench
rollout() {  # issue 16's decode benchmark (the 4-layer full-width slice) and its deferred NaN/Inf check's GPU tests
  TORCHDYNAMO_DISABLE=1 python3 tools/bench/bench_rollout.py --batches "${BATCHES:-64,1,8,256}" ${ROLLOUT_ARGS:-} \
    --out "$OUT/rollout-$CARD.json" && python3 tools/bench/bench_rollout.py --render "$OUT/rollout-$CARD.json"
}
stage rollout ${T_ROLLOUT:-240} rollout
rollout_ab() {  # the default-mode rollout rows with the kernels the gate routed and without, alternating on this machine
  [ -n "${MINITE_TRY_KERNELS:-}" ] || { echo "ab: nothing routed (GATE_ROUTE, the gate stage passing it)"; return 1; }
  local r side try files=()
  for r in $(seq 1 "${AB_ROUNDS:-2}"); do
    for side in off on; do  # off: MINITE_TRY_KERNELS empty for the run (the kernels wait, as shipped)
      if [ $side = off ]; then try=""; else try=$MINITE_TRY_KERNELS; fi
      MINITE_TRY_KERNELS=$try TORCHDYNAMO_DISABLE=1 python3 tools/bench/bench_rollout.py --batches "${BATCHES:-64,8,1}" \
        --no-reference --modes default ${ROLLOUT_ARGS:-} --out "$LOGS/ab-$side$r.json" || return 1
      files+=("$LOGS/ab-$side$r.json")
    done
  done
  python3 tools/bench/merge_runs.py "$OUT/rollout-ab-$CARD.json" "${files[@]}"
}
stage ab ${T_AB:-400} rollout_ab
lengths() {  # issue 16: a finished response stops costing (minite/rollout/decode.py's stop and compaction)
  TORCHDYNAMO_DISABLE=1 python3 tools/bench/bench_rollout_lengths.py ${LENGTHS_ARGS:-} \
    --out "$OUT/rollout-lengths-$CARD.json"
}
stage lengths ${T_LENGTHS:-240} lengths
sglangprobe() {  # SGLang 0.5.23 with the plugin on the GPU, as far as it goes without sgl-kernel (docs/sglang.md)
  bash tools/sglang_gpu_probe.sh "$LOGS/sglang" "${SGLANG_BUDGET:-150}" ${SGLANG_ARGS:-}; cp "$LOGS/sglang/probe.json" "$OUT/"
}
stage sglang ${T_SGLANG:-200} sglangprobe
echo "== summary"; { cat "$LOGS/device.txt"; printf '%s\n' "${SUMMARY[@]}"; } | tee "$OUT/summary.txt"
# every log (stage logs, each run's train.log) in one file: $OUT returns at most 8 files
for r in /tmp/r1 /tmp/r1s /tmp/r2 /tmp/kr/a /tmp/kr/b; do
  [ -f $r/train.log ] && cp $r/train.log "$LOGS/train-${r//\//_}.log"
  [ -f $r/metrics.jsonl ] && cp $r/metrics.jsonl "$LOGS/metrics-${r//\//_}.jsonl"
done
tar czf "$OUT/logs.tgz" -C "$LOGS" .
