"""Checked GEMMs (issue 15): every Linear's three products checked, faults caught and placed.

What must hold: a checked model computes exactly what the unchecked one does; clean GEMMs never
exceed the bound; a wrong element in any of the three products is flagged with its layer and
pass; gradient accumulation, autocast, attention projections, GPT-2's Conv1D and FSDP2 work.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from abft_workers import Conv1D, fsdp_run
from torch import nn

import slurm_guard as sg
from slurm_guard.abft import (
    PASSES,
    attach,
    measure_coverage,
    residual_bound,
    roundoff,
)
from slurm_guard.abft.checksums import signs
from slurm_guard.abft.site import HALF_BLOCK
from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, make_batch
from slurm_guard.faults.injection import FaultInjector, parse_faults
from slurm_guard.local.launch import run_local


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _twins(make: type[nn.Module] | object) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = make()  # type: ignore[operator]
    b = make()  # type: ignore[operator]
    b.load_state_dict(a.state_dict())
    return a, b


def test_checked_tiny_gpt_computes_bit_for_bit_what_the_unchecked_one_does() -> None:
    plain, checked = _twins(TinyGPT)
    handle = attach(checked)
    batch = make_batch(0, 0)
    torch.manual_seed(1)
    loss_plain = lm_loss(plain, batch)
    loss_plain.backward()  # type: ignore[no-untyped-call]
    torch.manual_seed(1)
    loss_checked = lm_loss(checked, batch)
    loss_checked.backward()  # type: ignore[no-untyped-call]
    assert torch.equal(loss_plain, loss_checked)
    assert all(torch.equal(a, b) for a, b in zip(_grads(plain), _grads(checked), strict=True))
    # every projection of the attention, both MLP layers and the head: 9 sites, 3 passes each
    assert handle.names == [
        "blocks.0.attn.in_proj",
        "blocks.0.attn.out_proj",
        "blocks.0.mlp.0",
        "blocks.0.mlp.2",
        "blocks.1.attn.in_proj",
        "blocks.1.attn.out_proj",
        "blocks.1.mlp.0",
        "blocks.1.mlp.2",
        "head",
    ]
    worst = handle.collect()
    assert worst is not None and bool((worst >= 0).all()) and float(worst.max()) < 0.1
    assert handle.findings(worst) == []
    handle.detach()
    assert "forward" not in vars(checked.head)


@pytest.mark.parametrize(
    ("n", "k", "m", "bias"),
    [(64, 32, 48, True), (70, 33, 47, False), (5, 7, 3, True), (300, 128, 96, True)],
)
def test_clean_gemms_stay_far_below_the_bound(n: int, k: int, m: int, bias: bool) -> None:
    torch.manual_seed(n)
    layer = nn.Linear(k, m, bias=bias)
    handle = attach(layer)
    worst = 0.0
    for trial in range(20):
        scale = 10.0 ** (trial % 7 - 3)  # magnitudes from 1e-3 to 1e3
        x = (torch.randn(n, k) * scale).requires_grad_()
        layer(x).sin().sum().backward()  # type: ignore[no-untyped-call]
        result = handle.collect()
        assert result is not None
        worst = max(worst, float(result.max()))
    assert worst < 0.2, worst  # a false alarm needs > 1


@pytest.mark.parametrize("which", PASSES)
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_a_wrong_element_is_flagged_with_its_layer_and_pass(which: str, kind: str) -> None:
    torch.manual_seed(3)
    if kind == "linear":
        model = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 16))
    else:
        model = nn.Sequential(Conv1D(40, 24), nn.Tanh(), Conv1D(16, 40))
    handle = attach(model)
    hits = []

    def corrupt(out: torch.Tensor) -> None:
        hits.append(out.shape)
        out.view(-1)[7] *= 1.5  # 50% wrong: far above any rounding bound

    handle.inject(1, which, corrupt)
    x = torch.randn(3, 40, 24, requires_grad=True)  # 3-D input: 120 rows, blocks of 64 and 56
    model(x).square().mean().backward()  # type: ignore[no-untyped-call]
    findings = handle.findings(handle.collect())
    assert hits, "the fault never ran"
    assert [(f.layer, f.gemm_pass) for f in findings] == [("2", which)]
    assert findings[0].ratio > 10


def test_bit_flips_and_nan_in_a_gemm_output_are_flagged() -> None:
    torch.manual_seed(4)
    layer = nn.Linear(64, 64)
    handle = attach(layer)
    x = torch.randn(128, 64, requires_grad=True)
    for bit, value in ((30, None), (27, None), (22, None), (0, float("nan"))):

        def corrupt(out: torch.Tensor, bit: int = bit, value: float | None = value) -> None:
            flat = out.view(-1)
            if value is not None:
                flat[11] = value
            else:
                flat[11:12].view(torch.int32).bitwise_xor_(1 << bit)

        handle.sites[0].injectors = {0: [corrupt]}
        layer(x).sum().backward()  # type: ignore[no-untyped-call]
        findings = handle.findings(handle.collect())
        assert [f.gemm_pass for f in findings] == ["fwd"], (bit, findings)


def test_gradient_accumulation_a_fault_in_the_second_microbatch_is_flagged() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    handle = attach(model)
    calls = []

    def corrupt(out: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 2:
            out.view(-1)[0] += 1.0 + out.view(-1)[0].abs()

    handle.inject(0, "grad_w", corrupt)
    for micro in torch.randn(2, 40, 16):
        model(micro).square().mean().backward()  # type: ignore[no-untyped-call]
    findings = handle.findings(handle.collect())
    assert [(f.layer, f.gemm_pass) for f in findings] == [("0", "grad_w")]
    # the next step starts clean
    model(torch.randn(40, 16)).square().mean().backward()  # type: ignore[no-untyped-call]
    assert handle.findings(handle.collect()) == []


def test_autocast_bfloat16_matches_unchecked_and_still_catches_large_errors() -> None:
    plain, checked = _twins(lambda: nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)))
    handle = attach(checked)
    x = torch.randn(96, 64)
    outs = []
    for model in (plain, checked):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().square().mean().backward()  # type: ignore[no-untyped-call]
        outs.append(y)
    assert outs[1].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(_grads(plain), _grads(checked), strict=True))
    assert all(g.dtype == torch.float32 for g in _grads(checked))  # grads reach fp32 params
    assert handle.findings(handle.collect()) == []

    handle.inject(0, "fwd", lambda out: out.view(-1)[5].mul_(4.0).add_(4.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = checked(x)
    y.float().sum().backward()  # type: ignore[no-untyped-call]
    assert [(f.layer, f.gemm_pass) for f in handle.findings(handle.collect())] == [("0", "fwd")]


def test_the_bound_scales_with_the_unit_roundoff_not_a_magic_constant() -> None:
    """Every rounding scaled by 2^-29 scales the bound by 2^-29 (it is linear in the unit
    roundoffs, not a constant); float64 is that much tighter than float32, less the float64
    checksum sums both share; bfloat16 outputs give a looser one."""
    rows = torch.tensor([32.0], dtype=torch.float64)
    ones = torch.ones(1, dtype=torch.float64)
    args = (256, rows, ones * 32 * 256, ones * 32, torch.ones(8, dtype=torch.float64) * 256)
    cpu = torch.device("cpu")
    r32 = roundoff(torch.float32, cpu)
    scaled = dataclasses.replace(
        r32,
        **{
            f.name: getattr(r32, f.name) * 2.0**-29
            for f in dataclasses.fields(r32)
            if f.name != "tiny"
        },
    )
    b32 = residual_bound(*args, None, r32, 10.0).sqrt()
    assert float(b32[0, 0] / residual_bound(*args, None, scaled, 10.0).sqrt()[0, 0]) == (
        pytest.approx(2.0**29, rel=1e-3)
    )
    b64 = residual_bound(*args, None, roundoff(torch.float64, cpu), 10.0).sqrt()
    assert 2.0**27 < float(b32[0, 0] / b64[0, 0]) < 2.0**29
    b16 = residual_bound(*args, None, roundoff(torch.bfloat16, cpu), 10.0).sqrt()
    assert float(b16[0, 0] / b32[0, 0]) > 2.0**10  # the bfloat16 output rounding
    # and linear in the margin
    b32_20 = residual_bound(*args, None, r32, 20.0).sqrt()
    assert float(b32_20[0, 0] / b32[0, 0]) == pytest.approx(2.0, rel=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cast", [None, torch.bfloat16], ids=["float32", "bf16-autocast"])
def test_checked_gemms_on_cuda_stay_on_the_device_and_flag_a_wrong_element(
    cast: torch.dtype | None,
) -> None:
    """The CUDA path (torch ops, float64 sums on the device): clean GEMMs pass, the step's
    result stays on the GPU until it is read once, and a wrong grad_W element is named."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 128)).cuda()
    handle = attach(model)
    x = torch.randn(4, 96, 256, device="cuda", requires_grad=True)

    def step() -> list[tuple[str, str]]:
        with torch.autocast("cuda", dtype=cast or torch.bfloat16, enabled=cast is not None):
            y = model(x)
        y.float().square().mean().backward()  # type: ignore[no-untyped-call]
        worst = handle.collect()
        assert worst is not None and worst.is_cuda
        return [(f.layer, f.gemm_pass) for f in handle.findings(worst)]

    assert step() == []
    handle.inject(1, "grad_w", lambda out: out.view(-1)[3].mul_(-3.0).add_(1.0))
    assert step() == [("2", "grad_w")]


