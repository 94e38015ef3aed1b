"""--init-model-with-meta-device: the model is built on the meta device and each FSDP2 rank
materialises only its shards. The reference is the ordinary build at the same seed: the
gathered initial weights are bit for bit the same (TP 1 and 2, SwiGLU, untied output layer,
both FSDP flags), and so are the losses of a short run with dropout (so the global RNG
streams after the build are untouched too)."""

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

META = ["--init-model-with-meta-device"]
FSDP2 = ["--use-torch-fsdp2"]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer",
                 "--no-gradient-accumulation-fusion"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra):
    return gpt_flags(corpus, 3, micro_batch=2, global_batch=8,
                     extra=["--swiglu", "--untie-embeddings-and-output-weights", *extra])


def _initial_state(flags):
    """The whole model (gathered from the shards) right after setup, whether every parameter
    and buffer is on the run's device, a draw of the RNG after setup, and for each meta build
    whether all its parameters were on the meta device."""
    import pretrain_gpt
    from megatron.tokenizer import build_tokenizer
    from megatron.training import global_vars, meta_device_init
    from megatron.training.arguments import build_configs, parse_args, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    original, on_meta = meta_device_init.build_on_meta, []

    def spy(build):
        chunks, pieces, snapshot = original(build)
        on_meta.append(all(p.is_meta for c in chunks for p in c.parameters()))
        return chunks, pieces, snapshot

    meta_device_init.build_on_meta = spy
    args = validate_args(parse_args(argv=flags))
    pstate = initialize_megatron(args)
    global_vars.set_global_variables(args=args, tokenizer=build_tokenizer(args),
                                     parallel_state=pstate)
    try:
        build_configs(args)
        model, _, _ = setup_model_and_optimizer(pretrain_gpt.model_provider, args, pstate)
        state = model[0].state_dict()
        on_device = all(not t.is_meta for t in list(model[0].parameters())
                        + list(model[0].buffers()))
        return ({k: v.detach().clone() for k, v in state.items()}, on_device, torch.rand(3),
                on_meta)
    finally:
        meta_device_init.build_on_meta = original
        global_vars.unset_global_variables()


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    pytest.param(FSDP2, id="fsdp2-dp2"),
    pytest.param(FSDP2 + ["--tensor-model-parallel-size", "2"], id="fsdp2-tp2-dp2"),
    pytest.param(MEGATRON_FSDP, id="megatron-fsdp-dp2")])
def test_initial_weights_are_bit_identical(corpus, extra):
    ranks = 4 if "--tensor-model-parallel-size" in extra else 2
    ordinary = run_on_ranks(_initial_state, ranks, _flags(corpus, extra))
    meta = run_on_ranks(_initial_state, ranks, _flags(corpus, extra + META))
    for rank, ((want, _, want_rng, no_meta), (got, on_device, got_rng, built_on_meta)) in \
            enumerate(zip(ordinary, meta)):
        assert no_meta == [] and built_on_meta == [True], rank
        assert on_device, rank
        assert sorted(got) == sorted(want)
        for key in want:
            assert torch.equal(got[key], want[key]), (rank, key)
        assert torch.equal(got_rng, want_rng), rank   # the RNG stream after setup


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    pytest.param([], id="learned-positions"),
    # rope's angle table is no parameter or buffer: it must be real after a meta build
    pytest.param(["--position-embedding-type", "rope", "--use-rope-scaling"], id="rope")])
def test_training_losses_are_bit_identical(corpus, extra):
    ordinary = run_on_ranks(run_pretrain, 2, _flags(corpus, FSDP2 + extra))[-1]["losses"]
    meta = run_on_ranks(run_pretrain, 2, _flags(corpus, FSDP2 + extra + META))[-1]["losses"]
    assert meta == ordinary
