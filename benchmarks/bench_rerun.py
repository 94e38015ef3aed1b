"""Overhead of result validation (--rerun-mode validate_results) on a clean run.

Three configurations of the same small GPT run train side by side in one process (one gloo
rank on CPU), round-robin, ``--repeats`` times each:

* ``plain``: no checks;
* ``disabled``: --check-for-nan-in-loss-and-grad with --rerun-mode disabled (the plain stop);
* ``validate``: the same check with --rerun-mode validate_results, plus --check-for-spiky-loss
  and --check-for-large-grads (RNG snapshot, micro-batch replay buffer, loss values and this
  rank's gradient sum of squares every step; no step is rejected, so nothing is re-run).

A step's time is that of ``train_step`` (the first step of each run left out), wall clock and
this process's CPU time; the table gives each configuration's median wall time and its fastest
step's CPU time (the steadiest number on a shared machine), and the ratios. The losses of the three are checked
to be bit-identical.

Run::

    python benchmarks/bench_rerun.py [--iters 12] [--repeats 3] [--hidden 128] [--layers 4]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CONFIGS = {
    "plain": [],
    "disabled": ["--check-for-nan-in-loss-and-grad", "--rerun-mode", "disabled"],
    "validate": ["--check-for-nan-in-loss-and-grad", "--rerun-mode", "validate_results",
                 "--check-for-spiky-loss", "--check-for-large-grads"],
}


def _flags(corpus, opts, extra):
    from tests.functional.gpt_runs import VOCAB_SIZE

    return f"""
    --num-layers {opts.layers} --hidden-size {opts.hidden} --num-attention-heads 4
    --seq-length {opts.seq} --max-position-embeddings {opts.seq} --micro-batch-size 2
    --global-batch-size 8 --lr 1e-3 --train-iters {opts.iters} --log-interval 1000
    --eval-iters 0 --eval-interval 1000 --tokenizer-type NullTokenizer --vocab-size {VOCAB_SIZE}
    --split 90,8,2 --num-workers 0 --device cpu --seed 1234 --hidden-dropout 0.1
    --attention-dropout 0.1 --data-path {corpus}
    """.split() + extra


def _one_run(argv):
    """(step times after the first, losses) of one pretrain run."""
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.training import global_vars, training

    real_step, times = training.train_step, []

    def timed(*a, **k):
        start, cpu = time.perf_counter(), time.process_time()
        out = real_step(*a, **k)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
        return out

    training.train_step = timed
    try:
        state = training.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                                  pretrain_gpt.model_provider, None, pretrain_gpt.forward_step,
                                  argv=argv)
    finally:
        training.train_step = real_step
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()
    return times[1:], [loss for _, loss in state.train_loss_history]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    opts = parser.parse_args()
    from megatron.core import device
    from tests.functional.gpt_runs import write_counting_corpus

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    device.configure("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_counting_corpus(os.path.join(tmp, "corpus", "count"), num_docs=2000)
        times = {name: [] for name in CONFIGS}
        losses = {}
        for _ in range(opts.repeats):
            for name, extra in CONFIGS.items():
                step_times, run_losses = _one_run(_flags(corpus, opts, extra))
                times[name] += step_times
                losses.setdefault(name, run_losses)
                assert repr(run_losses) == repr(losses[name]), name
    same = repr(losses["plain"]) == repr(losses["disabled"]) == repr(losses["validate"])
    median = {name: statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu = {name: min(c for _, c in t) for name, t in times.items()}
    print(f"hidden {opts.hidden}, layers {opts.layers}, seq {opts.seq}, global batch 8 "
          f"(4 micro-batches), {opts.iters} iterations x {opts.repeats} repeats, "
          f"threads {torch.get_num_threads()}")
    print("| configuration | median step, wall | fastest step, CPU | CPU ratio to plain | CPU ratio to "
          "disabled | wall ratio to disabled |")
    print("|---|---|---|---|---|---|")
    for name in CONFIGS:
        print(f"| {name} | {median[name] * 1e3:.1f} ms | {cpu[name] * 1e3:.1f} ms | "
              f"{cpu[name] / cpu['plain']:.3f} | {cpu[name] / cpu['disabled']:.3f} | "
              f"{median[name] / median['disabled']:.3f} |")
    print(f"losses bit-identical across the three: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
