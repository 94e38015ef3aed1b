"""The run controls inside a real (tiny, one-rank) GPT run: the parameter-group map written at
set-up against the optimizer's own groups, and a run with the device self-test, the timeout
after start-up and the map together giving the same losses, bit for bit, as a plain run."""

import datetime

import pytest
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training import distributed_controls, param_group_map
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _setup(flags):
    import pretrain_gpt
    from megatron.tokenizer import build_tokenizer
    from megatron.training import global_vars
    from megatron.training.arguments import build_configs, parse_args, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    args = validate_args(parse_args(argv=flags))
    pstate = initialize_megatron(args)
    global_vars.set_global_variables(args=args, tokenizer=build_tokenizer(args),
                                     parallel_state=pstate)
    try:
        build_configs(args)
        return setup_model_and_optimizer(pretrain_gpt.model_provider, args, pstate)
    finally:
        global_vars.unset_global_variables()


@pytest.mark.parametrize("extra,prefix", [([], "module."), (["--bf16"], "module.module.")])
def test_param_group_map_holds_each_parameter_and_its_optimizer_group(corpus, tmp_path, extra,
                                                                      prefix):
    path = str(tmp_path / "pgmap")
    flags = gpt_flags(corpus, 2, extra=["--dump-param-to-param-group-map", path,
                                        "--num-layers", "3", *extra])
    chunks, optimizer, _ = _setup(flags)
    written = param_group_map.read_param_to_param_group_map(path)
    groups = optimizer.param_groups
    assert len(written) == sum(1 for _ in chunks[0].parameters())
    # One process: the global group index is the optimizer's own index, each group holds as
    # many parameters as the map sends to it, and the settings follow the names.
    assert sorted(set(written.values())) == list(range(len(groups)))
    for i, group in enumerate(groups):
        assert list(written.values()).count(i) == len(group["params"])
    for name, index in written.items():
        assert name.startswith(prefix) and not name.startswith(prefix + "module.")
        no_decay = name.endswith(".bias") or "layernorm" in name or "layer_norm" in name
        assert groups[index]["wd_mult"] == (0.0 if no_decay else 1.0), name
    for i in range(3):
        assert f"{prefix}decoder.layers.{i}.self_attention.linear_qkv.weight" in written
    assert prefix + "embedding.word_embeddings.weight" in written
    if not extra:  # fp32: the optimizer steps the model's own parameters
        by_param = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        local = dict(chunks[0].named_parameters())
        qkv = next(n for n in local if n.endswith("layers.2.self_attention.query_key_value.weight"))
        assert written[prefix + "decoder.layers.2.self_attention.linear_qkv.weight"] == \
            by_param[id(local[qkv])]


@pytest.mark.slow
def test_controls_leave_the_losses_bit_identical(corpus, tmp_path, capsys):
    base = gpt_flags(corpus, 3)
    plain = run_pretrain(base + ["--distributed-timeout-minutes", "7"])
    # Every group is created with --distributed-timeout-minutes (the hang tests end on the
    # shorter timeout after start-up, so this is where the creation timeout is checked).
    groups = distributed_controls.process_groups()
    assert len(groups) >= 4  # world, tp, pp, dp, ...
    assert {distributed_controls.group_timeout(g) for g in groups} == \
        {datetime.timedelta(minutes=7)}
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    capsys.readouterr()
    controlled = run_pretrain(base + ["--gpu-sniff-test-interval", "2",
                                      "--distributed-timeout-seconds-after-init", "123",
                                      "--dump-param-to-param-group-map", str(tmp_path / "map")])
    out = capsys.readouterr().out
    assert controlled["losses"] == plain["losses"]
    assert "GPU sniff test -- startup" in out and "GPU sniff test -- iteration        2" in out
    assert "iteration        1" not in out.split("GPU sniff test -- startup")[1].split(
        "Result")[0]
    assert out.count("Result: ALL RANKS OK") == 2 and "GEMM 512x512x512 [TFLOP/s]" in out
    assert distributed_controls.group_timeout(dist.group.WORLD) == \
        datetime.timedelta(seconds=123)
    assert param_group_map.read_param_to_param_group_map(str(tmp_path / "map"))


def _map_body(flags, path):
    _setup(flags)
    return param_group_map.read_param_to_param_group_map(path)


@pytest.mark.slow
def test_param_group_map_over_pipeline_stages_numbers_layers_globally(corpus, tmp_path):
    from tests.multiprocess import run_on_ranks

    path = str(tmp_path / "pgmap")
    flags = gpt_flags(corpus, 2, extra=["--dump-param-to-param-group-map", path,
                                        "--num-layers", "4", "--pipeline-model-parallel-size",
                                        "2", "--decoupled-lr", "1e-3"])
    written = run_on_ranks(_map_body, 2, flags, path)[0]
    for layer in range(4):
        assert f"module.decoder.layers.{layer}.self_attention.linear_qkv.weight" in written
    # The embedding (stage 0) and the output layer (stage 1) have --decoupled-lr groups of
    # their own; the shared settings mean one index, whichever rank holds the parameter.
    embedding = written["module.embedding.word_embeddings.weight"]
    layers = {written[f"module.decoder.layers.{i}.self_attention.linear_qkv.weight"]
              for i in range(4)}
    assert len(layers) == 1 and embedding not in layers
    assert written.get("module.output_layer.weight", embedding) == embedding
