"""Adding an attention method (docs/ARCHITECTURE.md, "Adding an attention method"): a toy method,
declared the way a contributor declares one, runs through the float64 reference, every path the
plan chooses for it on the CPU (the dense bias, with and without gradients), FlexAttention
(uncompiled, several 128-token tiles), attention at explicit positions, a model's cached decoding
and the forgetting KV cache; an unknown method raises everywhere it is asked for.

The toy is "bucketed local ALiBi": bias ``-floor(|i-j| / b) b / sigma_h`` for ``|i-j| <= W`` (b = 4,
W = 96), deterministic. :data:`TOY_SOURCE` is its whole declaration. Adding it for real touches:

    poslsh_cli/numerics/methods.py    TOY_SOURCE above DECLARED, BUCKETED in DECLARED, its Method member
    poslsh_cli/attention/scheme.py    its Position member (the scheme name)
    tests/test_methods.py             (or its own test file) a test like the ones below

three files, no fourth (both enums list their members where a reader and a type checker see them,
and a member missing from either fails at import): the plan reads its kernels, the generic kernels (the dense bias, FlexAttention's
score_mod, the reference, attention at explicit positions) its score and key mask, the KV cache its
forgetting rule, and its scheme name becomes a position scheme (``train position=``, ``perplexity
attention=``, ``bench methods=``). :func:`test_the_declaration_in_methods_py_is_the_whole_change`
makes that diff in a copy of the package and uses the method from the command line. A dedicated
fast kernel would add two more files: its implementation in an attention module and its
row in ``attention.api.KERNELS``.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import poslsh_cli
from poslsh_cli.attention import AttentionSpec, attend, choose, laplacian_weight, mean_mask_weight, reference_attention
from poslsh_cli.attention.api import reference_weight
from poslsh_cli.attention.plan import Backend, backends_of
from poslsh_cli.attention.positioned import allowed_from_mask, positioned_attention, positions_from_padding
from poslsh_cli.numerics import methods
from poslsh_cli.numerics.methods import Method, MethodDef, method_def  # noqa: F401 (MethodDef: TOY_SOURCE)

from test_attention import naive_tolerance, qkv

TOY_SOURCE = '''
BUCKET, REACH = 4, 96  # bucketed local ALiBi: distances rounded down to multiples of 4, keys within 96


def bucketed_score(p, h, qi, kj):
    """-floor(|i - j| / b) b / sigma_h: ALiBi's bias, constant on buckets of b distances."""
    d = abs(qi - kj)
    return -p.slopes[h] * (d - d % BUCKET).to(p.slopes.dtype)


def bucketed_keep(p, h, qi, kj):
    return abs(qi - kj) <= REACH


def bucketed_forget(spec, t):
    return t - REACH


BUCKETED = MethodDef("bucketed", "bucketed", "none", False, "bucketed local ALiBi", score=bucketed_score,
                     keep=bucketed_keep, forget=bucketed_forget)
