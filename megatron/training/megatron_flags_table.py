"""Megatron-LM's flags that this project's own argument groups do not define: one row each.

Every option of Megatron-LM's parser (at the HEAD recorded in tests/data/megatron_lm_flags.tsv)
parses here, with Megatron's dest, action, default, choices and type, so that current launch
scripts reach validation instead of failing with "unrecognized arguments". Each row says what the
flag does here:

- ``WORKS``: the value is read and acts as in Megatron (the code that reads it names the flag);
- ``NO_EFFECT``: changes nothing by the nature of this codebase; --help says why and a run that
  sets it prints one note;
- ``REFUSED``: set to anything but its default, ``validate_args`` stops with one line saying what
  to use instead.

A row is a tuple ``(option strings, dest, action, default, choices, kind, reason)``:

- option strings: Megatron's, space separated;
- dest: ``""`` when it is the first option string's name with ``_`` for ``-``;
- action: ``true`` / ``false`` (store_true / store_false), ``bool?`` (``--x`` / ``--no-x``), or
  the type of a stored value (``int``, ``float``, ``str``, ``attn_backend``, ``window``,
  ``layer_pattern``) followed by ``+`` or ``*`` when it takes a list;
- choices: ``|`` separated, ``""`` for none.

:mod:`megatron.training.megatron_flags` registers the rows whose option strings the parser does
not define yet: a flag that gets a real definition in :mod:`megatron.training.arguments` takes
precedence over its row here.
"""

import signal

WORKS, NO_EFFECT, REFUSED = "works", "no-effect", "refused"

# Why a flag has no effect here.
FUSION = ("a fusion or kernel choice; this project has one implementation of that computation, "
          "and the numbers are the same either way")
ATTN_BACKEND = ("attention here is one implementation (the math path, or flash attention with "
                "--use-flash-attn); every backend computes the same function")
CLONE_SCATTER = ("a memory optimisation of the embedding's sequence-parallel scatter; the "
                 "numbers are the same")
ASYNC_CKPT = ("--async-save writes checkpoints on a background thread of the training process; "
              "there is no worker process or I/O priority to set")
CKPT_PERF = ("a loading/saving optimisation of Megatron-Core's distributed checkpointing; "
             "torch_dist checkpoints here are written and read the same way either way")
RESHARDABLE = ("torch_dist checkpoints here, optimizer state included, always load at any "
               "tensor/pipeline/data-parallel layout")
SCHEDULE = ("a scheduling optimisation (when a communication or weight-gradient computation "
            "starts); the numbers are the same")
EP_OVERLAP = ("a scheduling optimisation of expert-parallel communication; the all-to-all "
              "completes before compute goes on here, with the same numbers")
BUCKETS = ("gradient buckets change when reductions start, not the summed values; the "
           "numbers are the same")
NCCL_TUNING = ("a communication-library tuning knob (NCCL configuration, SHARP, user "
               "buffers, stream priorities, extra gloo groups); nothing here acts on it and the "
               "numbers are the same")
ONE_LOGGER = "one_logger is NVIDIA-internal job telemetry, not part of this project"
MSC = ("deprecated in Megatron, where it changes nothing either: the Multi-Storage Client is "
       "opt-in, with --enable-msc")
EXPERIMENTAL = "no feature here is gated behind it"
DATA_CACHE = ("a start-up optimisation of Megatron's dataset index caches; the same samples are "
              "built either way")
ENERGY = "energy is not measured here (no GPU power counters are read)"
TOKENIZER_ASSETS = "checkpoints here never copy the tokenizer's files"
PROFILER = ("the torch profiler trace of --use-pytorch-profiler always records tensor shapes and "
            "call stacks")
AVERAGE = ("gradients are averaged over the data-parallel group by scaling each rank's "
           "gradient by 1/size before the sum, which is how an averaging collective (NCCL's "
           "AVG) computes it for floating point; the numbers are the same")
FSDP_RUNTIME = ("a buffer, process-group or implementation choice of Megatron's own FSDP runtime "
                "(double buffers, memory pools, all-gather groups, unit sizes, registration, its "
                "second version); --use-megatron-fsdp runs on PyTorch's FSDP2 here, and the "
                "numbers are the same either way")
BARRIER = "the timers here never add a barrier; --timing-log-level 1 timers are not synchronised"

# What to do instead of a refused flag.
MTP = ("it gives the layer pattern of MTP layers in hybrid (Mamba) models, which are not built "
       "here; drop it (--mtp-num-layers works)")
FSDP = ("this knob of Megatron's own FSDP runtime has no counterpart here (--use-megatron-fsdp "
        "and its sharding strategies run on PyTorch's FSDP2); drop it")
SAVE_PLAN_CACHE = ("a cache file of the fully-parallel save plan (which rank writes which shard), "
                   "kept so later jobs skip the gather that plans it; torch_dist checkpoints "
                   "here are written and read the same way either way, and no cache file is "
                   "written")
FP8 = ("FP8/FP4 training needs TransformerEngine's kernels, which are not built here; use --bf16")
KITCHEN = "quantization recipes (kitchen) are not built here; use --bf16"
TP_OVERLAP = ("tensor-parallel communication/GEMM overlap needs TransformerEngine's userbuffers, "
              "which are not built here; drop it")
TE = "it needs TransformerEngine, which is not built here; drop it"
CUDA_GRAPH = "CUDA graphs are not built here (eager execution); drop it"
RL = "reinforcement learning (GRPO) runs from another entry point, not built here; drop it"
INFERENCE = ("the inference engine's flags belong to Megatron's inference server, not built "
             "here; drop it (tools/run_text_generation_server.py serves a checkpoint)")
VISION = "vision and multimodal models are not built here; drop it"
BIENCODER = "ICT/REALM biencoder retrieval models are not built here; drop it"
MAMBA = "Mamba and hybrid (attention/SSM) models are not built here; drop it"
T5 = "relative position buckets belong to T5, which is not built here; drop it"
RESILIENCY = ("NVIDIA's resiliency packages (fault tolerance, in-process restart, fault "
              "injection) are not part of this project; drop it (use --exit-signal-handler and "
              "restart with --load)")
