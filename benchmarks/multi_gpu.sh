#!/bin/bash
# Issue 7's runs on one host of 2 GPUs: TinyLlama (configs/llama_1b.yaml) on text, with and
# without offload (optimizer 0.5 on the device + activations of 11 layers), per mesh shape,
# beside one GPU. Writes OUT/NAME.jsonl and OUT/NAME.log; benchmarks/runs_table.py makes
# the report from them.
#   PYTHONPATH=. bash benchmarks/multi_gpu.sh OUT
set -u
out=${1:?usage: multi_gpu.sh OUT}
mkdir -p "$out"
run() {  # name, visible GPUs, overrides...
  local name=$1 gpus=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus timeout 300 python3 -m jaxoffload.train --config configs/llama_1b.yaml \
    data.dataset=text logging.progress_bar=False logging.jsonl="$out/$name.jsonl" "$@" \
    > "$out/$name.log" 2>&1
  echo "$name: exit $?; $(tail -1 "$out/$name.log")"
}
OFFLOAD="optimizer.optimizer_cpu_offload=True optimizer.optimizer_offload_fraction=0.5
  optimizer.optimizer_offload_update_on=device model.cpu_offloading=True
  model.cpu_offloading_num_layers=11"
# Each GPU gets 8 sequences, as the one-GPU runs do, except under tensor parallelism.
BATCH16="train.global_batch_size=16 train.micro_batch_size=16"
run gpu1_base 0 train.train_iters=50
run gpu1_off 0 train.train_iters=50 $OFFLOAD
run fsdp2_base 0,1 mesh.fsdp=2 $BATCH16 train.train_iters=50
run fsdp2_off 0,1 mesh.fsdp=2 $BATCH16 train.train_iters=50 $OFFLOAD
run fsdp2_base_again 0,1 mesh.fsdp=2 $BATCH16 train.train_iters=50
run data2_base 0,1 mesh.data=2 $BATCH16 train.train_iters=20
run data2_off 0,1 mesh.data=2 $BATCH16 train.train_iters=20 $OFFLOAD
run tensor2_base 0,1 mesh.tensor=2 train.train_iters=20
run tensor2_off 0,1 mesh.tensor=2 train.train_iters=20 $OFFLOAD
