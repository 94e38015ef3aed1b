"""The pipeline schedules: exact order of operations, gradients, memory, deferred reduction.

Most tests run every stage of a pipeline as a thread of this process, joined by a fake
communicator with the blocking semantics of NCCL and gloo: a send completes only once the
receiver has posted the matching receive, so a schedule that could deadlock on real hardware
times out here. Each stage records its forwards (``F{mb}``, or ``F{chunk}.{mb}`` with
interleaving), backwards and exchanges (``sendF`` / ``recvF``: activation to next / from prev,
``sendB`` / ``recvB``: gradient to prev / from next, ``+`` joining one exchange). The orders are
compared with tables written out by hand, gradients with the same model run sequentially in one
thread (float64; the sums are the same sums in the same order, so they agree to 1e-12).
One test runs both schedules over real gloo ranks with the real communicator.
"""

import contextlib
import queue
import threading

import pytest
import torch

from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    pipeline_order,
)
from tests.multiprocess import run_on_ranks

H, SEQ, MB = 4, 3, 2
SHAPE = (SEQ, MB, H)
TIMEOUT_S = 20


# ------------------------------------------------------------------------- fake pipeline

class _Wire:
    """FIFO channels between stages, one per (source, destination, tag)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.channels = {}

    def channel(self, key) -> queue.Queue:
        with self.lock:
            return self.channels.setdefault(key, queue.Queue())


class ThreadComm(p2p.P2PCommunicator):
    """The real communicator's logic with ``_exchange`` done over a :class:`_Wire`."""

    def __init__(self, wire, pp_rank, pp_size, log):
        super().__init__(pp_group=None, pp_ranks=list(range(pp_size)), pp_rank=pp_rank,
                         dtype=torch.float64, device="cpu")
        self.wire, self.log, self.sent_outputs = wire, log, []

    def _exchange(self, send_next, send_prev, recv_prev, recv_next):
        r = self.pp_rank
        sends = [(t, self.next_rank, p2p.ACTIVATION_TAG, "sendF") for t in [send_next] if
                 t is not None]
        recvs = [(t, self.prev_rank, p2p.ACTIVATION_TAG, "recvF") for t in [recv_prev] if
                 t is not None]
        sends += [(t, self.prev_rank, p2p.GRADIENT_TAG, "sendB") for t in [send_prev] if
                  t is not None]
        recvs += [(t, self.next_rank, p2p.GRADIENT_TAG, "recvB") for t in [recv_next] if
                  t is not None]
        names = {"sendF": 0, "recvF": 1, "sendB": 2, "recvB": 3}
        self.log.append("+".join(sorted([s[3] for s in sends] + [x[3] for x in recvs],
                                        key=names.get)))
        if send_next is not None:
            self.sent_outputs.append(send_next)
        done = []
        for tensor, peer, tag, _ in sends:
            event = threading.Event()
            self.wire.channel((r, peer, tag)).put((tensor.detach().clone(), event))
            done.append(event)
        for buffer, peer, tag, _ in recvs:
            try:
                data, event = self.wire.channel((peer, r, tag)).get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"stage {r}: nothing from stage {peer} (tag {tag})") from None
            with torch.no_grad():
                buffer.copy_(data)
            event.set()
        for event in done:
            if not event.wait(TIMEOUT_S):
                raise TimeoutError(f"stage {r}: a send was never received (deadlock)")


class _Tag(torch.autograd.Function):
    """Identity that logs the backward of one micro-batch of one chunk and counts live graphs."""

    @staticmethod
    def forward(ctx, x, stage, label):
        ctx.stage, ctx.label = stage, label
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        stage = ctx.stage
        stage.alive -= 1
        stage.log.append("B" + ctx.label)
        stage.sync_log.append((ctx.label, stage.wrapper_sync_on()))
        return grad, None, None