AUTORESUME = "ADLR cluster autoresume is not part of this project; use --exit-duration-in-mins"
OTEL = ("Megatron exports OpenTelemetry spans and metrics through NVIDIA's nemo-lens package, "
        "which is not on PyPI (this project installs from PyPI only); drop it (use "
        "--tensorboard-dir or --wandb-project)")
INSPECTOR = ("Megatron starts NVIDIA's workload-inspector web server only when its "
             "workload_inspector package is installed, and otherwise prints a line and trains "
             "on; that package is not on PyPI, so no server starts here either")
FLEX = ("the flex token dispatcher (DeepEP, HybridEP, NCCL EP) is not built here; use "
        "--moe-token-dispatcher-type alltoall")
ACT_OFFLOAD = ("Megatron stashes expert activations in pages only under the flex dispatcher's "
               "fixed per-rank token budget (--moe-expert-rank-capacity-factor), which is not "
               "built here; use --fine-grained-activation-offloading --offload-modules "
               "expert_fc1 moe_act")
INFLIGHT = ("offload copies here finish before the forward goes on, so no offload is ever in "
            "flight for a cap to limit")
SPEC = ("Megatron-Core module specs (Python import paths of layer classes) are not built here; "
        "the layers are always this project's own; drop it")
UCC = "only the default communication backend is built here; drop it"
TESTING = "Megatron's test harness switches are not part of this project; drop it"
DIST_CKPT_FORMAT = "it was replaced by --ckpt-format; use --ckpt-format torch_dist"
HF_SLOW = ("transformers 5, which Megatron's HuggingFaceTokenizer calls, ignores use_fast=False "
           "and always builds the fast tokenizer, so the ids are the same with or without it; "
           "tokenizer.json is read here with the tokenizers library that fast tokenizer runs")
REMOTE_CODE = ("a tokenizer's own Python code is never run here (nothing from a model folder "
               "runs as code); drop it and give a tokenizer.json")

