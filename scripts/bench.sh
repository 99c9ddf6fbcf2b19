#!/usr/bin/env bash
# Builds and runs the benchmarks; prints markdown tables for docs/benchmarks.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$root/scripts/setup.sh" >/dev/null
configure "$root/build" -Dcuda=disabled -Dbuildtype=debugoptimized
ninja -C "$root/build" bench/bench_dispatch_overhead bench/bench_fsdp_step bench/bench_clip_grad_norm \
  bench/bench_checkpoint_io bench/bench_fsdp_overlap bench/bench_meta_init_memory \
  bench/bench_activation_checkpoint bench/bench_loss_parallel bench/bench_reduce_scatter \
  bench/bench_module_call bench/bench_pipeline bench/bench_context_parallel bench/bench_moe \
  bench/bench_float8 \
  bench/liblive_bytes.so examples/train
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-WARNING}
echo "## dispatch overhead, 1 rank"
"$root/build/bench/bench_dispatch_overhead"
echo
echo "## dispatch overhead, 2 ranks"
torchrun --standalone --nproc-per-node 2 --no-python "$root/build/bench/bench_dispatch_overhead"
echo
echo "## dispatch overhead against PyTorch's DTensor, 1 and 2 ranks (alternating)"
"$root/.venv/bin/python" "$root/bench/dispatch_overhead.py" "$root/.venv/bin/torchrun" \
  "$root/build/bench/bench_dispatch_overhead" --rounds 3 --ranks 1 2
echo
echo "## the module seam: dtensor::call against module->forward, 1 process"
"$root/build/bench/bench_module_call"
echo
echo "## fully_shard step, Transformer, 2 and 4 ranks"
torchrun --standalone --nproc-per-node 2 --no-python "$root/build/bench/bench_fsdp_step"
torchrun --standalone --nproc-per-node 4 --no-python "$root/build/bench/bench_fsdp_step" | grep -v '^| ranks\|^| ---'
echo
echo "## clip_grad_norm_ against the number of gradients, 2 ranks"
torchrun --standalone --nproc-per-node 2 --no-python "$root/build/bench/bench_clip_grad_norm"
echo
echo "## checkpoint save / load, 256 MB, 2 and 4 ranks, dtensor vs PyTorch DCP (alternating)"
"$root/.venv/bin/python" "$root/bench/checkpoint_io.py" "$root/.venv/bin/torchrun" \
  "$root/build/bench/bench_checkpoint_io" --mb 256 --rounds 7 --ranks 2 4
echo
echo "## fully_shard step time vs PyTorch FSDP2, overlap on / off, 2 and 4 ranks (alternating)"
"$root/.venv/bin/python" "$root/bench/fsdp_overlap.py" "$root/.venv/bin/torchrun" \
  "$root/build/bench/bench_fsdp_overlap" --rounds 5 --ranks 2 4 --dims 64 256 512 --tp-dims 64 256
echo
echo "## pipeline schedules vs PyTorch's torch.distributed.pipelining, 2 and 4 ranks (alternating)"
"$root/.venv/bin/python" "$root/bench/pipeline.py" "$root/.venv/bin/torchrun" \
  "$root/build/bench/bench_pipeline" --rounds 3 --ranks 2 4 \
  --live-bytes "$root/build/bench/liblive_bytes.so"
"$root/.venv/bin/python" "$root/bench/pipeline.py" "$root/.venv/bin/torchrun" \
  "$root/build/bench/bench_pipeline" --rounds 3 --ranks 2 4 --dim 32 \
  --schedules 1F1B ZBVZeroBubble --live-bytes "$root/build/bench/liblive_bytes.so"
echo
echo "## context parallelism: the Llama model over one long sequence, cp 1 / 2 / 4, both methods"
"$root/.venv/bin/python" "$root/bench/context_parallel.py" "$root/.venv/bin/torchrun" \
  "$root/build/bench/bench_context_parallel" --seqs 1024 4096 16384 --rounds 2 \
  --live-bytes "$root/build/bench/liblive_bytes.so" --unbalanced
echo
echo "## MoE blocks with expert parallelism vs the same model in PyTorch, 2 and 4 ranks (alternating)"
"$root/.venv/bin/python" "$root/bench/moe.py" "$root/.venv/bin/torchrun" "$root/build/bench/bench_moe" \
  --rounds 3 --layouts 2:2 4:4 4:2 --live-bytes "$root/build/bench/liblive_bytes.so"
"$root/.venv/bin/python" "$root/bench/moe.py" "$root/.venv/bin/torchrun" "$root/build/bench/bench_moe" \
  --rounds 2 --dim 256 --hidden 256 --tokens 512 --layouts 2:2 4:4
"$root/.venv/bin/python" "$root/bench/moe.py" "$root/.venv/bin/torchrun" "$root/build/bench/bench_moe" \
  --dispatch --layouts 2:2 4:4 --rounds 3
echo
echo "## float8 under fully_shard vs torchao + FSDP2, 4 ranks (alternating)"
"$root/.venv/bin/python" "$root/bench/float8.py" "$root/.venv/bin/torchrun" "$root/build/bench/bench_float8" \
  --ranks 4 --rounds 2 --live-bytes "$root/build/bench/liblive_bytes.so"
echo
echo "## memory per rank: meta init and a training step, Transformer on 8 ranks"
torchrun --standalone --nproc-per-node 8 --no-python "$root/build/bench/bench_meta_init_memory"
echo
echo "## reduce-scatter and all-gather on Gloo vs PyTorch's, 2 and 4 ranks (alternating)"
"$root/.venv/bin/python" "$root/bench/reduce_scatter.py" "$root/.venv/bin/torchrun" \
  "$root/build/bench/bench_reduce_scatter" --rounds 5 --ranks 2 4
echo
echo "## activation checkpointing none / full / selective vs PyTorch FSDP2 + checkpoint_wrapper, 2 and 4 ranks"
"$root/.venv/bin/python" "$root/bench/activation_checkpoint.py" "$root/.venv/bin/torchrun" \
  "$root/build/bench/bench_activation_checkpoint" --rounds 3 --ranks 2 4
echo
echo "## loss parallelism: TP step, vocabulary 32000, LossParallel off / on, 2 and 4 ranks"
torchrun --standalone --nproc-per-node 2 --no-python "$root/build/bench/bench_loss_parallel"
torchrun --standalone --nproc-per-node 4 --no-python "$root/build/bench/bench_loss_parallel" | grep -v '^Trans\|^$\|^| ranks\|^| ---'
echo
echo "## the Llama 3 recipe against PyTorch (FSDP2 + TP + loss_parallel + checkpoint_wrapper), 8 and 4 ranks (alternating)"
"$root/.venv/bin/python" "$root/bench/llama3_recipe.py" "$root/.venv/bin/torchrun" \
  "$root/build/examples/train" --rounds 3 --steps 12 --meshes 2x2x2 1x2x2