class ToyChunk(torch.nn.Module):
    """Virtual stage ``index``: ``tanh(x W + c)``; the first one reads x from the batch.
    ``wide``: "out" returns ``[y; y * y]`` (``[2s, b, h]``, as a standalone MTP stage hands the
    loss stage more than one hidden state), "in" takes such an input and sums its halves,
    "through" maps such an input to one of the same shape (a stage between the two)."""

    def __init__(self, index, pre_process, wide=None):
        super().__init__()
        self.wide = wide
        gen = torch.Generator().manual_seed(100 + index)
        self.weight = torch.nn.Parameter(torch.randn(H, H, generator=gen, dtype=torch.float64)
                                         / H ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(H, generator=gen, dtype=torch.float64))
        self.pre_process = pre_process
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        inp = x if self.pre_process else self.input_tensor
        if self.wide == "in":
            first, second = inp.chunk(2, dim=0)                  # [s, b, h] each
            inp = first + second
        out = torch.tanh(inp @ self.weight + self.bias)          # [s, b, h] ([2s, b, h])
        return torch.cat([out, out * out], dim=0) if self.wide == "out" else out


class FakeDDP(torch.nn.Module):
    """Just what the schedules touch on the data-parallel wrapper: ``module`` and ``no_sync``."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.sync_on = True

    def forward(self, *args):
        return self.module(*args)

    @contextlib.contextmanager
    def no_sync(self):
        self.sync_on = False
        try:
            yield
        finally:
            self.sync_on = True


def _batches(m, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(i, torch.randn(SHAPE, generator=gen, dtype=torch.float64),
             torch.randn(SHAPE, generator=gen, dtype=torch.float64)) for i in range(m)]


class Stage:
    """One rank: its chunks, log and counters."""

    def __init__(self, wire, p, r, v, m, seed=0, wide=False):
        self.log, self.sync_log = [], []
        self.alive = self.max_alive = 0
        self.comm = ThreadComm(wire, r, p, self.log)
        self.v, self.p, self.r = v, p, r
        self.chunks = [FakeDDP(ToyChunk(c * p + r, pre_process=(c == 0 and r == 0),
                                        wide=_wide(c * p + r, p * v, _source(wide))
                                        if wide is not False else None))
                       for c in range(v)]
        self.iterators = [iter(_batches(m, seed)) for _ in range(v)]
        self.current_chunk = 0
        self.shared_no_sync = False
        self.error = None
        self.losses = None

    def wrapper_sync_on(self):
        return self.chunks[0 if self.shared_no_sync else self.current_chunk].sync_on

    def set_chunk(self, c):
        self.current_chunk = c

    def forward_step(self, data_iterator, model):
        c = self.chunks.index(model)
        assert c == self.current_chunk, "set_virtual_pp_rank not called before the forward"
        mb, x, target = next(data_iterator)
        label = f"{mb}" if self.v == 1 else f"{c}.{mb}"
        self.log.append("F" + label)
        if torch.is_grad_enabled():  # (autograd turns it off inside Function.forward)
            self.alive += 1
            self.max_alive = max(self.max_alive, self.alive)
        out = _Tag.apply(model(x), self, label)

        def loss_func(output):
            loss = ((output - target) ** 2).mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func


def _wide(index, num_stages, source=None):
    """The ``wide`` of a toy chunk when the boundaries from stage ``source`` (default: the one
    before the last) to the last stage carry twice the sequence."""
    source = num_stages - 2 if source is None else source
    if index == source:
        return "out"
    if index == num_stages - 1:
        return "in"
    return "through" if source < index else None


def _source(wide):
    """``wide``: True (the stage before the last sends the wide message) or that stage."""
    return None if wide is True else wide


def run_pipeline(p, m, v=None, forward_only=False, shared_no_sync=False, seed=0,
                 group_size=None, wide=False):
    """All stages as threads; returns the Stage objects after the schedule finished
    (``group_size``: the interleaved schedule's micro-batches per chunk group; ``wide``: the
    boundary into the last stage carries ``[2s, b, h]``, passed as its own shape)."""
    wire = _Wire()
    stages = [Stage(wire, p, r, v or 1, m, seed, wide) for r in range(p)]
    schedule = get_forward_backward_func(p, v)

    def body(st):
        st.shared_no_sync = shared_no_sync
        no_sync = st.chunks[0].no_sync if shared_no_sync else [c.no_sync for c in st.chunks]
        extra = {} if group_size is None else {"microbatch_group_size_per_vp_stage": group_size}
        if wide is not False:
            extra["loss_stage_tensor_shape"] = (2 * SEQ, MB, H)
            if _source(wide) is not None:
                extra["mtp_stage"] = _source(wide)
        try:
            torch.set_grad_enabled(not forward_only)  # grad mode is per thread
            st.losses = schedule(
                forward_step_func=st.forward_step, data_iterator=st.iterators,
                model=st.chunks, num_microbatches=m, forward_only=forward_only,
                no_sync_func=no_sync, communicator=st.comm, tensor_shape=SHAPE,
                set_virtual_pp_rank=st.set_chunk, **extra)
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            st.error = err

    threads = [threading.Thread(target=body, args=(st,)) for st in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT_S)
    for st in stages:
        if st.error is not None:
            raise st.error
    assert not any(t.is_alive() for t in threads)
    return stages


def reference(p, m, v=1, seed=0, wide=False):
    """Losses and gradients of the same model run sequentially (virtual stage order)."""
    chunks = [ToyChunk(i, pre_process=(i == 0),
                       wide=_wide(i, p * v, _source(wide)) if wide is not False else None)
              for i in range(p * v)]
    losses = []
    for _, x, target in _batches(m, seed):
        h = x
        for i, chunk in enumerate(chunks):
            chunk.set_input_tensor(h)
            h = chunk(x)
        loss = ((h - target) ** 2).mean()
        losses.append(loss.item())
        (loss / m).backward()
    return losses, {i: (c.weight.grad, c.bias.grad) for i, c in enumerate(chunks)}


def _check_against_reference(stages, p, m, v=1, wide=False):
    ref_losses, ref_grads = reference(p, m, v, wide=wide)
    got = [float(d["loss"]) for d in stages[-1].losses]
    assert got == pytest.approx(ref_losses, abs=1e-12)
    for st in stages[:-1]:
        assert st.losses == []
    for st in stages:
        for c, chunk in enumerate(st.chunks):
            wg, bg = ref_grads[c * p + st.r]
            torch.testing.assert_close(chunk.module.weight.grad, wg, rtol=0, atol=1e-12)
            torch.testing.assert_close(chunk.module.bias.grad, bg, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------- hand tables

def _split(text):
    return text.split()


def test_1f1b_order_p2_m3():
    stages = run_pipeline(2, 3)
    assert stages[0].log == _split("F0 sendF F1 sendF+recvB B0 F2 sendF+recvB B1 recvB B2")
    assert stages[1].log == _split(
        "recvF F0 B0 recvF+sendB F1 B1 recvF+sendB F2 B2 sendB")


def test_1f1b_order_p4_m8_matches_docstring():
    stages = run_pipeline(4, 8)
    steady1 = " ".join(f"F{i} sendF+recvB B{i - 2} recvF+sendB" for i in range(3, 7))
    steady2 = " ".join(f"F{i} sendF+recvB B{i - 1} recvF+sendB" for i in range(2, 7))
    steady3 = " ".join(f"F{i} B{i} recvF+sendB" for i in range(1, 7))
    expected = [
        "F0 sendF F1 sendF F2 sendF F3 sendF+recvB B0 F4 sendF+recvB B1 F5 sendF+recvB B2 "
        "F6 sendF+recvB B3 F7 sendF+recvB B4 recvB B5 recvB B6 recvB B7",
        "recvF F0 sendF recvF F1 sendF recvF F2 sendF+recvB B0 recvF+sendB " + steady1
        + " F7 sendF+recvB B5 sendB recvB B6 sendB recvB B7 sendB",
        "recvF F0 sendF recvF F1 sendF+recvB B0 recvF+sendB " + steady2
        + " F7 sendF+recvB B6 sendB recvB B7 sendB",
        "recvF F0 B0 recvF+sendB " + steady3 + " F7 B7 sendB",
    ]
    for st, text in zip(stages, expected):
        assert st.log == _split(text), st.r
    _check_against_reference(stages, 4, 8)


def test_interleaved_order_p2_v2_m4():
    stages = run_pipeline(2, 4, v=2)
    assert stages[0].log == _split(
        "F0.0 sendF F0.1 sendF+recvF F1.0 sendF+recvF F1.1 sendF+recvB "
        "F0.2 B1.0 sendF+sendB+recvB F0.3 B1.1 sendF+recvF+sendB+recvB "
        "F1.2 B0.0 sendF+recvF+recvB F1.3 B0.1 sendF+recvB "
        "B1.2 sendB+recvB B1.3 sendB+recvB B0.2 recvB B0.3")
    assert stages[1].log == _split(
        "recvF F0.0 sendF+recvF F0.1 sendF+recvF F1.0 B1.0 recvF+sendB "
        "F1.1 B1.1 recvF+sendB+recvB F0.2 B0.0 sendF+recvF+sendB+recvB "
        "F0.3 B0.1 sendF+recvF+sendB F1.2 B1.2 recvF+sendB F1.3 B1.3 sendB+recvB "
        "B0.2 sendB+recvB B0.3 sendB")
    _check_against_reference(stages, 2, 4, 2)


# ------------------------------------------------------------------------- general checks

def _computations(log):
    return [x for x in log if x[0] in "FB"]


@pytest.mark.parametrize("p,m,v", [(2, 1, None), (2, 5, None), (3, 2, None), (3, 7, None),
                                   (4, 4, None), (2, 2, 2), (2, 6, 3), (3, 3, 2), (3, 6, 2),
                                   (4, 8, 2), (4, 4, 3)])
def test_schedules_match_sequential_model_and_pipeline_order(p, m, v):
    stages = run_pipeline(p, m, v)
    _check_against_reference(stages, p, m, v or 1)
    for st in stages:
        want = [f"{kind}{mb}" if v is None else f"{kind}{c}.{mb}"
                for kind, c, mb in pipeline_order(p, st.r, m, v)]
        assert _computations(st.log) == want


@pytest.mark.parametrize("p,m,v", [(3, 5, None), (2, 4, 2)])
def test_forward_only_returns_losses_and_keeps_nothing(p, m, v):
    stages = run_pipeline(p, m, v, forward_only=True)
    ref_losses, _ = reference(p, m, v or 1)
    assert [float(d["loss"]) for d in stages[-1].losses] == pytest.approx(ref_losses, abs=1e-12)
    for st in stages:
        assert not any(x.startswith("B") or "sendB" in x or "recvB" in x for x in st.log)
        assert all(c.module.weight.grad is None for c in st.chunks)
        assert st.max_alive == 0


@pytest.mark.parametrize("p,m", [(2, 6), (4, 8), (4, 2), (3, 9)])
def test_1f1b_bounds_live_activations_and_frees_sent_outputs(p, m):
    stages = run_pipeline(p, m)
    for st in stages:
        # Stage r holds at most min(p - r, m) micro-batches: the first stage at most p.
        assert st.max_alive == min(p - st.r, m), (st.r, st.max_alive)
        assert st.alive == 0
        for out in st.comm.sent_outputs:
            assert out.numel() == 1 and out.grad_fn is not None  # data freed, graph kept
    assert stages[0].max_alive <= p


def test_interleaved_live_activations_match_warmup_count():
    p, v, m = 2, 2, 8
    stages = run_pipeline(p, m, v)
    for st in stages:
        warmup = schedules.interleaved_num_warmup(p, st.r, m, v)
        assert st.max_alive == warmup + 1


@pytest.mark.parametrize("v", [None, 2])
def test_gradient_reduction_waits_for_each_chunks_last_microbatch(v):
    p, m = 2, 4
    for st in run_pipeline(p, m, v):
        assert len(st.sync_log) == m * (v or 1)
        for label, sync_on in st.sync_log:
            assert sync_on == label.endswith(str(m - 1)), (st.r, label, sync_on)
    # One context (chunk 0's) for all chunks: only the very last backward of the step reduces.
    for st in run_pipeline(p, m, 2, shared_no_sync=True):
        assert [on for _, on in st.sync_log] == [False] * (2 * m - 1) + [True]


def test_interleaved_rejects_microbatches_not_multiple_of_pp():
    with pytest.raises(ValueError, match=r"= 3\) to be a multiple of "
                                         r"--pipeline-model-parallel-size \(2\)"):
        run_pipeline(2, 3, v=2)


def test_get_forward_backward_func_and_no_pipelining_keywords():
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    assert get_forward_backward_func(2) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 2) is forward_backward_pipelining_with_interleaving
    # The no-pipelining schedule takes the pipeline keywords and ignores them.
    model = ToyChunk(0, pre_process=True)
    data = iter(_batches(3))

    def step(it, mdl):
        _, x, target = next(it)
        out = mdl(x)
        return out, lambda o: (((o - target) ** 2).mean(), {"loss": 0})
    logged = forward_backward_no_pipelining(
        forward_step_func=step, data_iterator=[data], model=[model], num_microbatches=3,
        communicator=None, tensor_shape=SHAPE, set_virtual_pp_rank=None)
    assert len(logged) == 3
    _, ref = reference(1, 3)
    torch.testing.assert_close(model.weight.grad, ref[0][0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("per_token", [False, True])
def test_loss_given_as_a_sum_and_a_token_count(per_token):
    """A three-value loss function (sum, count, logged): without calculate_per_token_loss the
    schedule makes it the micro-batch mean over its count, then divides by the micro-batches;
    with it the sum is kept and the counts are summed into ``num_tokens``. Reference: autograd
    of the same objective written out in float64."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    batches = [(torch.randn(n, 4, dtype=torch.float64), torch.randn(n, 1, dtype=torch.float64))
               for n in (3, 5, 2)]
    data = iter(batches)

    def step(it, mdl):
        x, target = next(it)
        out = mdl(x)
        return out, lambda o: (((o - target) ** 2).sum(), torch.tensor(len(x)), {"n": len(x)})
    logged = forward_backward_no_pipelining(
        forward_step_func=step, data_iterator=data, model=model, num_microbatches=3,
        calculate_per_token_loss=per_token)
    assert [d["n"] for d in logged] == [3, 5, 2] and int(logged.num_tokens) == 10
    reference = torch.nn.Linear(4, 1).double()
    reference.load_state_dict(model.state_dict())
    sums = [((reference(x) - t) ** 2).sum() for x, t in batches]
    objective = sum(sums) if per_token else sum(s / len(x) for s, (x, _) in zip(sums, batches)) / 3
    objective.backward()
    torch.testing.assert_close(model.weight.grad, reference.weight.grad, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------- real gloo ranks

def _real_pipeline_body(m):
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(p)))
    results = {}
    for name, v in (("1f1b", None), ("interleaved", 2)):
        chunks = [FakeDDP(ToyChunk(c * p + rank, pre_process=(c == 0 and rank == 0)))
                  for c in range(v or 1)]
        comm = p2p.P2PCommunicator(pp_group=group, pp_ranks=list(range(p)), pp_rank=rank,
                                   dtype=torch.float64, device="cpu")

        def step(it, model):
            _, x, target = next(it)
            return model(x), lambda o: (((o - target) ** 2).mean(), {"loss": 0})
        losses = get_forward_backward_func(p, v)(
            forward_step_func=step, data_iterator=[iter(_batches(m)) for _ in chunks],
            model=chunks, num_microbatches=m, no_sync_func=[c.no_sync for c in chunks],
            communicator=comm, tensor_shape=SHAPE)
        results[name] = (len(losses), [(c.module.weight.grad, c.module.bias.grad)
                                       for c in chunks])
    return results


