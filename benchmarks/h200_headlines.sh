#!/bin/bash
# The runs behind docs/performance.md's headline rows on one H200, a part per device call
# (each within the device tool's 10 minutes; the bench parts, cut short, resume where they
# stopped when run again into the same OUT):
#   PYTHONPATH=. bash benchmarks/h200_headlines.sh PART OUT
# PART:
#   1b          the 1.1B shape unclipped, side by side: the baseline as one program (its
#               layers unrolled and looped) and as a program per layer; the seed's two keys
#               at 0.25 / 0.5 / 1.0 against the best hand-set placements (split or float32
#               masters); compact moments at 1.0
#   1b-clipped  the same with clip_grad=1
#   activations the 1.1B shape's activations: full recompute, and all but one layer sending
#               `qkv` or `all` to the host (moved by XLA in the looped program and by the
#               trainer), and the weights of all but two layers kept on the host (inside the
#               looped program, and a program per layer, updated by the device a layer at a
#               time or beside them by the host kernel), against saving everything (unrolled
#               and looped)
#   plan        the planner on the 8B shape (its time, and no XLA log line in its output), again
#               with the programs the first kept (train.compilation_cache_dir), and the GPU tests
#   import      the 8B Hugging Face import (run N's command), trained 3 steps and exported
#   13b         the planner on the 13B shape, then its pick trained for 4 steps, unclipped
#   largest     70 layers of the 13B shape (22.5 B parameters) with bfloat16 masters rounded
#               stochastically and 8-bit moments (about 4 bytes a parameter on the host),
#               micro-batch 2, 3 steps unclipped
#   8b          the 8B shape at 1.0 on the host kernel: selective recompute against saving
#               everything and the first layers' named activations moved by the trainer
#               (exact), and with bfloat16 moments
#   8b-shipped  configs/llama_8b_offload.yaml as shipped (auto placement) against its best
#               hand-set placement, clipped and unclipped
#   weights-trace  the 1.1B shape with the weights of 20 layers moved, unclipped: updated a
#               layer at a time, and the group's update whole (clipped at a norm no step
#               reaches), against saving everything; then the first two steps traced: where
#               the step waits (step_trace.py)
# Writes OUT/NAME.{json,md,log}; no environment variable is set by hand.
set -u
part=${1:?usage: h200_headlines.sh PART OUT}
out=${2:?usage: h200_headlines.sh PART OUT}
mkdir -p "$out"

bench_1b() {  # name, overrides common to every setting...
  local name=$1; shift
  timeout -k 10 550 python3 -m jaxoffload.bench --config configs/llama_1b.yaml --steps 8 \
    --out "$out/$name" --resume \
    --settings "baseline again,baseline as a program per layer,baseline with its layers scanned,optimizer 0.25 default,optimizer 0.5 default,optimizer 1.0 default,optimizer 0.25 host_kernel bf16 transfers,optimizer 0.5 host_kernel bf16 transfers,optimizer 1.0 host_kernel bf16 transfers" \
    --setting "compact 1.0 default=optimizer.optimizer_cpu_offload=True optimizer.optimizer_offload_fraction=1.0 optimizer.exp_avg_dtype=bfloat16 optimizer.exp_avg_sq_dtype=bfloat16" \
    --setting "optimizer 1.0 host_kernel bf16 transfers float32 masters=optimizer.optimizer_cpu_offload=True optimizer.optimizer_offload_fraction=1.0 optimizer.optimizer_offload_update_on=host_kernel optimizer.offload_transfer_dtype=bfloat16 optimizer.store_param_remainders=False" \
    "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?"
}

timed() {  # name, seconds, command...: its output, wall time and XLA log lines printed
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local status=$?
  echo "$name: exit $status in $((SECONDS - start)) s;" \
    "$(grep -cE '^[EWI][0-9]{4} ' "$out/$name.log") XLA log lines"
}