def test_checksum_signs_cancel_a_common_offset_in_every_run_of_rows() -> None:
    """Any run of consecutive rows holds about as many +1 as -1 (a Weyl sequence): a block of
    rows sharing an offset sums it at most 4 times, where unsigned sums would add it 64 times."""
    s = signs(200_000, torch.float64, torch.device("cpu"))
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), s.cumsum(0)])
    for run in (4, 32, 64, 4096):
        assert float((prefix[run:] - prefix[:-run]).abs().max()) <= 4
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(signs(1000, torch.float32, torch.device("cpu")), s[:1000].float())


def test_half_precision_products_use_blocks_of_at_most_32_rows() -> None:
    """Their bound is the output rounding, which grows as sqrt(block): the float32 default of 64
    would loosen it by sqrt(2) where the checksum GEMM saves little."""
    site = attach(nn.Linear(4, 4), block=64).sites[0]
    assert site.block_for(torch.float32) == site.block_for(torch.float64) == 64
    assert site.block_for(torch.bfloat16) == site.block_for(torch.float16) == HALF_BLOCK == 32
    assert attach(nn.Linear(4, 4), block=16).sites[0].block_for(torch.bfloat16) == 16


def test_coverage_of_tiny_gpt_counts_every_projection_and_names_attention() -> None:
    model = TinyGPT(TinyGPTConfig())
    attach(model)
    coverage = measure_coverage(model, lambda: lm_loss(model, make_batch(0, 0)))
    # everything but the attention score/value products is checked
    assert coverage.fraction_without_attention == 1.0
    assert set(coverage.unchecked_by_op) == {"bmm"}
    assert 0.9 < coverage.fraction < 1.0
    assert "attention" in coverage.describe()
    with pytest.raises(ValueError, match="attach"):
        measure_coverage(nn.Linear(2, 2), lambda: torch.zeros(1, requires_grad=True).sum())


