"""NorMuon against a plain float64 transcription of DESIGN.md §3, plus its invariants."""

import math
import zlib

import pytest
import torch

from hymo_recipes.optim import NorMuon, orthogonalize
from hymo_recipes.optim.normuon import POLAR_EXPRESS_COEFFS

# ---------------------------------------------------------------------------------------------
# Reference: DESIGN.md §3 line by line, float64, one matrix at a time (no batching, no sharding).
# Coefficients retyped from OPTIMIZER_NOTES.md on purpose (not imported from the implementation).
REF_QUINTIC = [(3.4445, -4.7750, 2.0315)] * 5
REF_POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def ref_orthogonalize(U, method):
    X = U.clone()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    if method == "quintic":
        X = X / (X.norm() + 1e-7)
        coeffs = REF_QUINTIC
    else:
        X = X / (X.norm() * 1.02 + 1e-6)
        coeffs = REF_POLAR_EXPRESS
    for a, b, c in coeffs:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def ref_scale(kind, out, inp):
    return {
        "jordan": math.sqrt(max(1.0, out / inp)),
        "rms": 0.2 * math.sqrt(max(out, inp)),
        "spectral": math.sqrt(out / inp),
    }[kind]


def ref_normuon_step(W, G, M, v, *, lr, beta1, beta2, eps, wd, cautious_wd, neuron_norm,
                     nesterov, method, update_scale):
    """One step on one matrix W [out, in]; returns new (W, M, v)."""
    M = beta1 * M + (1 - beta1) * G
    U = (1 - beta1) * G + beta1 * M if nesterov else M
    O = ref_orthogonalize(U, method)
    if neuron_norm:
        v = beta2 * v + (1 - beta2) * (O**2).mean(dim=1)  # one value per output neuron
        Ohat = O / (v.sqrt() + eps)[:, None]
        Ohat = Ohat * O.norm() / Ohat.norm()
    else:
        Ohat = O
    mask = (Ohat * W >= 0).to(W.dtype) if cautious_wd else torch.ones_like(W)
    W = W - lr * wd * mask * W
    W = W - lr * ref_scale(update_scale, *W.shape) * Ohat
    return W, M, v


def run_reference(W0, grads, hp):
    """W0 [out, in] or [E, out, in]; experts are independent matrices."""
    mats = [W0] if W0.ndim == 2 else list(W0.unbind(0))
    out = []
    for e, W in enumerate(mats):
        M = torch.zeros_like(W)
        v = torch.zeros(W.shape[0], dtype=W.dtype)
        for G in grads:
            Ge = G if G.ndim == 2 else G[e]
            W, M, v = ref_normuon_step(W, Ge, M, v, **hp)
        out.append(W)
    return out[0] if W0.ndim == 2 else torch.stack(out)


SHAPES = {"tall": (48, 20), "wide": (20, 48), "square": (32, 32), "experts": (3, 24, 16)}
HP = dict(lr=0.02, beta1=0.95, beta2=0.95, eps=1e-8, wd=0.1, cautious_wd=True,
          neuron_norm=True, nesterov=True, method="polar_express", update_scale="jordan")


def run_normuon(W0, grads, hp, ortho_dtype, param_dtype=torch.float64):
    W = torch.nn.Parameter(W0.clone().to(param_dtype))
    opt = NorMuon(
        [W], lr=hp["lr"], momentum=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
        weight_decay=hp["wd"], cautious_wd=hp["cautious_wd"], neuron_norm=hp["neuron_norm"],
        nesterov=hp["nesterov"], orthogonalizer=hp["method"], update_scale=hp["update_scale"],
        ortho_dtype=ortho_dtype,
    )
    for G in grads:
        W.grad = G.to(param_dtype)
        opt.step()
    return W.detach()


def make_case(shape, seed, steps=4):
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1])
    grads = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]
    return W0, grads