# (option strings, dest, action, default, choices, kind, reason); see the module docstring.
ROWS = (
    ('--pipeline-model-parallel-comm-backend', '', 'str', None, 'nccl|ucc', REFUSED, UCC),
    ('--tp-comm-overlap', '', 'true', False, '', REFUSED, TP_OVERLAP),
    ('--no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad', 'tp_comm_bulk_wgrad',
     'false', True, '', REFUSED, TP_OVERLAP),
    ('--no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-dgrad', 'tp_comm_bulk_dgrad',
     'false', True, '', REFUSED, TP_OVERLAP),
    ('--no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag', 'tp_comm_overlap_ag',
     'false', True, '', REFUSED, TP_OVERLAP),
    ('--no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs', 'tp_comm_overlap_rs',
     'false', True, '', REFUSED, TP_OVERLAP),
    ('--tp-comm-overlap-rs-dgrad', '', 'true', False, '', REFUSED, TP_OVERLAP),
    ('--no-tp-comm-split-ag --disable-tp-comm-split-ag', 'tp_comm_split_ag',
     'false', True, '', REFUSED, TP_OVERLAP),
    ('--no-tp-comm-split-rs --disable-tp-comm-split-rs', 'tp_comm_split_rs',
     'false', True, '', REFUSED, TP_OVERLAP),
    ('--cross-entropy-fusion-impl', '', 'str', 'native', 'native|te', NO_EFFECT, FUSION),
    ('--tp-comm-bootstrap-backend', '', 'str', 'nccl', 'nccl|mpi|gloo', REFUSED, TP_OVERLAP),
    ('--overlap-moe-expert-parallel-comm', '', 'true', False, '', NO_EFFECT, EP_OVERLAP),
    ('--delay-wgrad-compute', '', 'true', False, '', NO_EFFECT, EP_OVERLAP),
    ('--overlap-dispatch-backward-with-experts-wgrad', '',
     'true', False, '', NO_EFFECT, EP_OVERLAP),
    ('--ep-overlap-early-attn-memory-release', '', 'true', False, '', NO_EFFECT, EP_OVERLAP),
    ('--defer-embedding-wgrad-compute', '', 'true', False, '', NO_EFFECT, SCHEDULE),
    ('--wgrad-deferral-limit', '', 'int', 0, '', NO_EFFECT, SCHEDULE),
    ('--overlap-p2p-communication-warmup-flush', 'overlap_p2p_comm_warmup_flush',
     'true', False, '', NO_EFFECT, SCHEDULE),
    ('--mtp-hybrid-override-pattern', '', 'str', None, '', REFUSED, MTP),
    ('--flash-attention-version', '', 'int', None, '2|3|4', NO_EFFECT, ATTN_BACKEND),
    ('--disable-bf16-reduced-precision-matmul', '', 'true', False, '', WORKS, None),
    ('--use-fused-weighted-squared-relu', '', 'true', False, '', NO_EFFECT, FUSION),
    ('--fused-residual-rmsnorm', '', 'true', False, '', NO_EFFECT, FUSION),
    ('--use-transformer-engine-op-fuser', '', 'true', False, '', NO_EFFECT, FUSION),
    ('--recompute-modules', '', 'str*', None, '', WORKS, None),
    ('--fp8-format', 'fp8', 'str', None, 'e4m3|hybrid', REFUSED, FP8),
    ('--fp8-recipe', '',
     'str', 'delayed', 'tensorwise|delayed|mxfp8|blockwise|custom', REFUSED, FP8),
    ('--fp8-quantizer-factory', '', 'str', None, '', REFUSED, FP8),
    ('--fp8-margin', '', 'int', 0, '', REFUSED, FP8),
    ('--fp8-interval', '', 'int', 1, '', REFUSED, FP8),
    ('--fp8-amax-history-len', '', 'int', 1, '', REFUSED, FP8),
    ('--fp8-amax-compute-algo', '', 'str', 'most_recent', 'most_recent|max', REFUSED, FP8),
    ('--no-fp8-wgrad --disable-fp8-wgrad', 'fp8_wgrad', 'false', True, '', REFUSED, FP8),
    ('--fp8-output-proj', '', 'true', False, '', REFUSED, FP8),
    ('--first-last-layers-bf16', '', 'true', False, '', REFUSED, FP8),
    ('--num-layers-at-start-in-bf16', '', 'int', 1, '', REFUSED, FP8),
    ('--num-layers-at-end-in-bf16', '', 'int', 1, '', REFUSED, FP8),
    ('--use-kitchen-attention', '', 'true', False, '', REFUSED, KITCHEN),
    ('--kitchen-attention-backend', '', 'str', 'sdpa', 'sdpa|fa', REFUSED, KITCHEN),
    ('--fp4-format', 'fp4', 'str', None, 'e2m1', REFUSED, FP8),
    ('--fp4-recipe', '', 'str', 'nvfp4', 'nvfp4|custom', REFUSED, FP8),
    ('--fp4-quantizer-factory', '', 'str', None, '', REFUSED, FP8),
    ('--high-priority-a2a-comm-stream', '', 'true', False, '', NO_EFFECT, EP_OVERLAP),
    ('--moe-router-padding-for-quantization', '', 'true', False, '', REFUSED, FP8),
    ('--moe-router-padding-for-fp8', '', 'true', False, '', REFUSED, FP8),
    ('--moe-router-force-biased', '', 'float', None, '', WORKS, None),
    ('--moe-enable-deepep', '', 'true', False, '', REFUSED, FLEX),
    ('--moe-flex-dispatcher-backend', '',
     'str', 'deepep', 'deepep|hybridep|ncclep', REFUSED, FLEX),
    ('--moe-permute-fusion-into-hybridep', '', 'true', False, '', REFUSED, FLEX),
    ('--moe-hybridep-pad-uneven-dispatch-inputs', '', 'true', False, '', REFUSED, FLEX),
    ('--moe-pad-experts-for-cuda-graph-inference', '', 'true', False, '', REFUSED, CUDA_GRAPH),
    ('--moe-permute-fusion', '', 'true', False, '', NO_EFFECT, FUSION),
    ('--moe-router-fusion', '', 'true', False, '', NO_EFFECT, FUSION),
    ('--gtp-remat-opt-in-modules', '', 'str+', [], '', REFUSED, FSDP),
    ('--moe-flex-dispatcher-num-sms', '', 'int', None, '', REFUSED, FLEX),
    ('--moe-deepep-num-sms', '', 'int', None, '', REFUSED, FLEX),
    ('--moe-hybridep-num-sms', '', 'int', None, '', REFUSED, FLEX),
    ('--moe-hybridep-num-blocks-permute', '', 'int', None, '', REFUSED, FLEX),
    ('--moe-hybridep-num-blocks-unpermute', '', 'int', None, '', REFUSED, FLEX),
    ('--moe-hybridep-num-sms-preprocessing', '', 'int', 108, '', REFUSED, FLEX),
    ('--moe-ncclep-zero-copy', '', 'true', False, '', REFUSED, FLEX),
    ('--moe-dispatch-fwd-dtype', '', 'str', 'bf16', 'bf16|mxfp8', REFUSED, FP8),
    ('--moe-combine-bwd-dtype', '', 'str', 'bf16', 'bf16|mxfp8', REFUSED, FP8),
    ('--moe-expert-rank-capacity-factor', '', 'float', None, '', REFUSED, FLEX),
    ('--enable-cuda-graph', '', 'true', False, '', REFUSED, CUDA_GRAPH),
    ('--cuda-graph-warmup-steps', '', 'int', 3, '', REFUSED, CUDA_GRAPH),
    ('--external-cuda-graph', '', 'true', False, '', REFUSED, CUDA_GRAPH),
    ('--cuda-graph-impl', '',
     'str', 'none', 'none|local|transformer_engine|full_iteration', REFUSED, CUDA_GRAPH),
    ('--inference-cuda-graph-scope', '', 'str', None, 'none|layer|block', REFUSED, INFERENCE),
    ('--no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding',
     'clone_scatter_output_in_embedding', 'false', True, '', NO_EFFECT, CLONE_SCATTER),
    ('--config-logger-dir', '', 'str', '', '', WORKS, None),
    ('--flash-decode', '', 'true', False, '', REFUSED, INFERENCE),
    ('--batch-invariant-mode', '', 'true', False, '', REFUSED, INFERENCE),
    ('--batch-invariant-backend', '',
     'str', 'te_native', 'te_native|deepgemm|triton', REFUSED, INFERENCE),
    ('--use-te-activation-func', '', 'true', False, '', NO_EFFECT, FUSION),
    ('--symmetric-ar-type', '',
     'str', None, 'two_shot|one_shot|multimem_all_reduce', REFUSED, INFERENCE),
    ('--nccl-all-reduce-for-prefill', '', 'true', False, '', REFUSED, INFERENCE),
    ('--inference-fuse-tp-communication', '', 'true', False, '', REFUSED, INFERENCE),
    ('--inference-disable-triton-nvls-kernels', '', 'true', False, '', REFUSED, INFERENCE),
    ('--inference-grouped-gemm-backend', '',
     'str', 'vllm', 'flashinfer|torch|vllm', REFUSED, INFERENCE),
    ('--inference-moe-disable-fused-quant-kernels', '', 'true', False, '', REFUSED, INFERENCE),
    ('--inference-moe-token-dispatcher-type', '', 'str', 'nvls', 'nccl|nvls', REFUSED, INFERENCE),
    ('--mrope-section', '', 'int+', None, '', REFUSED, VISION),
    ('--is-hybrid-model', '', 'true', False, '', REFUSED, MAMBA),
    ('--mamba-state-dim', '', 'int', 128, '', REFUSED, MAMBA),
    ('--mamba-head-dim', '', 'int', 64, '', REFUSED, MAMBA),
    ('--mamba-num-groups', '', 'int', 8, '', REFUSED, MAMBA),
    ('--mamba-num-heads', '', 'int', None, '', REFUSED, MAMBA),
    ('--gdp-num-householder', '', 'int', 3, '', REFUSED, MAMBA),
    ('--disable-mamba-mem-eff-path', 'use_mamba_mem_eff_path', 'false', True, '', REFUSED, MAMBA),
    ('--gdp-cutedsl-kernel', '', 'true', False, '', REFUSED, MAMBA),
    ('--gdp-num-chunk-states-to-recompute', '', 'int', 2, '', REFUSED, MAMBA),
    ('--mlp-chunks-for-prefill', '', 'int', 1, '', REFUSED, INFERENCE),
    ('--delay-offload-until-cuda-graph', '', 'true', False, '', REFUSED, CUDA_GRAPH),
    ('--moe-paged-stash', '', 'true', False, '', REFUSED, ACT_OFFLOAD),
    ('--moe-paged-stash-page-size', '', 'int', 64, '', REFUSED, ACT_OFFLOAD),
    ('--moe-paged-stash-buffer-size-factor-cuda', '', 'float', 1.1, '', REFUSED, ACT_OFFLOAD),
    ('--moe-paged-stash-buffer-size-factor-cpu', '', 'float', 0.0, '', REFUSED, ACT_OFFLOAD),
    ('--fine-grained-offloading-max-inflight-offloads', '', 'int', None, '', NO_EFFECT,
     INFLIGHT),
    ('--relative-attention-num-buckets', '', 'int', 32, '', REFUSED, T5),
    ('--relative-attention-max-distance', '', 'int', 128, '', REFUSED, T5),
    ('--apply-wd-to-qk-layernorm', '', 'true', False, '', WORKS, None),
    ('--no-weight-decay-cond-type', '', 'str', None, 'apply_wd_to_qk_layernorm', WORKS, None),
    ('--pytorch-profiler-collect-shapes', '', 'true', False, '', NO_EFFECT, PROFILER),
    ('--pytorch-profiler-collect-callstack', '', 'true', False, '', NO_EFFECT, PROFILER),
    ('--record-shapes', '', 'true', False, '', NO_EFFECT, PROFILER),
    ('--train-sync-interval', '', 'int', None, '', NO_EFFECT, SCHEDULE),
    ('--exit-signal', '', 'signal', signal.SIGTERM, '', WORKS, None),
    ('--no-check-for-nan-in-loss-and-grad', 'check_for_nan_in_loss_and_grad',
     'false', True, '', WORKS, None),
    ('--tp-comm-overlap-cfg', '', 'str', None, '', REFUSED, TP_OVERLAP),
    ('--no-rope-fusion', 'apply_rope_fusion', 'false', True, '', NO_EFFECT, FUSION),
    ('--optimizer-cuda-graph', '', 'true', False, '', REFUSED, CUDA_GRAPH),
    ('--perform-rl-step', '', 'true', False, '', REFUSED, RL),
    ('--rl-prompts-per-eval', '', 'int', 32, '', REFUSED, RL),
    ('--grpo-prompts-per-step', '', 'int', 32, '', REFUSED, RL),
    ('--grpo-group-size', '', 'int', 2, '', REFUSED, RL),
    ('--rl-generation-lag', '', 'int', None, '', REFUSED, RL),
    ('--rl-max-inflight-requests', '', 'int', None, '', REFUSED, RL),
    ('--rl-submission-granularity', '', 'str', 'B', 'R|G|B', REFUSED, RL),
    ('--rl-consumption-granularity', '', 'str', 'B', 'R|G|B', REFUSED, RL),
    ('--rl-durable-rollout-bank', '', 'true', False, '', REFUSED, RL),
    ('--rl-rollout-bank-dir', '', 'str', None, '', REFUSED, RL),
    ('--rl-rollout-bank-max-bytes', '', 'int', 0, '', REFUSED, RL),
    ('--grpo-iterations', '', 'int', 2, '', REFUSED, RL),
    ('--grpo-clamp-eps-lower', '', 'float', 0.01, '', REFUSED, RL),
    ('--grpo-clamp-eps-upper', '', 'float', 0.01, '', REFUSED, RL),
    ('--grpo-kl-beta', '', 'float', 0.001, '', REFUSED, RL),
    ('--grpo-entropy-term-weight', '', 'float', 0.0, '', REFUSED, RL),
    ('--grpo-filter-groups-with-same-reward', '', 'true', False, '', REFUSED, RL),
    ('--langrl-env-config', '', 'str', None, '', REFUSED, RL),
    ('--rl-default-temperature', '', 'float', 1.0, '', REFUSED, RL),
    ('--rl-default-top-p', '', 'float', 0, '', REFUSED, RL),
    ('--rl-default-top-k', '', 'int', -1, '', REFUSED, RL),
    ('--rl-offload-optimizer-during-inference', '', 'true', False, '', REFUSED, RL),
    ('--rl-kv-cache-management-mode', '',
     'str', 'persist', 'persist|offload|recompute', REFUSED, RL),
    ('--rl-persist-cuda-graphs --no-rl-persist-cuda-graphs', '', 'bool?', False, '', REFUSED, RL),
    ('--rl-partial-rollouts --no-rl-partial-rollouts', '', 'bool?', False, '', REFUSED, RL),
    ('--rl-inference-logprobs-is-correction --no-rl-inference-logprobs-is-correction', '',
     'bool?', False, '', REFUSED, RL),
    ('--rl-importance-sampling-truncation-coef', '', 'float', None, '', REFUSED, RL),
    ('--rl-use-sequence-packing --no-rl-use-sequence-packing', '',
     'bool?', False, '', REFUSED, RL),
    ('--rl-sequence-packing-max-sequences-per-bin', '', 'int', 50, '', REFUSED, RL),
    ('--rl-sequence-packing-algo', '', 'str', 'fifo', 'fifo|round-robin', REFUSED, RL),
    ('--rl-training-cuda-graphs --no-rl-training-cuda-graphs', '',
     'bool?', False, '', REFUSED, CUDA_GRAPH),
    ('--rl-inference-tensor-model-parallel-size', '', 'int', None, '', REFUSED, RL),
    ('--rl-inference-pipeline-model-parallel-size', '', 'int', None, '', REFUSED, RL),
    ('--rl-inference-expert-model-parallel-size', '', 'int', None, '', REFUSED, RL),
    ('--rl-inference-expert-tensor-model-parallel-size', '', 'int', None, '', REFUSED, RL),
    ('--rl-inference-model-unified-memory-level', '', 'int', 0, '0|1', REFUSED, RL),
    ('--rl-offload-inference-model-weights-when-idle '
     '--no-rl-offload-inference-model-weights-when-idle',
     '', 'bool?', False, '', REFUSED, RL),
    ('--refit-method', '', 'str', 'gloo', 'nccl|gloo|nvshmem', REFUSED, RL),
    ('--rl-verify-model-weights-swap --no-rl-verify-model-weights-swap', '',
     'bool?', False, '', REFUSED, RL),
    ('--rl-skip-bos-token --no-rl-skip-bos-token', '', 'bool?', False, '', REFUSED, RL),
    ('--rl-profile', '', 'true', False, '', REFUSED, RL),
    ('--rl-profile-dir', '', 'str', None, '', REFUSED, RL),
    ('--rl-inference-parsers', '', 'str+', [], '', REFUSED, RL),
    ('--te-rng-tracker', '', 'true', False, '', REFUSED, TE),
    ('--inference-rng-tracker', '', 'true', False, '', REFUSED, INFERENCE),
    ('--save-retain-interval', '', 'int', None, '', WORKS, None),
    ('--async-strategy', '', 'str', 'nvrx', 'nvrx|mcore', NO_EFFECT, ASYNC_CKPT),
    ('--use-persistent-ckpt-worker', '', 'true', False, '', NO_EFFECT, ASYNC_CKPT),
    ('--async-ckpt-cpu-priority', '', 'int', 10, '', NO_EFFECT, ASYNC_CKPT),
    ('--async-ckpt-io-priority', '', 'int', 3, '', NO_EFFECT, ASYNC_CKPT),
    ('--async-ckpt-use-cpu-shm', '', 'true', False, '', NO_EFFECT, ASYNC_CKPT),
    ('--ckpt-fully-parallel-load-exchange-algo', '',
     'str', 'broadcast', 'broadcast|gather_rounds|gather_object', NO_EFFECT, CKPT_PERF),
    ('--ckpt-fully-parallel-load-per-rank-objects', '', 'true', False, '', NO_EFFECT, CKPT_PERF),
    ('--ckpt-fully-parallel-save-process-group', '',
     'str', 'dp', 'dp|ep_dp', NO_EFFECT, CKPT_PERF),
    ('--ckpt-fully-parallel-load-process-group', '',
     'str', 'dp', 'dp|ep_dp', NO_EFFECT, CKPT_PERF),
    ('--ckpt-assume-constant-structure', '', 'true', False, '', NO_EFFECT, CKPT_PERF),
    ('--ckpt-pg-tensors-cache-path', '', 'str', None, '', NO_EFFECT, SAVE_PLAN_CACHE),
    ('--ckpt-pg-tensors-cache-create', '', 'true', False, '', NO_EFFECT, SAVE_PLAN_CACHE),
    ('--no-ckpt-load-validate-sharding-integrity --disable-ckpt-load-validate-sharding-integrity',
     'ckpt_load_validate_sharding_integrity', 'false', True, '', NO_EFFECT, CKPT_PERF),
    ('--dist-ckpt-optim-fully-reshardable', '', 'true', False, '', NO_EFFECT, RESHARDABLE),
    ('--distrib-optim-fully-reshardable-mem-efficient', '',
     'true', False, '', NO_EFFECT, RESHARDABLE),
    ('--no-save-tokenizer-assets --disable-save-tokenizer-assets', 'save_tokenizer_assets',
     'false', True, '', NO_EFFECT, TOKENIZER_ASSETS),
    ('--dist-ckpt-format', 'dist_ckpt_format_deprecated',
     'str', None, '', REFUSED, DIST_CKPT_FORMAT),
    ('--dist-ckpt-workers', '', 'int', 1, '', NO_EFFECT, CKPT_PERF),
    ('--ckpt-drop-redundant-extra-state', '', 'true', False, '', NO_EFFECT, CKPT_PERF),
    ('--reuse-grad-buf-for-mxfp8-param-ag', '', 'true', False, '', REFUSED, FP8),
    ('--mamba-training-ssm-states-dtype', '', 'str', None, 'fp32|bf16', REFUSED, MAMBA),
    ('--no-align-grad-reduce --disable-align-grad-reduce', 'align_grad_reduce',
     'false', True, '', NO_EFFECT, SCHEDULE),
    ('--nccl-communicator-config-path', '', 'str', None, '', NO_EFFECT, NCCL_TUNING),
    ('--disable-gloo-process-groups', 'use_gloo_process_groups',
     'false', True, '', NO_EFFECT, NCCL_TUNING),
    ('--use-sharp', '', 'true', False, '', NO_EFFECT, NCCL_TUNING),
    ('--sharp-enabled-group', '', 'str', None, 'dp|dp_replica', NO_EFFECT, NCCL_TUNING),
    ('--high-priority-stream-groups', '', 'str*', [], '', NO_EFFECT, NCCL_TUNING),
    ('--disable-jit-fuser', '', 'true', False, '', NO_EFFECT, FUSION),
    ('--num-virtual-stages-per-pipeline-rank', '', 'int', None, '', WORKS, None),
    ('--no-overlap-p2p-communication', 'overlap_p2p_comm', 'false', True, '', NO_EFFECT, SCHEDULE),
    ('--ddp-num-buckets', '', 'int', None, '', NO_EFFECT, BUCKETS),
    ('--ddp-pad-buckets-for-high-nccl-busbw', '', 'true', False, '', NO_EFFECT, BUCKETS),
    ('--gtp-remat-reduce-scatter-with-fp32-accumulation', '', 'true', False, '', REFUSED, FSDP),
    ('--ddp-average-in-collective', '', 'true', False, '', NO_EFFECT, AVERAGE),
    ('--overlap-param-gather-with-optimizer-step', '', 'true', False, '', NO_EFFECT, SCHEDULE),
    ('--no-align-param-gather', 'align_param_gather', 'false', True, '', NO_EFFECT, SCHEDULE),
    ('--megatron-fsdp-version', '', 'int', 1, '1|2', NO_EFFECT, FSDP_RUNTIME),
    ('--no-use-layer-wise-param-layout', 'use_layer_wise_param_layout',
     'false', True, '', REFUSED, FSDP),
    ('--use-nccl-ub', 'nccl_ub', 'true', False, '', NO_EFFECT, NCCL_TUNING),
    ('--disable-symmetric-registration', '', 'true', False, '', NO_EFFECT, NCCL_TUNING),
    ('--gtp-remat-nccl-ub', '', 'true', False, '', NO_EFFECT, NCCL_TUNING),
    ('--gtp-expert-remat-nccl-ub', '', 'true', False, '', NO_EFFECT, NCCL_TUNING),
    ('--fsdp-manual-registration', '', 'true', False, '', NO_EFFECT, FSDP_RUNTIME),
    ('--create-all-gather-group', '', 'true', False, '', NO_EFFECT, FSDP_RUNTIME),
    ('--no-gradient-reduce-div-fusion', 'gradient_reduce_div_fusion',
     'false', True, '', NO_EFFECT, FUSION),
    ('--fsdp-double-buffer', '', 'true', False, '', NO_EFFECT, FSDP_RUNTIME),
    ('--suggested-communication-unit-size', '', 'int', None, '', NO_EFFECT, FSDP_RUNTIME),
    ('--keep-fp8-transpose-cache', '', 'true', False, '', REFUSED, FSDP),
    ('--enable-full-sharding-in-hsdp', '', 'true', False, '', REFUSED, FSDP),
    ('--fake-process-group', '', 'true', False, '', REFUSED, TESTING),
    ('--eval-global-batch-size', '', 'int', None, '', WORKS, None),
    ('--test-mode', '', 'true', False, '', REFUSED, TESTING),
    ('--dataloader-fast-cache-load', '', 'true', False, '', NO_EFFECT, DATA_CACHE),
    ('--dataloader-defer-npy-index-mmap', '', 'true', False, '', NO_EFFECT, DATA_CACHE),
    ('--no-mmap-bin-files', 'mmap_bin_files', 'false', True, '', WORKS, None),
    ('--object-storage-cache-path', '', 'str', None, '', WORKS, None),
    ('--padded-vocab-size', '', 'int', None, '', WORKS, None),
    ('--tokenizer-hf-no-use-fast', '', 'true', False, '', NO_EFFECT, HF_SLOW),
    ('--trust-remote-code', '', 'true', False, '', REFUSED, REMOTE_CODE),
    ('--adlr-autoresume', '', 'true', False, '', REFUSED, AUTORESUME),
    ('--adlr-autoresume-interval', '', 'int', 1000, '', REFUSED, AUTORESUME),
    ('--ict-head-size', '', 'int', None, '', REFUSED, BIENCODER),
    ('--biencoder-projection-dim', '', 'int', 0, '', REFUSED, BIENCODER),
    ('--biencoder-shared-query-context-model', '', 'true', False, '', REFUSED, BIENCODER),
    ('--ict-load', '', 'str', None, '', REFUSED, BIENCODER),
    ('--bert-load', '', 'str', None, '', REFUSED, BIENCODER),
    ('--titles-data-path', '', 'str', None, '', REFUSED, BIENCODER),
    ('--query-in-block-prob', '', 'float', 0.1, '', REFUSED, BIENCODER),
    ('--use-one-sent-docs', '', 'true', False, '', REFUSED, BIENCODER),
    ('--evidence-data-path', '', 'str', None, '', REFUSED, BIENCODER),
    ('--retriever-report-topk-accuracies', '', 'int+', [], '', REFUSED, BIENCODER),
    ('--retriever-score-scaling', '', 'true', False, '', REFUSED, BIENCODER),
    ('--block-data-path', '', 'str', None, '', REFUSED, BIENCODER),
    ('--embedding-path', '', 'str', None, '', REFUSED, BIENCODER),
    ('--indexer-batch-size', '', 'int', 128, '', REFUSED, BIENCODER),
    ('--indexer-log-interval', '', 'int', 1000, '', REFUSED, BIENCODER),
    ('--num-classes', '', 'int', 1000, '', REFUSED, VISION),
    ('--img-h', '', 'int', 224, '', REFUSED, VISION),
    ('--img-w', '', 'int', 224, '', REFUSED, VISION),
    ('--num-channels', '', 'int', 3, '', REFUSED, VISION),
    ('--patch-dim', '', 'int', 16, '', REFUSED, VISION),
    ('--classes-fraction', '', 'float', 1.0, '', REFUSED, VISION),
    ('--data-per-class-fraction', '', 'float', 1.0, '', REFUSED, VISION),
    ('--no-data-sharding', 'data_sharding', 'false', True, '', REFUSED, VISION),
    ('--head-lr-mult', '', 'float', 1.0, '', REFUSED, VISION),
    ('--vision-pretraining', '', 'true', False, '', REFUSED, VISION),
    ('--vision-pretraining-type', '', 'str', 'classify', 'classify|inpaint|dino', REFUSED, VISION),
    ('--vision-backbone-type', '', 'str', 'vit', 'vit|mit|swin', REFUSED, VISION),
    ('--swin-backbone-type', '', 'str', 'tiny', 'tiny|base|h3', REFUSED, VISION),
    ('--mask-type', '', 'str', 'random', 'random|row', REFUSED, VISION),
    ('--mask-factor', '', 'float', 1.0, '', REFUSED, VISION),
    ('--iter-per-epoch', '', 'int', 1250, '', REFUSED, VISION),
    ('--dino-local-img-size', '', 'int', 96, '', REFUSED, VISION),
    ('--dino-local-crops-number', '', 'int', 10, '', REFUSED, VISION),
    ('--dino-head-hidden-size', '', 'int', 2048, '', REFUSED, VISION),
    ('--dino-bottleneck-size', '', 'int', 256, '', REFUSED, VISION),
    ('--dino-freeze-last-layer', '', 'float', 1, '', REFUSED, VISION),
    ('--dino-norm-last-layer', '', 'true', False, '', REFUSED, VISION),
    ('--dino-warmup-teacher-temp', '', 'float', 0.04, '', REFUSED, VISION),
    ('--dino-teacher-temp', '', 'float', 0.07, '', REFUSED, VISION),
    ('--dino-warmup-teacher-temp-epochs', '', 'int', 30, '', REFUSED, VISION),
    ('--log-progress', '', 'true', False, '', WORKS, None),
    ('--no-barrier-with-level-1-timing', 'barrier_with_L1_time',
     'false', True, '', NO_EFFECT, BARRIER),
    ('--wandb-entity', '', 'str', None, '', WORKS, None),
    ('--logging-level', '', 'int', None, '', WORKS, None),
    ('--log-energy', '', 'true', False, '', NO_EFFECT, ENERGY),
    ('--moe-routing-trace-path', '', 'str', None, '', WORKS, None),
    ('--moe-routing-trace-max-training-iters', '', 'int', None, '', WORKS, None),
    ('--moe-routing-trace-capture-logits', '', 'true', False, '', WORKS, None),
    ('--moe-routing-trace-capture-hidden-states', '', 'true', False, '', WORKS, None),
    ('--moe-routing-trace-dump-weights', '', 'true', False, '', WORKS, None),
    ('--otel-enabled', '', 'true', False, '', REFUSED, OTEL),
    ('--otel-service-name', '', 'str', None, '', REFUSED, OTEL),
    ('--otel-span-groups', '', 'str+', None, '', REFUSED, OTEL),
    ('--run-workload-inspector-server', '', 'true', False, '', NO_EFFECT, INSPECTOR),
    ('--inference-batch-times-seqlen-threshold', '', 'int', -1, '', REFUSED, INFERENCE),
    ('--max-tokens-to-oom', '', 'int', 12000, '', WORKS, None),
    ('--output-bert-embeddings', '', 'true', False, '', REFUSED, INFERENCE),
    ('--bert-embedder-type', '', 'str', 'megatron', 'megatron|huggingface', REFUSED, INFERENCE),
    ('--cuda-graph-scope', 'cuda_graph_scope_deprecated', 'str+', None, '', REFUSED, CUDA_GRAPH),
    ('--cuda-graph-modules', '', 'str+', [], '', REFUSED, CUDA_GRAPH),
    ('--use-legacy-static-engine', '', 'true', False, '', REFUSED, INFERENCE),
    ('--inference-max-requests', '', 'int', 8, '', REFUSED, INFERENCE),
    ('--inference-max-seq-length', '', 'int', 2560, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching', '', 'true', False, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-buffer-size-gb', '', 'float', 40.0, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-paused-buffer-size-gb', '',
     'float', None, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-mamba-memory-ratio', '', 'float', None, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-block-size', '', 'int', 256, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-max-requests', '', 'int', None, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-max-tokens', '', 'int', None, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-num-cuda-graphs', '', 'int', 16, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-track-paused-request-events', '',
     'true', False, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-track-generated-token-events', '',
     'true', False, '', REFUSED, INFERENCE),
    ('--decode-only-cuda-graphs', '', 'true', False, '', REFUSED, INFERENCE),
    ('--inference-cuda-graph-all-prefills', '', 'true', False, '', REFUSED, INFERENCE),
    ('--inference-cuda-graph-max-tokens', '', 'int', 512, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-unified-memory-level', '', 'int', 0, '0|1', REFUSED, INFERENCE),
    ('--enable-chunked-prefill', '', 'true', False, '', REFUSED, INFERENCE),
    ('--num-speculative-tokens', '', 'int', 0, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-prefix-caching --no-inference-dynamic-batching-prefix-caching',
     'inference_dynamic_batching_enable_prefix_caching', 'bool?', False, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-prefix-caching-eviction-policy', '',
     'str', 'ref_zero', 'ref_zero|lru', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-prefix-caching-coordinator-policy',
     '', 'str', 'load_balanced', 'longest_prefix|first_prefix_block|load_balanced', REFUSED,
     INFERENCE),
    ('--inference-dynamic-batching-prefix-caching-routing-alpha', '',
     'float', 0.5, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-prefix-caching-mamba-gb', '',
     'float', None, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-cuda-graph-mixed-prefill-count', '',
     'int', 16, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-cuda-graph-sizing-distribution', '',
     'str', 'exponential', 'exponential|linear', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-sampling-backend', '',
     'str', 'torch', 'torch|flashinfer', REFUSED, INFERENCE),
    ('--use-same-sampling-seed-across-dp-ranks', 'offset_sampling_seed_by_dp_rank',
     'false', True, '', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-async-sched-mode', '',
     'str', 'legacy', 'legacy|async', REFUSED, INFERENCE),
    ('--inference-dynamic-batching-logprobs-mode', '',
     'str', 'raw_logprobs', 'raw_logprobs|processed_logprobs', REFUSED, INFERENCE),
    ('--inference-logging-step-interval', '', 'int', 0, '', REFUSED, INFERENCE),
    ('--inference-text-gen-server-logging --no-inference-text-gen-server-logging', '',
     'bool?', False, '', REFUSED, INFERENCE),
    ('--inference-wandb-logging --no-inference-wandb-logging', '',
     'bool?', False, '', REFUSED, INFERENCE),
    ('--inference-coordinator-port', '', 'int', None, '', REFUSED, INFERENCE),
    ('--mamba-inference-conv-states-dtype', '',
     'str', 'bf16', 'bf16|fp16|fp32', REFUSED, INFERENCE),
    ('--mamba-inference-ssm-states-dtype', '',
     'str', 'bf16', 'bf16|fp16|fp32', REFUSED, INFERENCE),
    ('--inference-use-synchronous-zmq-collectives --no-inference-use-synchronous-zmq-collectives',
     '', 'bool?', False, '', REFUSED, INFERENCE),
    ('--inference-disable-ep-consensus --no-inference-disable-ep-consensus', '',
     'bool?', False, '', REFUSED, INFERENCE),
    ('--inference-shards', '', 'int', None, '', REFUSED, INFERENCE),
    ('--fp4-param-gather', '', 'true', False, '', REFUSED, FP8),
    ('--fp8-param-gather', '', 'true', False, '', REFUSED, FP8),
    ('--te-precision-config-file', '', 'str', None, '', REFUSED, FP8),
    ('--enable-experimental', '', 'true', False, '', NO_EFFECT, EXPERIMENTAL),
    ('--spec', '', 'str*', None, '', REFUSED, SPEC),
    ('--hybrid-layer-pattern', '', 'str', None, '', REFUSED, MAMBA),
    ('--hybrid-override-pattern', '', 'str', None, '', REFUSED, MAMBA),
    ('--yaml-cfg', '', 'str', None, '', WORKS, None),
    ('--megatron-fsdp-enable-fine-grained-param-gather', '', 'true', False, '', NO_EFFECT, FSDP_RUNTIME),
    ('--megatron-fsdp-max-pool-double-buffer', '', 'true', False, '', NO_EFFECT, FSDP_RUNTIME),
    ('--fsdp-db-use-persist-buf-on-alloc-fail', '', 'true', False, '', NO_EFFECT, FSDP_RUNTIME),
    ('--no-one-logger', 'enable_one_logger', 'false', True, '', NO_EFFECT, ONE_LOGGER),
    ('--one-logger-project', '', 'str', 'megatron-lm', '', NO_EFFECT, ONE_LOGGER),
    ('--one-logger-run-name', '', 'str', None, '', NO_EFFECT, ONE_LOGGER),
    ('--one-logger-async', '', 'true', False, '', NO_EFFECT, ONE_LOGGER),
    ('--app-tag-run-name', '', 'str', None, '', NO_EFFECT, ONE_LOGGER),
    ('--app-tag-run-version', '', 'str', '0.0.0', '', NO_EFFECT, ONE_LOGGER),
    ('--inprocess-restart', '', 'true', False, '', REFUSED, RESILIENCY),
    ('--inprocess-max-iterations', '', 'int', None, '', REFUSED, RESILIENCY),
    ('--inprocess-monitor-thread-interval', '', 'float', 1.0, '', REFUSED, RESILIENCY),
    ('--inprocess-monitor-process-interval', '', 'float', 1.0, '', REFUSED, RESILIENCY),
    ('--inprocess-progress-watchdog-interval', '', 'float', 1.0, '', REFUSED, RESILIENCY),
    ('--inprocess-heartbeat-interval', '', 'float', 30, '', REFUSED, RESILIENCY),
    ('--inprocess-soft-timeout', '', 'float', 60, '', REFUSED, RESILIENCY),
    ('--inprocess-hard-timeout', '', 'float', 90, '', REFUSED, RESILIENCY),
    ('--inprocess-heartbeat-timeout', '', 'float', 60, '', REFUSED, RESILIENCY),
    ('--inprocess-barrier-timeout', '', 'float', 120, '', REFUSED, RESILIENCY),
    ('--inprocess-completion-timeout', '', 'float', 120, '', REFUSED, RESILIENCY),
    ('--inprocess-last-call-wait', '', 'float', 1, '', REFUSED, RESILIENCY),
    ('--inprocess-termination-grace-time', '', 'float', 1, '', REFUSED, RESILIENCY),
    ('--inprocess-granularity', '', 'str', 'node', 'node|rank', REFUSED, RESILIENCY),
    ('--inprocess-active-world-size', '', 'int', 1, '', REFUSED, RESILIENCY),
    ('--inprocess-empty-cuda-cache', '', 'true', False, '', REFUSED, RESILIENCY),
    ('--enable-ft-package', '', 'true', False, '', REFUSED, RESILIENCY),
    ('--calc-ft-timeouts', '', 'true', False, '', REFUSED, RESILIENCY),
    ('--ft-num-warmup-iters', '', 'int', 5, '', REFUSED, RESILIENCY),
    ('--enable-msc', '', 'true', False, '', WORKS, None),
    ('--disable-msc', 'disable_msc_deprecated', 'true', False, '', NO_EFFECT, MSC),
    ('--fault-injector-ranks', '', 'int+', None, '', REFUSED, RESILIENCY),
    ('--fault-injector-num-ranks', '', 'int', None, '', REFUSED, RESILIENCY),
    ('--fault-injector-fault-types', '', 'str+', None, '', REFUSED, RESILIENCY),
    ('--fault-injector-fault-probabilities', '', 'float+', None, '', REFUSED, RESILIENCY),
    ('--fault-injector-fault-delay', '', 'float', None, '', REFUSED, RESILIENCY),
    ('--fault-injector-delay-start-iteration', '', 'int', None, '', REFUSED, RESILIENCY),
    ('--fault-injector-mtti-seconds', '', 'float', None, '', REFUSED, RESILIENCY),
    ('--fault-injector-offset-seconds', '', 'float', None, '', REFUSED, RESILIENCY),
    ('--fault-injector-seed', '', 'int', None, '', REFUSED, RESILIENCY),
    ('--save-interval --persistent-save-interval', '', 'int', None, '', WORKS, None),
    ('--no-log-loss-scale-to-tensorboard --disable-log-loss-scale-to-tensorboard',
     'log_loss_scale_to_tensorboard', 'false', True, '', WORKS, None),
)