'''
exec(TOY_SOURCE)  # here as in methods.py: BUCKETED and its functions are names of this module
SIGMAS = np.array([2.0, 4.0, 8.0, 16.0])


def toy_weight(n: int, sigmas=SIGMAS) -> torch.Tensor:
    """The toy's weight written out independently: (H, n, n) float64."""
    d = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    w = np.exp(-(d - d % 4)[None] / np.asarray(sigmas)[:, None, None]) * (d <= 96)[None]
    return torch.as_tensor(w)


@pytest.fixture
def toy():
    """The toy declared from outside methods.py (its text executed above as methods.py would
    execute it), then taken back."""
    method = methods.register(BUCKETED)  # noqa: F821 (defined by TOY_SOURCE)
    yield method
    methods.unregister("bucketed")


def test_the_toy_has_the_declared_weight_and_the_reference_computes_it(toy):
    n = 150
    torch.testing.assert_close(reference_weight(AttentionSpec.build(toy, SIGMAS, n, True), n), toy_weight(n),
                               rtol=1e-14, atol=0)
    q, k, v = qkv(B=1, H=4, n=n, d=8)
    for causal in (True, False):
        spec = AttentionSpec.build(toy, SIGMAS, n, causal)
        ref, _ = reference_attention(q, k, v, toy_weight(n), causal)
        torch.testing.assert_close(attend(q, k, v, spec, backend="reference"), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_cpu_path_of_the_toy_equals_the_reference(toy, causal, dtype):
    """At n = 300 (three 128-token tiles): the path the plan chooses (inference and training), the
    dense bias forced and FlexAttention uncompiled forced, against the float64 reference."""
    n = 300
    spec = AttentionSpec.build(toy, SIGMAS, n, causal)
    assert backends_of(toy) == (Backend.DENSE, Backend.FLEX, Backend.REFERENCE)
    q, k, v = qkv(B=2, H=4, n=n, d=16)
    ref, _ = reference_attention(q, k, v, toy_weight(n), causal)
    tol = naive_tolerance(q, k, v, toy_weight(n), causal, dtype) + 1e-14  # float64: a few roundings
    for grad in (False, True):
        assert choose(toy, device="cpu", dtype=dtype, n=n, causal=causal, grad=grad).backend is Backend.DENSE
    ran = []
    for backend in ("auto", "dense") + (("flex",) if dtype != torch.float64 else ()):
        x = [t.to(dtype) for t in (q, k, v)]
        out = attend(*x, spec, backend=backend, on_plan=lambda p: ran.append(p.label))
        assert out.dtype == dtype and (out.double() - ref).abs().max().item() <= tol, backend
    assert ran[-1] == "flex" if dtype != torch.float64 else ran == ["dense", "dense"]


def test_the_toy_trains_on_the_path_the_plan_chooses(toy):
    """Gradients through the planned path (the dense bias) are the float64 reference's."""
    n = 140
    spec = AttentionSpec.build(toy, SIGMAS, n, True)
    q, k, v = qkv(B=1, H=4, n=n, d=8, dtype=torch.float32)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    y = [t.double().clone().requires_grad_() for t in (q, k, v)]
    ran = []
    attend(*x, spec, on_plan=lambda p: ran.append(p.label)).sum().backward()
    reference_attention(*y, toy_weight(n), True)[0].sum().backward()
    assert ran == ["dense"]
    for a, b in zip(x, y):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)


def test_the_toy_at_explicit_positions_is_the_method_itself(toy):
    n = 300
    spec = AttentionSpec.build(toy, SIGMAS, n, True)
    q, k, v = qkv(B=2, H=4, n=n, d=16, dtype=torch.float32)
    q_pos, k_pos = positions_from_padding(None, 2, n, n, "cpu")
    out = positioned_attention(q, k, v, spec, q_pos, k_pos, allowed_from_mask(None, 2, n, n, "cpu"))
    ref, _ = reference_attention(q, k, v, toy_weight(n), True)
    assert (out.double() - ref).abs().max().item() < 2e-5
    # one query at the end against every key before it: a decoding step
    last = positioned_attention(q[:, :, -1:], k, v, spec, q_pos[:, -1:], k_pos, allowed_from_mask(None, 2, 1, n, "cpu"))
    assert (last.double() - ref[:, :, -1:]).abs().max().item() < 2e-5


def test_a_model_with_the_toy_scheme_decodes_through_the_forgetting_cache(toy):
    """The toy's scheme installed in a model: decoding through ForgettingCache gives the full
    forward's logits, holding no more keys than its reach (W + 2) of 300."""
    from poslsh_cli.lm.kvcache import ForgettingCache, earliest_needed
    from poslsh_cli.lm.loading import Arch, build_model
    from poslsh_cli.lm.positions import Position, PositionState, method_of, randomized

    assert method_of(Position("bucketed")) == toy and not randomized("bucketed")
    spec = AttentionSpec.build(toy, SIGMAS, 10, True)
    assert earliest_needed(spec, torch.tensor([100, 500])).tolist() == [4, 404]
    arch = Arch(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, head_dim=16, max_positions=4096)
    model = build_model(arch, PositionState("bucketed", SIGMAS), seed=1).eval()
    a = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(a, use_cache=False).logits[0]
        cache = ForgettingCache(model)
        steps, kept = [model(a[:, :100], cache=cache, use_cache=True).logits[0]], []
        for t in range(100, a.shape[1]):
            steps.append(model(a[:, t:t + 1], cache=cache, use_cache=True).logits[0])
            kept.append(cache.kept())
    assert (torch.cat(steps) - full).abs().max().item() < 1e-5
    assert max(kept) <= 96 + 2 and model.poslsh_position.plans


def test_an_unknown_method_raises_wherever_it_is_asked_for(toy):
    """A spec of a method that is not declared (here: taken back after the spec was built) never
    runs as exact attention without positions, nor as ALiBi: every place that asks the method raises."""
    from poslsh_cli.lm.kvcache import earliest_needed
    from poslsh_cli.lm.positions import Position

    with pytest.raises(ValueError):
        Method("no_such_method")
    with pytest.raises(ValueError):
        AttentionSpec.build("no_such_method", SIGMAS, 10, True)
    spec = AttentionSpec.build(toy, SIGMAS, 64, True)
    methods.unregister("bucketed")
    q, k, v = qkv(B=1, H=4, n=64, d=8, dtype=torch.float32)
    pos = torch.arange(64)[None]
    for backend in ("auto", "dense", "flex", "reference"):
        with pytest.raises(ValueError):
            attend(q, k, v, spec, backend=backend)
    with pytest.raises(ValueError):
        positioned_attention(q, k, v, spec, pos, pos, allowed_from_mask(None, 1, 64, 64, "cpu"))
    with pytest.raises(ValueError):
        earliest_needed(spec, torch.tensor([10]))
    with pytest.raises(ValueError):
        method_def(spec.method)
    with pytest.raises(ValueError):
        Position("bucketed")


@pytest.mark.parametrize("method", list(Method))
def test_the_declared_scores_are_the_weights_of_the_theory(method):
    """Each declared method's reference weight (exp of its score where its key mask keeps the pair)
    is the weight docs/THEORY.md gives it, built independently: L*, L* cut to the window, M~."""
    n, rng = 90, [np.random.default_rng(h) for h in range(4)]
    spec = AttentionSpec.build(method, SIGMAS, n, True, s=5, rng=rng, window_sigmas=2.0)
    w = reference_weight(spec, n)
    if method is Method.NO_BIAS:
        assert w is None
        return
    if spec.partitions is not None:
        expected = mean_mask_weight(spec.partitions)
    else:
        expected = laplacian_weight(n, torch.as_tensor(SIGMAS))
        if spec.window is not None:
            d = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
            expected = expected * (d[None] <= torch.as_tensor(spec.window)[:, None, None])
    torch.testing.assert_close(w, expected, rtol=1e-14, atol=0)


def test_the_declaration_in_methods_py_is_the_whole_change(tmp_path):
    """The real change, in a copy of the package: TOY_SOURCE, one line in DECLARED and its Method
    member in numerics/methods.py, its Position member in attention/scheme.py. The method is then listed, a position scheme, and runs from the
    command line (``poslsh bench methods=[bucketed]``) with no other edit."""
    pkg = tmp_path / "poslsh_cli"
    shutil.copytree(Path(poslsh_cli.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    path = pkg / "numerics" / "methods.py"
    text = path.read_text()
    anchor = "#: The declared methods, in display order."
    assert anchor in text
    text = text.replace(anchor, TOY_SOURCE.strip() + "\n\n\n" + anchor)
    head, tail = text.split("_REGISTERED: dict", 1)
    head = head[:head.rindex(")")] + "    BUCKETED,\n)" + head[head.rindex(")") + 1:]
    text = head + "_REGISTERED: dict" + tail
    path.write_text(text.replace('    POSLSH = "poslsh"\n', '    POSLSH = "poslsh"\n    BUCKETED = "bucketed"\n', 1))
    scheme = pkg / "attention" / "scheme.py"
    scheme.write_text(scheme.read_text().replace('    POSLSH = "poslsh"\n', '    POSLSH = "poslsh"\n    BUCKETED = "bucketed"\n', 1))
    changed = [p.relative_to(tmp_path).as_posix() for p in sorted(pkg.rglob("*.py"))
               if p.read_text() != (Path(poslsh_cli.__file__).parent / p.relative_to(pkg)).read_text()]
    assert changed == ["poslsh_cli/attention/scheme.py", "poslsh_cli/numerics/methods.py"]
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    code = ("from poslsh_cli.numerics.methods import Method; from poslsh_cli.lm.positions import Position; "
            "print(list(Method)[-1].value, Position('bucketed').value)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["bucketed", "bucketed"], r.stderr
    r = subprocess.run([sys.executable, "-m", "poslsh_cli", "bench", "methods=[bucketed]", "n=[256]", "heads=2",
                        "repeats=1", "warmup=0", f"out={tmp_path / 'run'}"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = (tmp_path / "run" / "results.csv").read_text().splitlines()
    assert len(rows) == 2 and "bucketed" in rows[1]


def test_a_declared_method_without_its_members_fails_at_import(tmp_path):
    """A declaration in DECLARED whose Method or Position member is missing is an ImportError naming
    the enum, not a scheme that silently lacks a name."""
    pkg = tmp_path / "poslsh_cli"
    shutil.copytree(Path(poslsh_cli.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    path = pkg / "numerics" / "methods.py"
    text = path.read_text()
    head, tail = text.split("_REGISTERED: dict", 1)
    head = head[:head.rindex(")")] + '    MethodDef("extra", "extra", "none", True, "x"),\n)' + head[head.rindex(")") + 1:]
    path.write_text(head + "_REGISTERED: dict" + tail)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    code = "import poslsh_cli.attention.scheme"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode != 0 and "Method's members must be DECLARED's names" in r.stderr
    path.write_text(path.read_text().replace('    POSLSH = "poslsh"\n', '    POSLSH = "poslsh"\n    EXTRA = "extra"\n', 1))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode != 0 and "Position's members must be the declared methods' scheme names" in r.stderr