VARIANTS = {
    "default": {},
    "quintic": dict(method="quintic"),
    "plain_muon": dict(neuron_norm=False),
    "no_cautious_no_nesterov": dict(cautious_wd=False, nesterov=False),
    "rms": dict(update_scale="rms"),
    "spectral": dict(update_scale="spectral"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_matches_float64_reference(shape_name, variant):
    hp = {**HP, **VARIANTS[variant]}
    W0, grads = make_case(SHAPES[shape_name], seed=zlib.crc32(f"{shape_name}-{variant}".encode()) % 1000)  # the same inputs every run
    ref = run_reference(W0, grads, hp)
    got = run_normuon(W0, grads, hp, ortho_dtype="float64")
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    # the test can fail: 4 steps moved W by much more than the tolerance
    assert (ref - W0).abs().max() > 1e-3


@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_bf16_orthogonalisation_close_to_reference(shape_name):
    """The production path (bf16 iteration, fp32 params/state) stays near the fp64 maths."""
    W0, grads = make_case(SHAPES[shape_name], seed=7)
    ref = run_reference(W0, grads, HP)
    got = run_normuon(W0, grads, HP, ortho_dtype="bfloat16", param_dtype=torch.float32)
    d_ref, d_got = ref - W0, got.double() - W0
    rel = (d_got - d_ref).norm() / d_ref.norm()
    # bf16 has an 8-bit mantissa; 5 iterations give ~1% elementwise error in O.
    assert rel < 0.03, rel


def test_neuron_axis_is_output_axis():
    """v holds one value per output row, and rows of Ô have equal RMS after one step.

    With v0 = 0 and one step, v = (1−β2)·mean_row(O²), so every row of O/sqrt(v) has the same
    norm: equalising rows (outputs), not columns (inputs), is the NorMuon signature. A tall
    matrix makes the rows≥cols heuristic (normalise the longer axis) fail this test.
    """
    W0, grads = make_case((40, 16), seed=3, steps=1)
    W = torch.nn.Parameter(W0.clone())
    # eps = 0 so that the row equalisation is exact, not exact up to eps
    opt = NorMuon([W], lr=1.0, eps=0.0, weight_decay=0.0, ortho_dtype="float64",
                  update_scale="spectral")
    W.grad = grads[0]
    opt.step()
    assert opt.state[W]["neuron_v"].shape == (40,)
    update = (W0 - W.detach()) / math.sqrt(40 / 16)
    row_norms = update.norm(dim=1)
    col_norms = update.norm(dim=0)
    torch.testing.assert_close(row_norms, row_norms.mean().expand(40), rtol=1e-8, atol=0)
    assert col_norms.std() / col_norms.mean() > 1e-3  # columns are not equalised
    # and the rescale keeps the orthogonalised update's norm: ‖Ô‖_F = ‖O‖_F
    U = 0.05 * grads[0] + 0.95 * (0.05 * grads[0])  # (1−β)G + β·M with M = (1−β)G
    O = ref_orthogonalize(U, "polar_express")
    torch.testing.assert_close(update.norm(), O.norm(), rtol=1e-10, atol=0)


def test_experts_are_orthogonalised_per_expert():
    """Scaling one expert's gradient must not change another expert's update."""
    W0, grads = make_case((3, 24, 16), seed=11, steps=2)
    base = run_normuon(W0, grads, HP, ortho_dtype="float64")
    grads2 = [g.clone() for g in grads]
    for g in grads2:
        g[0] *= 1000.0
    other = run_normuon(W0, grads2, HP, ortho_dtype="float64")
    torch.testing.assert_close(other[1:], base[1:], rtol=1e-12, atol=1e-14)


def spectrum_case(m=256, n=1024):
    """A [m, n] matrix with singular values 1/k (condition number m) and known vectors."""
    g = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    S = 1.0 / torch.arange(1, m + 1, dtype=torch.float64)
    return U, S, V


@pytest.mark.parametrize(
    "method,band",
    # Measured on this 1/k spectrum (condition 256): Polar Express [0.859, 1.141], quintic
    # [0.681, 1.203], identical in fp64 and bf16 to 3 digits. OPTIMIZER_NOTES reports
    # [0.68, 1.14] and [0.36, 1.20] at condition 1024. A 5-step cubic gives [0.05, 1.0].
    [("polar_express", (0.8, 1.15)), ("quintic", (0.6, 1.25))],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_singular_values_in_band(method, band, dtype):
    U, S, V = spectrum_case()
    O = orthogonalize(U @ torch.diag(S) @ V.T, steps=5, method=method, dtype=dtype).double()
    sv = torch.linalg.svdvals(O)
    lo, hi = band
    assert sv.min() > lo and sv.max() < hi, (sv.min().item(), sv.max().item())
    # singular vectors are kept: O ≈ U f(S) Vᵀ, so Uᵀ O V is nearly diagonal
    core = U.T @ O @ V
    off = core - torch.diag(torch.diagonal(core))
    assert off.norm() / core.norm() < (1e-6 if dtype == torch.float64 else 0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_iteration_on_the_cpu_is_the_gpus_rounding(dtype):
    """On a CPU the bf16 / fp16 iteration forms each product in fp32 and rounds it once (what a
    GPU's half-precision GEMM does; torch's CPU bf16 matmul is ~50x slower without native bf16
    instructions). Against torch's own half-precision baddbmm chain on the same inputs: the same
    distance from the fp64 iteration, and one rounding apart from it."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 24, 56, generator=g, dtype=torch.float64)
    got = orthogonalize(x, dtype=dtype).double()
    X = x.to(dtype)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)  # orthogonalize's start, in its dtype
    exact, chain = X.double(), X
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = exact @ exact.mT
        exact = a * exact + (b * A + c * A @ A) @ exact
        A = chain @ chain.mT  # torch's half-precision kernels, as the GPU path calls them
        chain = torch.baddbmm(chain, torch.baddbmm(A, A, A, beta=b, alpha=c), chain, beta=a, alpha=1.0)
    err, err_chain = ((got - exact).norm() / exact.norm()).item(), ((chain.double() - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 1.1 * err_chain, (err, err_chain)  # half-precision error, no more
    assert ((got - chain.double()).norm() / exact.norm()).item() < 0.8 * err_chain  # rounding apart
    # and it is the fp32-product path, not torch's half-precision kernels
    Y = X
    for a, b, c in POLAR_EXPRESS_COEFFS:
        Yf = Y.float()
        A = torch.bmm(Yf, Yf.mT).to(dtype).float()
        Y = torch.baddbmm(Yf, torch.baddbmm(A, A, A, beta=b, alpha=c).to(dtype).float(), Yf, beta=a).to(dtype)
    assert torch.equal(got, Y.double())


def test_singular_value_band_rejects_the_seed_cubic():
    """The band above is discriminating: the seed's cubic 1.5X − 0.5X³ fails it (errata §5)."""
    U, S, V = spectrum_case()
    X = U @ torch.diag(S) @ V.T
    X = X / X.norm()
    for _ in range(5):
        X = 1.5 * X - 0.5 * X @ X.T @ X
    assert torch.linalg.svdvals(X).min() < 0.1


def test_zero_grad_step_is_harmless_and_none_grad_is_zero():
    """A param without grad takes a zero gradient: with zero momentum nothing moves."""
    W0, _ = make_case((8, 6), seed=1, steps=0)
    W = torch.nn.Parameter(W0.clone())
    opt = NorMuon([W], lr=0.02, weight_decay=0.0, ortho_dtype="float64")
    opt.step()  # W.grad is None
    assert torch.equal(W.detach(), W0)
    assert torch.equal(opt.state[W]["momentum_buffer"], torch.zeros_like(W0))
    assert torch.equal(opt.state[W]["neuron_v"], torch.zeros(8, dtype=torch.float64))


def test_none_grad_after_a_real_step_equals_a_zero_grad():
    """Step 2 with no gradient does what a zero gradient does: the momentum still moves W."""
    W0, (G,) = make_case((8, 6), seed=3, steps=1)
    twins = []
    for second in (None, torch.zeros_like(G)):
        W = torch.nn.Parameter(W0.clone())
        opt = NorMuon([W], lr=0.02, weight_decay=0.1, ortho_dtype="float64")
        W.grad = G
        opt.step()
        after_first = W.detach().clone()
        W.grad = second
        opt.step()
        twins.append((W.detach(), opt.state[W]["momentum_buffer"], opt.state[W]["neuron_v"], after_first))
    (w_none, m_none, v_none, first), (w_zero, m_zero, v_zero, _) = twins
    assert torch.equal(w_none, w_zero) and torch.equal(m_none, m_zero) and torch.equal(v_none, v_zero)
    assert (w_none - first).abs().max() > 1e-4  # the momentum moved it, beyond the decay alone
    assert not torch.allclose(w_none, first * (1 - 0.02 * 0.1))


def test_lr_as_tensor_and_schedule_scaling():
    W0, grads = make_case((12, 10), seed=2, steps=2)
    a = run_normuon(W0, grads, HP, ortho_dtype="float64")
    W = torch.nn.Parameter(W0.clone())
    opt = NorMuon([W], lr=torch.tensor(0.02, dtype=torch.float64), ortho_dtype="float64",
                  weight_decay=torch.tensor(0.1, dtype=torch.float64))
    for G in grads:
        W.grad = G
        opt.step()
    torch.testing.assert_close(W.detach(), a, rtol=1e-12, atol=1e-14)

    # a schedule: the lr halves before step 2, written into the tensor (in place, as the
    # schedulers do with a tensor lr) or assigned as a float; both follow it
    runs = []
    for lr in (torch.tensor(0.02, dtype=torch.float64), 0.02):
        W = torch.nn.Parameter(W0.clone())
        opt = NorMuon([W], lr=lr, weight_decay=0.1, ortho_dtype="float64")
        for i, G in enumerate(grads):
            if i == 1:
                if isinstance(lr, torch.Tensor):
                    lr.fill_(0.01)
                else:
                    opt.param_groups[0]["lr"] = 0.01
            W.grad = G
            opt.step()
        runs.append(W.detach())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-12, atol=1e-14)
    assert (runs[0] - a).abs().max() > 1e-4  # the halved lr took effect


def test_state_precreated_and_shapes():
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(2, 5, 3))]
    opt = NorMuon(params)
    assert [set(opt.state[p]) for p in params] == [{"momentum_buffer", "neuron_v"}] * 2
    assert opt.state[params[0]]["neuron_v"].shape == (5,)
    assert opt.state[params[1]]["neuron_v"].shape == (2, 5)
    assert opt.state[params[0]]["momentum_buffer"].dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(orthogonalizer="cubic"), "orthogonalizer"),
        (dict(update_scale="max"), "update_scale"),
        (dict(momentum=1.0), "momentum"),
        (dict(lr=-1.0), "lr"),
        (dict(ortho_dtype="float16"), "ortho_dtype"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NorMuon([torch.nn.Parameter(torch.randn(3, 3))], **kwargs)


def test_rejects_vectors():
    with pytest.raises(ValueError, match=r"shape \(7,\)"):
        NorMuon([torch.nn.Parameter(torch.randn(7))])


def test_cautious_wd_decays_exactly_where_update_agrees_with_weight():
    """First step from the same state with wd = 0 and wd = 0.5: Ô does not depend on wd, so
    W_wd − W_0 = −lr·wd·m⊙W with m = [Ô⊙W ≥ 0] and Ô = (W0 − W_0)/(lr·s)."""
    W0, grads = make_case((6, 10), seed=5, steps=1)
    lr, wd = 0.1, 0.5

    def one_step(weight_decay, cautious):
        W = torch.nn.Parameter(W0.clone())
        opt = NorMuon([W], lr=lr, weight_decay=weight_decay, cautious_wd=cautious,
                      ortho_dtype="float64")
        W.grad = grads[0]
        opt.step()
        return W.detach()

    s = 1.0  # jordan scale for out = 6 < in = 10
    Ohat = (W0 - one_step(0.0, True)) / (lr * s)
    mask = (Ohat * W0 >= 0).double()
    assert 0 < mask.sum() < mask.numel()  # both cases occur
    torch.testing.assert_close(one_step(wd, True) - one_step(0.0, True), -lr * wd * mask * W0,
                               rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(one_step(wd, False) - one_step(0.0, False), -lr * wd * W0,
                               rtol=1e-10, atol=1e-14)
