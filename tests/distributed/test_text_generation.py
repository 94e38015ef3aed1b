"""Generation with the key/value cache, in one process and across TP = 2 and PP = 2 ranks.

In one process (float64): the model fed the prompt and then one token at a time through the
cache gives the logits of the full forward pass (~1e-16 apart; 1e-12 allows for summation order
and still catches a wrong position or mask, which moves logits by 1e-2 or more), for learned
and rotary positions, grouped-query attention and the SDPA body; greedy generation is the same
with and without the cache.

Across layouts: a tiny GPT (fp32) is built from a fixed seed and saved through the real
checkpoint code by each layout (TP = 1, TP = 2, PP = 2); the weights are the same under every
split, and each run loads them into a model built from another seed (so the load must work).
Requests then run as the server runs them (rank 0 prepares a payload, every rank generates).
Checked: greedy output with and without the cache; token ids never in the padded vocabulary
(the random padded rows would win argmax otherwise, which the test confirms); stop tokens;
log-probs against log_softmax over the whole padded vocabulary (Megatron's normalisation) of an
independent full forward (fp32, ~1e-7 relative apart; tolerance 2e-5); every rank of a layout
returning the same result; and TP = 2, PP = 2 and CP = 2 returning the TP = 1 tokens (sampled
ones too: same seed) with log-probs within 2e-5.
With ``--context-parallel-size 2`` the two ranks generate whole sequences as data-parallel
replicas (``megatron/inference.py``); before that, the cache-less and scoring requests ran on a
model that expected half of each sequence and failed.
"""

import types

import pytest
import torch

from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel
from megatron.text_generation.generation import GenerationError, generate_tokens
from megatron.text_generation.inference_params import InferenceParams
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import make_config, single_process_state

# NullTokenizer: ids 0..127 and the end of document appended as 128 (--null-tokenizer-eod-id
# 128), so vocab_size 129, padded to 256
VOCAB = 128
TOKENIZER_VOCAB = VOCAB + 1
MODEL_FLAGS = """--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32
--max-position-embeddings 32 --tokenizer-type NullTokenizer --vocab-size 128
--null-tokenizer-eod-id 128 --device cpu
--seed 1234 --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.2""".split()
ROPE_FLAGS = ["--position-embedding-type", "rope", "--group-query-attention",
              "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
              "--untie-embeddings-and-output-weights"]
PROMPTS = ["1 2 3", "5 6 7 8 9 10 11", "42"]
LOGPROB_ATOL = 2e-5


# ---------------------------------------------------------------------------- one process

VARIANTS = {
    "learned": {},
    "rope_gqa": dict(position_embedding_type="rope", rotary_percent=0.5, num_query_groups=2,
                     normalization="RMSNorm", swiglu=True),
    "sdpa": dict(use_flash_attn=True),
}
# A window (3 keys back) on layer 1, full layer 2, attention sinks: the cached steps' band must
# end at each new token's own position.
CACHE_VARIANTS = dict(VARIANTS, window_sinks=dict(window_size=(3, 0), window_attn_skip_freq=2,
                                                  softmax_type="learnable"),
                      window_sdpa=dict(use_flash_attn=True, window_size=(2, 0)))
SINGLE = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, tp_ranks=[0],
                               pp_group=None, pp_size=1, pp_rank=0, pp_ranks=[0])


def _model(**overrides):
    model_parallel_cuda_manual_seed(1234, 0)
    config = make_config(init_method_std=0.2, **overrides)
    return GPTModel(config, single_process_state(), init_seed=7).eval()