def test_schedules_over_gloo_match_sequential_model():
    p, m = 2, 4
    out = run_on_ranks(_real_pipeline_body, p, m)
    for name, v in (("1f1b", 1), ("interleaved", 2)):
        _, ref = reference(p, m, v)
        for r in range(p):
            count, grads = out[r][name]
            assert count == (m if r == p - 1 else 0)
            for c, (wg, bg) in enumerate(grads):
                torch.testing.assert_close(wg, ref[c * p + r][0], rtol=0, atol=1e-12)
                torch.testing.assert_close(bg, ref[c * p + r][1], rtol=0, atol=1e-12)


# ------------------------------------------------------------------------- micro-batch groups

def _naive_table(m, v, g):
    """Each (micro-batch, chunk) sorted by (group, chunk, micro-batch)."""
    return sorted(((i, c) for i in range(m) for c in range(v)),
                  key=lambda t: (t[0] // g, t[1], t[0]))


def test_schedule_table_matches_megatrons_documented_example_and_a_naive_table():
    # Megatron-Core's example, PP 2, N 3, M 5, VP 2: micro-batches 0 1 2 0 1 2 3 4 3 4 on
    # chunks 0 0 0 1 1 1 0 0 1 1.
    table = schedules.get_schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    for m, v, g in [(4, 2, 2), (8, 2, 4), (7, 3, 3), (9, 2, 4), (6, 3, 6), (10, 4, 3)]:
        assert schedules.get_schedule_table(m, v, g) == _naive_table(m, v, g), (m, v, g)


def test_grouped_order_p2_v2_m5_g3_by_hand():
    stages = run_pipeline(2, 5, v=2, group_size=3)
    assert _computations(stages[0].log) == _split(
        "F0.0 F0.1 F0.2 F1.0 F1.1 F1.2 B1.0 F0.3 B1.1 F0.4 B1.2 F1.3 B0.0 F1.4 B0.1 "
        "B0.2 B1.3 B1.4 B0.3 B0.4")
    assert _computations(stages[1].log) == _split(
        "F0.0 F0.1 F0.2 F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F0.3 B0.0 F0.4 B0.1 F1.3 B0.2 "
        "F1.4 B1.3 B1.4 B0.3 B0.4")
    _check_against_reference(stages, 2, 5, 2)


@pytest.mark.parametrize("p,m,v,g", [(2, 4, 2, 4), (2, 6, 3, 4), (3, 7, 2, 4), (3, 4, 2, 4),
                                     (2, 9, 2, 3), (4, 8, 2, 8), (3, 9, 3, 3)])
def test_grouped_schedules_match_one_process_and_pipeline_order(p, m, v, g):
    stages = run_pipeline(p, m, v, group_size=g)
    _check_against_reference(stages, p, m, v)
    for st in stages:
        want = [f"{kind}{c}.{mb}" for kind, c, mb in pipeline_order(p, st.r, m, v, group_size=g)]
        assert _computations(st.log) == want
        warmup = schedules.interleaved_num_warmup(p, st.r, m, v, group_size=g)
        assert st.max_alive == min(warmup + 1, m * v), (st.r, st.max_alive)


def test_grouping_gives_the_default_groupings_gradients_and_forward_only_losses():
    default = run_pipeline(2, 8, 2)
    grouped = run_pipeline(2, 8, 2, group_size=4)
    for a, b in zip(default, grouped):
        for ca, cb in zip(a.chunks, b.chunks):
            torch.testing.assert_close(ca.module.weight.grad, cb.module.weight.grad,
                                       rtol=0, atol=1e-12)
    assert [float(d["loss"]) for d in grouped[-1].losses] == \
        [float(d["loss"]) for d in default[-1].losses]
    evaluated = run_pipeline(2, 5, 2, forward_only=True, group_size=3)
    assert [float(d["loss"]) for d in evaluated[-1].losses] == \
        pytest.approx(reference(2, 5, 2)[0], abs=1e-12)


@pytest.mark.parametrize("m,g,match", [
    (4, 1, r"\(1\) must lie between --pipeline-model-parallel-size \(2\) and the number of "
           r"micro-batches \(4\)"),
    (4, 5, r"\(5\) must lie between"),
    (7, 3, r"leaves 1 after whole groups .* \(3\); that remainder must be 0 or at least"),
])
def test_group_size_outside_megatrons_limits_is_refused(m, g, match):
    with pytest.raises(ValueError, match=match):
        run_pipeline(2, m, v=2, group_size=g)


def _real_grouped_body(m, v, g):
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(p)))
    chunks = [FakeDDP(ToyChunk(c * p + rank, pre_process=(c == 0 and rank == 0)))
              for c in range(v)]
    comm = p2p.P2PCommunicator(pp_group=group, pp_ranks=list(range(p)), pp_rank=rank,
                               dtype=torch.float64, device="cpu")

    def step(it, model):
        _, x, target = next(it)
        return model(x), lambda o: (((o - target) ** 2).mean(), {"loss": o.detach()})
    losses = forward_backward_pipelining_with_interleaving(
        forward_step_func=step, data_iterator=[iter(_batches(m)) for _ in chunks],
        model=chunks, num_microbatches=m, no_sync_func=[c.no_sync for c in chunks],
        communicator=comm, tensor_shape=SHAPE, microbatch_group_size_per_vp_stage=g)
    return len(losses), [(c.module.weight.grad, c.module.bias.grad) for c in chunks]