def test_gemm_fault_kind_parses_and_hits_one_gemm_once_per_step() -> None:
    (fault,) = parse_faults("kind=gemm,rank=0,step=2,layer=1,pass=grad_x,element=4,flip=1,bit=30")
    assert (fault.layer, fault.gemm_pass, fault.flip, fault.bit) == (1, "grad_x", True, 30)
    assert "layer 1 grad_x" in fault.describe()
    with pytest.raises(sg.GuardError, match="fwd, grad_x or grad_w"):
        sg.Fault("gemm", step=0, rank=0, gemm_pass="bwd")
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    handle = attach(model)
    injector = FaultInjector(
        (sg.Fault("gemm", step=2, rank=0, layer=1, gemm_pass="grad_x", factor=0.5),),
        0,
        "n0",
        model,
    )
    seen = []
    x = torch.randn(2, 32, 8)
    for step in range(4):
        injector.step = step
        for micro in x:  # two microbatches per step: a one-off fault hits the first only
            model(micro).sum().backward()  # type: ignore[no-untyped-call]
        seen.append([(f.layer, f.gemm_pass) for f in handle.findings(handle.collect())])
    assert seen == [[], [], [("2", "grad_x")], []]


def test_attention_with_separate_projection_weights_is_checked() -> None:
    torch.manual_seed(7)
    attention = nn.MultiheadAttention(16, 2, kdim=8, vdim=8, batch_first=True)
    handle = attach(attention)
    assert handle.names == [".q_proj", ".k_proj", ".v_proj", ".out_proj"]
    q, kv = torch.randn(2, 5, 16), torch.randn(2, 7, 8)
    attention(q, kv, kv, need_weights=False)[0].sum().backward()
    worst = handle.collect()
    assert worst is not None and bool((worst[:, 0] >= 0).all())  # every forward ran checked
    assert handle.findings(worst) == []