@pytest.mark.parametrize("variant", list(CACHE_VARIANTS))
def test_cached_steps_give_the_full_forward_logits(variant):
    model = _model(**CACHE_VARIANTS[variant])
    ids = torch.randint(0, 100, (2, 13), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(13).expand(2, 13)
    cache = InferenceParams(max_batch_size=2, max_sequence_length=16)
    with torch.no_grad():
        full = model(ids, pos, None)                                      # [b, s, V]
        steps = [model(ids[:, :5], pos[:, :5], None, inference_params=cache)]
        cache.sequence_len_offset = 5
        for t in range(5, 13):
            steps.append(model(ids[:, t:t + 1], pos[:, t:t + 1], None, inference_params=cache))
            cache.sequence_len_offset += 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)
    keys, values = cache.key_value_memory_dict[1]
    groups = CACHE_VARIANTS[variant].get("num_query_groups", 4)
    assert keys.shape == values.shape == (16, 2, groups, 8)
    assert sorted(cache.key_value_memory_dict) == [1, 2]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_same_with_and_without_cache(variant):
    model = _model(**VARIANTS[variant])
    tokens = torch.zeros(3, 16, dtype=torch.int64)
    lengths = torch.tensor([2, 6, 4])
    for i, n in enumerate(lengths.tolist()):
        tokens[i, :n] = torch.arange(10 * i, 10 * i + n)
    kw = dict(vocab_size=100, stop_token=127, top_k=1, return_log_probs=True)
    cached = generate_tokens(model, SINGLE, tokens, lengths, use_kv_cache=True, **kw)
    plain = generate_tokens(model, SINGLE, tokens, lengths, use_kv_cache=False, **kw)
    assert torch.equal(cached.tokens, plain.tokens)
    torch.testing.assert_close(cached.log_probs, plain.log_probs, rtol=0, atol=1e-12)
    for i, n in enumerate(lengths.tolist()):          # each prompt kept until it runs out
        assert torch.equal(cached.tokens[i, :n], tokens[i, :n])
    assert len(set(cached.tokens[:, 6:].flatten().tolist())) > 3   # not one repeated token


def test_too_long_and_empty_requests_are_refused():
    model = _model()
    tokens = torch.zeros(1, 17, dtype=torch.int64)
    with pytest.raises(GenerationError, match="--max-position-embeddings"):
        generate_tokens(model, SINGLE, tokens, torch.tensor([3]), vocab_size=100, stop_token=0)
    with pytest.raises(GenerationError, match="add_BOS"):
        generate_tokens(model, SINGLE, tokens[:, :8], torch.tensor([0]), vocab_size=100,
                        stop_token=0)


# ---------------------------------------------------------------------------- across ranks

def _serve(model, pstate, tokenizer, body, use_kv_cache=True):
    """Run one request as the server does: rank 0 prepares, all ranks generate."""
    import torch.distributed as dist

    from megatron.text_generation import api

    payload = None
    if dist.get_rank() == 0:
        payload = api.prepare_payload(api.parse_request(body), tokenizer, 32)
    payload = api.broadcast_payload(payload, torch.device("cpu"))
    output = api.generate_from_payload(model, pstate, payload, torch.device("cpu"), use_kv_cache)
    return api.post_process(output, tokenizer, body.get("logprobs", False))


def _complete(model, pstate, tokenizer, body):
    """A ``POST /completions`` request as the server runs it; its choices (the id and time
    differ from call to call)."""
    import torch.distributed as dist

    from megatron.text_generation import api, completions

    request = completions.parse_completion(body)
    payload = None
    if dist.get_rank() == 0:
        payload = completions.prepare_completion(request, tokenizer, 32)
    payload = api.broadcast_payload(payload, torch.device("cpu"))
    output = api.generate_from_payload(model, pstate, payload, torch.device("cpu"))
    return completions.completion_response(request, payload, output, tokenizer)["choices"]


def _independent_log_probs(model, ids):
    """log p(ids[1:]) from one full forward of one sequence, normalised as Megatron does:
    over the whole padded vocabulary."""
    with torch.no_grad():
        x = torch.tensor([ids])
        logits = model(x, torch.arange(len(ids))[None], None)[0].double()   # [s, V_padded]
    log_probs = torch.log_softmax(logits, dim=-1)
    return [float(log_probs[t, ids[t + 1]]) for t in range(len(ids) - 1)], logits


