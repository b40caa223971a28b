"""`--log-probs-kernel triton` (slime/algorithm/log_probs_triton.py) against plain fp64 autograd and against the
torch form, run by Triton's interpreter on CPU (`TRITON_INTERPRET=1`, set before the kernels are defined, so in a
process of its own): values and gradients with Megatron's vocabulary padding, a temperature, a subset of rows or
all of them, fp32 and bf16 logits, one output left out of the loss, the entropy as a metric only, and the
vocabulary split over two ranks of a real gloo group. The kernels' speed is a GPU matter
(`benchmarks/megatron_train.py --layouts thd,thd:triton`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.interpreted import run_interpreted
from tests.unit.test_log_probs import REAL, V, grads, inputs, reference

pytest.importorskip("triton")


def _close(got, want, tol, name):
    err = (got - want).abs().max().item()
    assert err < tol * max(1.0, want.abs().max().item()), f"{name}: {err:.3g}"


def _single_rank(max_block: int) -> None:
    from slime.algorithm import log_probs_triton
    from slime.algorithm.log_probs import log_probs_and_entropy
    from slime.algorithm.log_probs_triton import log_probs_and_entropy_triton

    assert log_probs_triton.INTERPRETED
    log_probs_triton.MAX_BLOCK = max_block  # 16: a row of 40 columns in 3 blocks (the online max rescales the sums)
    # the gradient comes back in the logits' dtype: bf16 holds it to one unit in the last place, 2^-7 of the value
    # (the interpreter's cast to bf16 truncates where a GPU's rounds to nearest, 2^-8)
    for dtype, tol, grad_tol in ((torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-5, 2**-7)):
        logits, rows, targets, weights = inputs(dtype)
        ours = grads(lambda x: log_probs_and_entropy_triton(x, targets, temperature=0.7, with_entropy=True, rows=rows,
                                                            vocab_size=REAL), logits, weights)
        want = grads(lambda x: reference(x, rows, targets, 0.7), logits.double(), weights)
        for a, b, name, t in zip(ours, want, ("log-probs", "entropy", "gradient"), (tol, tol, grad_tol)):
            _close(a, b, t, f"{dtype} rows {name}")
        assert ours[2][:, REAL:].abs().max() == 0 and ours[2][[0, 4, 6, 7, 11]].abs().max() == 0  # unread: no grad
        torch_form = grads(lambda x: log_probs_and_entropy(x, targets, temperature=0.7, with_entropy=True, rows=rows,
                                                           vocab_size=REAL), logits, weights)
        for a, b, name in zip(ours, torch_form, ("log-probs", "entropy", "gradient")):
            _close(a, b, grad_tol, f"{dtype} vs the torch form: {name}")

    # every row (the fsdp trainer's call: [..., V] with targets of the leading shape), no padding
    logits, _, _, weights = inputs(torch.float32)
    g = torch.Generator().manual_seed(1)
    every = torch.randint(0, V, (3, 4), generator=g)
    block = logits.view(3, 4, V)
    x = block.clone().requires_grad_()
    lp, ent = log_probs_and_entropy_triton(x, every, with_entropy=True)
    assert lp.shape == ent.shape == (3, 4)
    (lp.sum() + 0.5 * ent.sum()).backward()
    y = block.clone().double().requires_grad_()
    log_p = torch.log_softmax(y, -1)
    (log_p.gather(-1, every.unsqueeze(-1)).sum() - 0.5 * (log_p.exp() * log_p).sum()).backward()
    _close(lp.double(), log_p.gather(-1, every.unsqueeze(-1)).squeeze(-1).detach(), 1e-5, "every row: log-probs")
    _close(x.grad.double(), y.grad, 1e-5, "every row: gradient")

    # the entropy out of the loss gets no gradient term; as a metric only it is not differentiable
    logits, rows, targets, _ = inputs(torch.float32)
    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy_triton(x, targets, rows=rows, vocab_size=REAL, with_entropy=True)
    lp.sum().backward()
    y = logits.clone().double().requires_grad_()
    reference(y, rows, targets, 1.0)[0].sum().backward()
    _close(x.grad.double(), y.grad, 1e-5, "log-probs alone: gradient")
    _, metric = log_probs_and_entropy_triton(logits.clone().requires_grad_(), targets, rows=rows, vocab_size=REAL,
                                             with_entropy=True, entropy_grad=False)
    assert not metric.requires_grad

    # as the trainers call it: Megatron's rows of a packed micro-batch, fsdp's gathered response positions
    from slime.backends.fsdp_utils.data import extract_response_log_probs
    from slime.backends.megatron_utils.forward import response_log_probs
    from slime.backends.training.batching import make_micro_batch, make_packed_micro_batch

    tokens, response_lengths = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]], [2, 1, 3]
    packed = make_packed_micro_batch(tokens, response_lengths)
    block = torch.randn(1, packed.input_ids.shape[1], V, generator=g)
    for kernel_out, torch_out in zip(response_log_probs(block, packed, 0.8, REAL, True, kernel="triton"),
                                     response_log_probs(block, packed, 0.8, REAL, True)):
        _close(kernel_out, torch_out, 1e-5, "megatron response_log_probs")
    padded = make_micro_batch(tokens, response_lengths)
    block = torch.randn(*padded.input_ids.shape, V, generator=g)
    for kernel_out, torch_out in zip(extract_response_log_probs(block, padded, 0.8, 0, True, kernel="triton"),
                                     extract_response_log_probs(block, padded, 0.8, 0, True)):
        _close(kernel_out, torch_out, 1e-5, "fsdp extract_response_log_probs")

    with pytest.raises(ValueError, match="duplicates"):
        log_probs_and_entropy_triton(logits, targets[:2], rows=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"--log-probs-kernel triton: the logits are torch.float64"):
        log_probs_and_entropy_triton(logits.double(), targets, rows=rows)


def _rank(rank: int, init: str, out: str) -> None:
    from slime.algorithm import log_probs_triton

    log_probs_triton.MAX_BLOCK = 16
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    logits, rows, targets, weights = inputs(torch.float32)
    local = V // 2
    part = logits[:, rank * local:(rank + 1) * local]
    lp, ent, grad = grads(lambda x: split_vocabulary_call(x, targets, rows), part, weights)
    torch.save({"lp": lp, "ent": ent, "grad": grad}, f"{out}.{rank}")
    dist.destroy_process_group()


def split_vocabulary_call(x, targets, rows):
    from slime.algorithm.log_probs_triton import log_probs_and_entropy_triton

    return log_probs_and_entropy_triton(x, targets, temperature=0.7, with_entropy=True, rows=rows, vocab_size=REAL,
                                        group=dist.group.WORLD)


def _two_ranks(tmp: str) -> None:
    mp.start_processes(_rank, args=(f"file://{tmp}/init", f"{tmp}/out"), nprocs=2, join=True, start_method="spawn")
    logits, rows, targets, weights = inputs(torch.float32)
    want = grads(lambda x: reference(x, rows, targets, 0.7), logits.double(), weights)
    got = [torch.load(f"{tmp}/out.{r}") for r in range(2)]
    for r in got:  # both ranks return the whole distribution's log-probs and entropy
        _close(r["lp"], want[0], 1e-5, "split: log-probs")
        _close(r["ent"], want[1], 1e-5, "split: entropy")
    _close(torch.cat([got[0]["grad"], got[1]["grad"]], dim=1), want[2], 1e-5, "split: gradient")


@pytest.mark.parametrize("max_block", [16, 4096])
def test_triton_kernels_equal_plain_autograd(max_block):
    run_interpreted(f"from tests.unit.test_log_probs_triton import _single_rank; _single_rank({max_block})")


def test_triton_kernels_with_the_vocabulary_split_over_two_ranks(tmp_path):
    run_interpreted(f"from tests.unit.test_log_probs_triton import _two_ranks; _two_ranks({str(tmp_path)!r})")


def test_triton_kernel_refused_off_cuda_without_the_interpreter():
    from slime.algorithm import log_probs_triton
    from slime.algorithm.log_probs import log_probs_and_entropy

    if log_probs_triton.INTERPRETED:
        pytest.skip("this process runs Triton's interpreter")
    logits, rows, targets, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match="--log-probs-kernel triton: the logits are on cpu, not a CUDA device; use "
                                         "--log-probs-kernel torch"):
        log_probs_triton.vocab_kernel("triton")(logits, targets, rows=rows)
    assert log_probs_triton.vocab_kernel("torch") is log_probs_and_entropy
    with pytest.raises(ValueError, match="--log-probs-kernel 'cuda'"):
        log_probs_triton.vocab_kernel("cuda")


def test_the_flag_is_refused_where_the_kernels_cannot_run_and_auto_picks_where_they_can(monkeypatch):
    import importlib.util

    from slime.config.arguments import SlimeArgumentError
    from tests.args import make_args

    assert make_args(use_cuda=False).log_probs_kernel == "torch"  # auto: the CPU keeps the torch form
    assert make_args(use_cuda=True).log_probs_kernel == "triton"  # auto: CUDA with triton installed
    assert make_args("--log-probs-kernel", "torch", use_cuda=True).log_probs_kernel == "torch"
    with pytest.raises(SlimeArgumentError, match="--log-probs-kernel triton runs on CUDA only"):
        make_args("--log-probs-kernel", "triton", use_cuda=False)
    assert make_args("--log-probs-kernel", "triton", use_cuda=True).log_probs_kernel == "triton"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(SlimeArgumentError, match="--log-probs-kernel triton: triton is not installed"):
        make_args("--log-probs-kernel", "triton", use_cuda=True)
    assert make_args(use_cuda=True).log_probs_kernel == "torch"  # auto without triton
