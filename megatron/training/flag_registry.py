"""Megatron flags that this project's own argument groups define but do not act on, each with
the reason.

:mod:`megatron.training.arguments` merges both lists with the no-effect and refused rows of
:mod:`megatron.training.megatron_flags_table` (the options of Megatron-LM's parser that the
argument groups do not define) into its ``NO_EFFECT_FLAGS`` / ``UNSUPPORTED_FLAGS``: their
``--help`` texts come from them, and ``validate_args`` notes a no-effect flag once, and stops with
one line on an unsupported flag set to anything but its default.
``tests/unit/test_flag_audit.py`` checks that every other flag is used somewhere.
"""


# Flags Megatron launch scripts pass that change nothing here, by the nature of this codebase.
# They parse so that those scripts run; --help says why they have no effect, and a run that sets
# one prints one note. dest -> reason.
NO_EFFECT_FLAGS = {
    "deprecated_use_mcore_models": "there is one model implementation",
    "use_legacy_models": "there is one model implementation",
    "use_cpu_initialization": "weights are always drawn on the full shape from one seed (on the "
                              "CPU generator) and then split, so every layout gets the same model",
    "lazy_mpu_init": "process groups are always created by initialize_megatron",
    "DDP_impl": "the grad-buffer data-parallel wrapper is used with either value; both average "
                "gradients the same way",
    "use_contiguous_buffers_in_local_ddp": "gradients always live in one contiguous buffer",
    "no_persist_layer_norm": "there is one layer-norm kernel (no persistent variant to opt out of)",
    "async_tensor_model_parallel_allreduce": "the input-gradient all-reduce of column-parallel "
                                             "layers always overlaps the weight-gradient matmul; "
                                             "the numbers are the same either way",
    "scatter_gather_tensors_in_pipeline": "pipeline messages are never split over "
                                          "tensor-parallel ranks",
    "delay_grad_reduce": "with --overlap-grad-reduce each model chunk's reduction starts in its "
                         "last micro-batch's backward; when it starts does not change the numbers",
    "delay_param_gather": "with --overlap-param-gather the all-gather starts at the same point "
                          "either way; the numbers are the same",
    "overlap_p2p_communication": "pipeline sends and receives complete before compute goes on; "
                                 "the numbers are the same as with the overlap",
    "num_dataset_builder_threads": "datasets are built one after another; the result is the same",
    "mmap_warmup": "datasets are memory-mapped and read on demand",
    "moe_router_aux_loss_fusion": "a fusion of the balancing-loss computation (a flag of some "
                                  "Megatron releases); there is one implementation and the "
                                  "numbers are the same",
    "data_impl": "only the mmap .bin/.idx format exists",
    "dataset_impl": "only the mmap .bin/.idx format exists",
    "create_attention_mask_in_dataloader": "the causal mask is made inside attention; a batch "
                                           "mask is built only for --reset-attention-mask",
    "auto_detect_ckpt_format": "loading always detects whether --load holds a torch or a "
                               "torch_dist checkpoint",
    "ckpt_fully_parallel_save_deprecated": "every rank always writes its own torch_dist shards",
    "ckpt_fully_parallel_save": "every rank always writes its own torch_dist shards",
    "ckpt_fully_parallel_load": "every rank always reads only the slices it needs",
    "non_persistent_local_ckpt_algo": "a local non-persistent checkpoint is always each rank's "
                                      "whole state, written atomically; both algorithms load "
                                      "back the same state",
    "logits_load_msc_prefetch_depth": "it sets how many whole teacher shards are fetched ahead "
                                      "from object storage through the Multi-Storage Client "
                                      "(msc://); teacher logits are read from local folders "
                                      "only here (an msc:// --logits-load-dir is refused), with "
                                      "--logits-load-prefetch-factor",
    "moe_shared_expert_overlap": "a scheduling optimisation (the shared expert runs while tokens "
                                 "travel between expert-parallel ranks); the shared expert is "
                                 "computed after the routed experts, with the same numbers",
}

# Flags this project does not support: set to anything but their default, validate_args stops
# with one line naming the flag and what to use instead. dest -> what to do instead.
UNSUPPORTED_FLAGS = {
    "decoder_num_layers": "it sizes the decoder of encoder-decoder models (T5), which are not "
                          "built here; use --num-layers",
    "decoder_seq_length": "it sizes the decoder of encoder-decoder models (T5), which are not "
                          "built here; use --seq-length",
    "pipeline_model_parallel_split_rank": "it splits encoder-decoder models (T5) over pipeline "
                                          "stages, which are not built here; drop it",
    "use_ring_exchange_p2p": "it needs a PyTorch built with ring_exchange; drop it (batched "
                             "isend/irecv are used)",
    "onnx_safe": "nothing is exported to ONNX here; drop it",
    "sample_rate": "training data are not sub-sampled here; use blend weights in --data-path "
                   "instead",
}