@pytest.mark.slow
@pytest.mark.parametrize("p,m,v,g", [(2, 5, 2, 3), (3, 7, 2, 4)])
def test_grouped_interleaving_over_gloo_matches_one_process(p, m, v, g):
    out = run_on_ranks(_real_grouped_body, p, m, v, g)
    _, ref = reference(p, m, v)
    for r in range(p):
        count, grads = out[r]
        assert count == (m if r == p - 1 else 0)
        for c, (wg, bg) in enumerate(grads):
            torch.testing.assert_close(wg, ref[c * p + r][0], rtol=0, atol=1e-12)
            torch.testing.assert_close(bg, ref[c * p + r][1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("p, m", [(2, 4), (3, 5), (4, 2)])
def test_1f1b_with_a_wider_message_into_the_last_stage_matches_one_process(p, m):
    """A standalone MTP stage sends the loss stage ``[(1+K)s, b, h]``: with its own
    ``loss_stage_tensor_shape`` every boundary receives its own shape, and the losses and
    gradients are those of the model run in one thread."""
    _check_against_reference(run_pipeline(p, m, wide=True), p, m, wide=True)


@pytest.mark.parametrize("p, m, v, group_size", [(2, 4, 2, None), (3, 6, 2, None),
                                                 (2, 6, 3, None), (4, 4, 2, None),
                                                 (2, 6, 2, 3), (3, 3, 2, None)])
def test_interleaved_with_a_wider_message_into_the_last_stage_matches_one_process(
        p, m, v, group_size):
    """With virtual stages the wide boundary is between the last chunks of ranks p - 2 and
    p - 1 (rank 0's last chunk at p 2, which also runs the first stage); one exchange may carry
    a wide and a narrow message at once, each received with its own shape."""
    stages = run_pipeline(p, m, v=v, wide=True, group_size=group_size)
    _check_against_reference(stages, p, m, v, wide=True)


def test_interleaved_forward_only_with_a_wider_message_into_the_last_stage():
    stages = run_pipeline(2, 4, v=2, wide=True, forward_only=True)
    ref_losses, _ = reference(2, 4, 2, wide=True)
    assert [float(d["loss"]) for d in stages[-1].losses] == pytest.approx(ref_losses, abs=1e-12)


@pytest.mark.parametrize("p, m, v, source", [(3, 4, 1, 0), (4, 5, 1, 1), (4, 3, 1, 0),
                                             (3, 6, 2, 3), (4, 4, 2, 4), (3, 6, 3, 6)])
def test_a_wide_message_passes_through_the_stages_before_the_last(p, m, v, source):
    """A standalone MTP stage further from the loss (the last virtual stage of its rank, e.g.
    ``Et|t|t|tmm||L`` at pp 3): the stages between it and the loss stage receive and send the
    wide message, and the schedules match one thread."""
    stages = run_pipeline(p, m, v=None if v == 1 else v, wide=source)
    _check_against_reference(stages, p, m, v, wide=source)