def _requests(model, pstate, tokenizer, is_single):
    greedy = {"prompts": PROMPTS, "tokens_to_generate": 12, "top_k": 1, "logprobs": True}
    out = {"greedy": _serve(model, pstate, tokenizer, greedy),
           "greedy_no_cache": _serve(model, pstate, tokenizer, greedy, use_kv_cache=False)}
    stop = out["greedy"]["tokens"][0][len(PROMPTS[0].split()) + 2]   # 3rd generated token
    out["stop_token"] = stop
    out["stopped"] = _serve(model, pstate, tokenizer, dict(greedy, stop_token=stop))
    out["sampled"] = _serve(model, pstate, tokenizer, {
        "prompts": PROMPTS, "tokens_to_generate": 10, "temperature": 0.8, "random_seed": 5})
    out["top_p"] = _serve(model, pstate, tokenizer, {
        "prompts": PROMPTS, "tokens_to_generate": 10, "top_p": 0.8, "random_seed": 9})
    out["score"] = _serve(model, pstate, tokenizer, {
        "prompts": PROMPTS, "tokens_to_generate": 0, "logprobs": True})
    out["completion"] = _complete(model, pstate, tokenizer, {
        "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 3})
    if is_single:
        out["reference"] = [_independent_log_probs(model, ids)
                            for ids in out["greedy"]["tokens"]]
    return out


def _run_layout(layout_flags, save_root):
    """Per config: build, save, load into a differently seeded model, run the requests."""
    from megatron.training import checkpointing
    from megatron.training import global_vars
    from megatron.core import parallel_state
    from megatron.inference import initialize_for_inference, load_model_for_inference
    from megatron.training.training import build_model_chunks
    import pretrain_gpt

    results = {}
    for name, extra in (("learned", []), ("rope", ROPE_FLAGS)):
        save = f"{save_root}/{name}"
        args, pstate, tokenizer = initialize_for_inference(
            None, MODEL_FLAGS + extra + layout_flags + ["--save", save, "--load", save])
        args.no_save_optim = args.no_save_rng = True
        checkpointing.save_checkpoint(1, build_model_chunks(pretrain_gpt.model_provider, pstate),
                                      None, None, args, pstate)
        args.seed += 1
        chunks, iteration = load_model_for_inference(pretrain_gpt.model_provider, args, pstate)
        assert iteration == 1
        results[name] = _requests(chunks[0], pstate, tokenizer,
                                  is_single=pstate.tp_size * pstate.pp_size == 1)
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_on_ranks(_run_layout, 1, [], str(tmp_path_factory.mktemp("tp1")))[0]


def _prompt_len(i):
    return len(PROMPTS[i].split())


@pytest.mark.parametrize("config", ["learned", "rope"])
def test_single_process_generation(single, config):
    out = single[config]
    greedy = out["greedy"]
    assert greedy["tokens"] == out["greedy_no_cache"]["tokens"]
    for a, b in zip(greedy["logprobs"], out["greedy_no_cache"]["logprobs"]):
        assert a == pytest.approx(b, abs=LOGPROB_ATOL)
    masked_mattered = padded_mass_mattered = False
    for i, ids in enumerate(greedy["tokens"]):
        n = _prompt_len(i)
        assert ids[:n] == [int(t) for t in PROMPTS[i].split()]
        assert all(0 <= t < TOKENIZER_VOCAB for t in ids)
        assert greedy["text"][i] == " ".join(map(str, ids))
        assert greedy["segments"][i] == [str(t) for t in ids]
        want, logits = out["reference"][i]
        assert greedy["logprobs"][i] == pytest.approx(want, abs=LOGPROB_ATOL)
        for t in range(n - 1, len(ids) - 1):          # each generated token is the argmax
            assert ids[t + 1] == int(logits[t, :TOKENIZER_VOCAB].argmax())
            masked_mattered |= int(logits[t].argmax()) >= TOKENIZER_VOCAB
        # Normalised over the tokenizer's ids alone, the scores would be visibly higher.
        real = torch.log_softmax(logits[:, :TOKENIZER_VOCAB], dim=-1)
        over_real = [float(real[t, ids[t + 1]]) for t in range(len(ids) - 1)]
        padded_mass_mattered |= max(a - b for a, b in zip(over_real, want)) > 100 * LOGPROB_ATOL
    assert masked_mattered, "padded rows never won: the masking check proves nothing"
    assert padded_mass_mattered, "padded rows hold no mass: the normalisation check proves nothing"
    # The completions endpoint, greedy: the same tokens (up to 6 generated, without the end
    # of the document), the same log-probabilities, and each most likely token on top.
    for i, (choice, ids) in enumerate(zip(out["completion"], greedy["tokens"])):
        n = _prompt_len(i)
        kept = ids[:n + 6]
        if len(kept) > n and kept[-1] == TOKENIZER_VOCAB - 1 and len(ids) <= n + 6:
            kept = kept[:-1]
        assert choice["logprobs"]["tokens"] == [str(t) for t in kept]
        want, logits = out["reference"][i]
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            want[:len(kept) - 1], abs=LOGPROB_ATOL)
        for t in range(len(kept) - 1):
            top = choice["logprobs"]["top_logprobs"][t + 1]
            best = logits[t, :TOKENIZER_VOCAB].topk(3).indices.tolist()
            assert list(top) == [str(b) for b in best]
    # Scoring (tokens_to_generate = 0) gives the prompts' log-probs of the greedy run.
    for i, row in enumerate(out["score"]["logprobs"]):
        assert row == pytest.approx(greedy["logprobs"][i][:_prompt_len(i) - 1],
                                    abs=LOGPROB_ATOL)


@pytest.mark.parametrize("config", ["learned", "rope"])
def test_stop_token_ends_each_sequence_after_it(single, config):
    out = single[config]
    stop = out["stop_token"]
    for i, ids in enumerate(out["greedy"]["tokens"]):
        n = _prompt_len(i)
        generated = ids[n:]
        end = n + generated.index(stop) + 1 if stop in generated else len(ids)
        assert out["stopped"]["tokens"][i] == ids[:end]
        assert out["stopped"]["logprobs"][i] == pytest.approx(out["greedy"]["logprobs"][i][
            :end - 1], abs=LOGPROB_ATOL)
    assert len(out["stopped"]["tokens"][0]) <= _prompt_len(0) + 3   # it did stop early


def test_sampling_is_random_but_seeded(single):
    out = single["learned"]
    for name in ("sampled", "top_p"):
        ids = out[name]["tokens"]
        assert all(0 <= t < TOKENIZER_VOCAB for row in ids for t in row)
        assert ids != out["greedy"]["tokens"]


def _check_completion(got, want):
    for a, b in zip(got, want):
        assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"]
        la, lb = a["logprobs"], b["logprobs"]
        assert la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
        assert la["token_logprobs"][0] is lb["token_logprobs"][0] is None
        assert la["token_logprobs"][1:] == pytest.approx(lb["token_logprobs"][1:],
                                                         abs=LOGPROB_ATOL)
        for top_a, top_b in zip(la["top_logprobs"][1:], lb["top_logprobs"][1:]):
            assert top_a == pytest.approx(top_b, abs=LOGPROB_ATOL)


def _check_layout(results, single):
    for rank, result in enumerate(results[1:], start=1):
        for config in result:
            for name in ("greedy", "sampled", "top_p", "stopped", "score", "completion"):
                assert result[config][name] == results[0][config][name], (rank, config, name)
    for config in ("learned", "rope"):
        got, want = results[0][config], single[config]
        for name in ("greedy", "greedy_no_cache", "sampled", "top_p", "stopped", "score"):
            assert got[name]["tokens"] == want[name]["tokens"], (config, name)
            assert got[name]["text"] == want[name]["text"]
            if want[name]["logprobs"] is not None:
                for a, b in zip(got[name]["logprobs"], want[name]["logprobs"]):
                    assert a == pytest.approx(b, abs=LOGPROB_ATOL), (config, name)
        _check_completion(got["completion"], want["completion"])


@pytest.mark.parametrize("layout", [
    pytest.param(["--tensor-model-parallel-size", "2"], id="tp2"),
    pytest.param(["--pipeline-model-parallel-size", "2"], id="pp2"),
    pytest.param(["--context-parallel-size", "2"], id="cp2"),
])
def test_layout_generates_what_one_process_does(single, tmp_path, layout):
    _check_layout(run_on_ranks(_run_layout, 2, layout, str(tmp_path)), single)
