"""The distillation flags' checks, run by ``validate_args`` before any process group exists."""

# Megatron-LM's documented top-K when --logits-save-dir is given without --logits-save-top-k.
DEFAULT_TOP_K = 128


class _Refused(Exception):
    pass


def _refuse(message: str):
    raise _Refused(message)


def distillation_flags_problem(args):
    """What is wrong with the distillation flags (one line naming them), or None; fills in
    --logits-save-top-k (128) when saving without it. ``validate_args`` raises the line."""
    try:
        _check(args)
    except _Refused as problem:
        return str(problem)
    return None


def _check(args) -> None:
    saving, loading = args.logits_save_dir is not None, args.logits_load_dir is not None
    if not saving:
        for flag, dest in (("--logits-save-top-k", "logits_save_top_k"),
                           ("--logits-save-top-p", "logits_save_top_p")):
            if getattr(args, dest) is not None:
                _refuse(f"{flag} {getattr(args, dest)} needs --logits-save-dir")
    if not (saving or loading):
        return
    if saving and loading:
        _refuse("--logits-save-dir and --logits-load-dir cannot be used in one run: save the "
                "teacher's logits in one run, train the student on them in another")
    for flag, path in (("--logits-save-dir", args.logits_save_dir),
                       ("--logits-load-dir", args.logits_load_dir)):
        if path is not None and str(path).startswith("msc://"):
            _refuse(f"{flag} {path}: teacher logits are written and read in local or mounted "
                    "folders only here, not through the Multi-Storage Client (which serves "
                    "data and checkpoints); give a local or mounted folder")
    if saving:
        _check_save_values(args)
    if loading:
        _check_load_values(args)
    _check_layout(args)


def _check_save_values(args) -> None:
    if args.logits_save_top_k is None:
        args.logits_save_top_k = DEFAULT_TOP_K
    if args.logits_save_top_k < 1:
        _refuse(f"--logits-save-top-k {args.logits_save_top_k}: must be at least 1")
    top_p = args.logits_save_top_p
    if top_p is not None and not 0.0 < top_p <= 1.0:
        _refuse(f"--logits-save-top-p {top_p}: must be in (0, 1]")
    if args.logits_save_top_p_min_k < 1:
        _refuse(f"--logits-save-top-p-min-k {args.logits_save_top_p_min_k}: must be at least 1")


def _check_load_values(args) -> None:
    if args.logits_load_decode_threads < 1:
        _refuse(f"--logits-load-decode-threads {args.logits_load_decode_threads}: must be at "
                "least 1")
    if args.logits_load_prefetch_factor < 0:
        _refuse(f"--logits-load-prefetch-factor {args.logits_load_prefetch_factor}: must be "
                "at least 0")


def _check_layout(args) -> None:
    flag = "--logits-save-dir" if args.logits_save_dir is not None else "--logits-load-dir"
    refused = [
        (args.context_parallel_size > 1, "--context-parallel-size > 1 (each rank would hold "
                                         "part of a sample's positions)"),
        (bool(args.mtp_num_layers), "--mtp-num-layers (the MTP heads reuse the output layer)"),
        (args.calculate_per_token_loss, "--calculate-per-token-loss"),
        (args.sft, "--sft"),
        (bool(args.phase_transition_iterations), "--phase-transition-iterations (each phase "
                                                 "rebuilds the dataset, so sample indices "
                                                 "repeat)"),
    ]
    for is_set, what in refused:
        if is_set:
            _refuse(f"{flag} with {what} is not built here")
    if args.dataloader_type not in (None, "single"):
        _refuse(f"{flag} with --dataloader-type {args.dataloader_type}: teacher logits are "
                "kept by the samples' positions in the train stream, which only --dataloader-"
                "type single keeps in order")
    varying = [name for name, value in (("--rampup-batch-size", args.rampup_batch_size),
                                        ("--step-batch-size-schedule",
                                         args.step_batch_size_schedule)) if value]
    if args.logits_save_dir is not None and varying:
        _refuse(f"--logits-save-dir with {varying[0]}: the saved tars map iterations to "
                "samples with one fixed --global-batch-size")