def test_hugging_face_gpt2_conv1d_checked_and_unchanged() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=96, attn_implementation="eager"
    )
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    checked = transformers.GPT2LMHeadModel(config)
    checked.load_state_dict(plain.state_dict())
    plain.eval(), checked.eval()  # no dropout: the two runs must match exactly
    handle = attach(checked)
    assert sum(n.endswith(("c_attn", "c_proj", "c_fc")) for n in handle.names) == 8
    assert handle.names[-1] == "lm_head"
    ids = torch.randint(0, 96, (4, 32))
    losses = []
    for model in (plain, checked):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss)
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(a, b) for a, b in zip(_grads(plain), _grads(checked), strict=True))
    assert handle.findings(handle.collect()) == []
    coverage = measure_coverage(checked, lambda: checked(input_ids=ids, labels=ids).loss)
    assert coverage.fraction_without_attention == 1.0
    assert coverage.fraction > 0.9


@pytest.mark.distributed
def test_fsdp2_hsdp_mesh_checks_locally_and_names_the_faulty_rank() -> None:
    # 2 replica groups x 2 shards; rank 3's layer-2 weight gradient is wrong at step 2
    outcomes = run_local(fsdp_run, 4, args=(2, 2, 3, 2), nodes=[f"n{i}" for i in range(4)])
    assert [o.status for o in outcomes] == ["ok"] * 4, [o.value for o in outcomes]
    for rank, o in enumerate(outcomes):
        failures = o.value["failures"]
        expected = [[], [], [("4", "grad_w")], []] if rank == 3 else [[]] * 4
        assert failures == expected, (rank, failures)
        clean = [w for step, w in enumerate(o.value["worst"]) if failures[step] == []]
        assert all(0 <= w < 0.2 for w in clean)


def test_collecting_a_step_makes_no_tensor_from_python_values_after_the_first() -> None:
    """The torch path (what CUDA runs) leaves its results on the device; reducing them must
    not upload the layout every step: on CUDA a blocking upload waits for the whole backward."""
    from torch.overrides import TorchFunctionMode

    class Uploads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_function__(  # type: ignore[override]
            self, func: object, types: object, args: tuple[object, ...] = (), kwargs: object = None
        ) -> object:
            if func in (torch.tensor, torch.as_tensor):
                self.calls.append(getattr(func, "__name__", "?"))
            return func(*args, **(kwargs or {}))  # type: ignore[operator,dict-item]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).double()  # torch path
    handle = attach(model)
    results = []
    for _ in range(3):
        model(torch.randn(40, 16, dtype=torch.float64)).square().sum().backward()  # type: ignore[no-untyped-call]
        with Uploads() as uploads:
            worst = handle.collect()
        assert worst is not None and worst.dtype == torch.float32
        results.append((uploads.calls, worst))
    assert results[0][0] != []  # the first step uploads the layout...
    assert results[1][0] == [] and results[2][0] == []  # ...the next ones reuse it
    for _, w in results:  # every pass checked and clean (-1: the first layer's grad_x never ran)
        assert w[0, 1] == -1 and bool((w.flatten()[[0, 2, 3, 4, 5]] >= 0).all()), w
        assert float(w.max()) < 0.1