case $part in
  1b) bench_1b bench_1b_unclipped optimizer.clip_grad=0 ;;
  1b-clipped) bench_1b bench_1b_clipped optimizer.clip_grad=1 ;;
  activations)
    # XLA's recompute and copies inside one program run with its layers looped: unrolled (the
    # config's baseline) they save no memory (advice.unrolled_recompute). The settings least
    # measured first: a run cut short has them.
    layers="model.cpu_offloading=True model.cpu_offloading_num_layers=21"
    moved="model.cpu_offloading_double_buffering=True"
    looped="model.scan_layers=True"
    weights="model.cpu_offloading=True model.cpu_offloading_num_layers=20 model.cpu_offloading_weights=True"
    # 0.81 of the elements: the weight-offloaded group's (0.80), whose state a fraction
    # offloads first, so that their update stays on the host beside them.
    kernel="optimizer.optimizer_cpu_offload=True optimizer.optimizer_offload_fraction=0.81
      optimizer.optimizer_offload_update_on=host_kernel optimizer.offload_transfer_dtype=bfloat16"
    timeout -k 10 550 python3 -m jaxoffload.bench --config configs/llama_1b.yaml --steps 8 \
      --out "$out/bench_activations" --resume \
      --settings "baseline again" \
      --setting "weights of 20 layers moved=$weights $moved" \
      --setting "qkv on 21 layers moved=$layers $moved" \
      --setting "all on 21 layers moved=$layers $moved model.cpu_offloading_policy=all" \
      --setting "weights of 20 layers moved and updated on the host=$weights $moved $kernel" \
      --setting "the host kernel at 0.81=$kernel" \
      --setting "baseline with its layers scanned=$looped" \
      --setting "full recompute=model.recompute_granularity=full $looped" \
      --setting "qkv on 21 layers=$layers $looped" \
      --setting "all on 21 layers=$layers model.cpu_offloading_policy=all $looped" \
      --setting "weights of 20 layers=$weights $looped" \
      optimizer.clip_grad=0 > "$out/bench_activations.log" 2>&1
    echo "bench_activations: exit $?"
    ;;
  plan)
    for name in plan_8b plan_8b_again; do
      timed $name 300 python3 -m jaxoffload.plan --config configs/llama_8b_offload.yaml \
        data.dataset=synthetic
    done
    # The same peaks from the kept programs' memory analysis (the times are measured anew).
    peaks() { grep '^|' "$1" | awk -F'|' '{print $2 $3 $4 $5 $6 $7 $8}' | sort; }
    diff <(peaks "$out/plan_8b.log") <(peaks "$out/plan_8b_again.log") \
      && echo "plan_8b_again: the same peaks"
    timed gpu_tests 240 python3 -m pytest -q tests/test_gpu.py
    ;;
  import)
    timed hf_import_8b 560 python3 benchmarks/hf_import.py --shape llama3-8b \
      --dir /tmp/llama8b --out "$out/hf_import" --config configs/llama_8b_offload.yaml \
      train.train_iters=3 data.dataset=synthetic optimizer.optimizer_offload_fraction=1.0
    ;;
  largest)
    timed train_22b 560 python3 -m jaxoffload.train --config configs/llama_13b_offload.yaml \
      model.num_layers=70 model.params_dtype=bfloat16 train.micro_batch_size=2 \
      optimizer.clip_grad=0 train.train_iters=3 logging.progress_bar=False \
      logging.jsonl="$out/train_22b.jsonl"
    ;;
  13b)
    timed plan_13b 250 python3 -m jaxoffload.plan --config configs/llama_13b_offload.yaml
    pick=$(grep '^  python -m jaxoffload.train ' "$out/plan_13b.log" | tail -1)
    if [ -z "$pick" ]; then echo "plan_13b picked nothing"; exit 1; fi
    timeout -k 10 300 ${pick/python/python3} train.train_iters=4 optimizer.clip_grad=0 \
      logging.progress_bar=False logging.jsonl="$out/train_13b_pick.jsonl" \
      > "$out/train_13b_pick.log" 2>&1
    echo "train_13b_pick: exit $?; $(tail -1 "$out/train_13b_pick.log")"
    ;;
  8b)
    # Activations moved instead of recomputed: every named one of the first 8 layers (the
    # most the host holds beside the exact state: 1.5 GB a layer at micro-batch 8), the
    # rest saved (offload refuses recompute); saving everything bounds what it can gain.
    moved="model.cpu_offloading=True model.cpu_offloading_num_layers=8
      model.cpu_offloading_double_buffering=True model.cpu_offloading_policy=all"
    timeout -k 10 550 python3 -m jaxoffload.bench --config configs/llama_8b_offload.yaml --steps 5 \
      --out "$out/bench_8b" --resume \
      --setting "bf16 moments=optimizer.exp_avg_dtype=bfloat16 optimizer.exp_avg_sq_dtype=bfloat16" \
      --setting "save everything=model.recompute_granularity=null" \
      --setting "8 layers moved by the trainer, the rest saved=$moved model.recompute_granularity=null" \
      data.dataset=synthetic model.cpu_offloading=False model.cpu_offloading_num_layers=0 \
      model.recompute_granularity=selective optimizer.optimizer_offload_update_on=host_kernel \
      optimizer.optimizer_offload_fraction=1.0 optimizer.accumulate_offloaded_grads_on=device \
      optimizer.grad_accum_dtype=bfloat16 train.global_batch_size=32 train.micro_batch_size=8 \
      optimizer.clip_grad=0 optimizer.lr_warmup_iters=10 > "$out/bench_8b.log" 2>&1
    echo "bench_8b: exit $?"
    ;;
  8b-shipped)
    hand_set="optimizer.optimizer_offload_update_on=host_kernel
      optimizer.offload_transfer_dtype=bfloat16"
    timeout -k 10 550 python3 -m jaxoffload.bench --config configs/llama_8b_offload.yaml --steps 5 \
      --out "$out/bench_8b_shipped" --resume --setting "hand-set=$hand_set" \
      --setting "unclipped=optimizer.clip_grad=0" \
      --setting "hand-set unclipped=$hand_set optimizer.clip_grad=0" \
      data.dataset=synthetic > "$out/bench_8b_shipped.log" 2>&1
    echo "bench_8b_shipped: exit $?"
    ;;
  weights-trace)
    weights="model.cpu_offloading=True model.cpu_offloading_num_layers=20
      model.cpu_offloading_weights=True model.cpu_offloading_double_buffering=True"
    timeout -k 10 380 python3 -m jaxoffload.bench --config configs/llama_1b.yaml --steps 8 \
      --out "$out/bench_weights" --resume --settings "" \
      --setting "weights of 20 layers moved=$weights" \
      --setting "the same, the group's update whole=$weights optimizer.clip_grad=1e6" \
      optimizer.clip_grad=0 > "$out/bench_weights.log" 2>&1
    echo "bench_weights: exit $?"
    timed train_weights_traced 150 python3 -m jaxoffload.train --config configs/llama_1b.yaml \
      $weights optimizer.clip_grad=0 train.train_iters=7 logging.progress_bar=False \
      logging.profile_dir="$out/trace" logging.profile_start_step=5 logging.profile_steps=2
    timed step_trace 120 python3 benchmarks/step_trace.py "$out/trace" --out "$out/step_trace"
    # A copy beside the results, where a shallow listing of OUT finds it.
    cp "$(ls -t "$out"/trace/plugins/profile/*/*.xplane.pb | head -1)" "$out/weights.xplane.pb"
    ;;
  *) echo "unknown part $part: 1b, 1b-clipped, activations, plan, import, 13b, largest, 8b," \
       "8b-shipped or weights-trace" >&2
     exit 2 ;;
esac
