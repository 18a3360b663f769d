"""``poslsh output-error``: Positional-LSH attention against exact ALiBi on real activations.

For each requested layer the model's own q, k, v are captured once; ALiBi slopes (or one sigma)
give a bandwidth per head. Cells: per layer, one per baseline (no bias, fixed block, windowed
exact ALiBi per window) and one per (s, trial) of Positional LSH, all heads at once. Each head
gets a row with its own seed, so ``poslsh sample n=<n> sigma=<sigma> s=<s> seed=<seed>``
replays its masks. Errors are against exact ALiBi in float64.
"""
from __future__ import annotations

import io
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Optional, Union

from poslsh_cli.lm import models
from poslsh_cli.experiments.output_error.report import MODEL_OWN, plot, report, summary
from poslsh_cli.core.config import ENCODING_HELP, Spec, check_encoding, key
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import Experiment, MemoryNeed, choices
from poslsh_cli.experiments.devices import Device, Dtype, resolve_device, synchronize, torch_dtype
from poslsh_cli.numerics.methods import INFO, Method, baselines
from poslsh_cli.attention.scheme import scheme_key
from poslsh_cli.numerics.sampling import Sampler, Slopes, bandwidths, derive_seed
from poslsh_cli.lm.checkpoint import weights_bytes
from poslsh_cli.numerics.metrics import output_errors, paper_output_metrics


#: The reference methods output-error reports beside Positional LSH and exact ALiBi.
Baseline = choices("Baseline", baselines(), __name__)


@dataclass(frozen=True)
class OutputErrorSpec(Spec):
    model: models.ModelSpec = field(default_factory=models.ModelSpec, metadata={"help": "model preset or checkpoint"})
    text: str = key("builtin (Python's own documentation prose) or a text file", "builtin")
    encoding: str = key(ENCODING_HELP + " (text=)", "utf-8")
    n: int = key("number of tokens (the first n of the text)", 512, ge=2)
    layers: Union[Literal["all"], tuple[int, ...]] = key("all, or a list of layer indices", "all", ge=0)
    heads: Union[Literal["all"], tuple[int, ...]] = key("all, or a list of head indices", "all", ge=0)
    sigma: Optional[float] = scheme_key("sigma", None, "one for every head; null: ALiBi slopes (see alibi)")
    alibi: Slopes = scheme_key("alibi", Slopes.AUTO, "ALiBi checkpoints: BLOOM, MPT, Falcon-RW, Baichuan")
    causal: Union[Literal["auto"], bool] = key("auto (decoders causal, encoders not), true or false", "auto")
    s: tuple[int, ...] = scheme_key("s", [1, 2, 4, 8, 16, 32, 64], "int or list")
    trials: int = key("independent repetitions per s", 3, ge=1)
    sampler: tuple[Sampler, ...] = scheme_key("sampler", [Sampler.IID], "a list: side by side")
    baselines: tuple[Baseline, ...] = key("reference methods: " + ", ".join(b.value for b in Baseline)
                                          + " ([] for none)", list(Baseline),
                                          noun="baseline", empty=True)
    window_sigmas: tuple[float, ...] = scheme_key("window_sigmas", [4.0], "the windowed baselines")
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N", Device("auto"))
    dtype: Dtype = key("compute dtype of the approximations (the exact reference is float64)", Dtype.FLOAT32)
    save_qkv: bool = key("write the captured q, k, v of each layer to qkv/layer<L>.npz", False)
    convention: Literal["model", "official"] = key(
        "model: the model's attention, softmax(q k^T * scaling + log M) v, causal for decoders; official: as the "
        "paper's validation script computes it, keys as rows (softmax(k q^T / sqrt(d) + log M) v) and "
        "bidirectional (causal= is then ignored)", "model")
    backend: Literal["auto", "dense"] = key("attention path of the approximations: auto (the plan) or dense (one "
                                           "biased SDPA call with log M~ built from the band in O(s n): for "
                                           "s in the thousands)", "auto")

    def check(self) -> None:
        check_encoding(self.encoding)


@dataclass(frozen=True)
class OutputErrorRow:
    model: str
    layer: int
    head: int
    sigma: float
    causal: bool
    n: int
    s: int  # 0 for baselines
    trial: int
    seed: int  # -1 where nothing is random
    method: str  # poslsh | fixed_block | no_bias | windowed
    rel_fro: float
    max_row_rel: float
    seconds: float  # wall time of the method for the whole layer (all heads at once)
    window: int  # windowed: w (for the head); else -1
    qkv_file: str
    convention: str = "model"  # model | official (keys as rows, bidirectional: the paper's script)
    rel_sym: float = float("nan")  # ||T* - T~|| / (0.5 (||T*|| + ||T~||)), the paper's relative difference
    row_rel_median: float = float("nan")  # row-wise relative differences (symmetric denominator): median
    row_rel_p90: float = float("nan")
    row_rel_p99: float = float("nan")
    cosine: float = float("nan")  # cosine similarity of the flattened outputs
    exp_overflow: bool = False  # official: exp of the largest logit overflows float32 (the script takes exp(S) raw)
    sampler: str = ""  # poslsh: how its masks were drawn (iid, stratified, sobol); else empty


#: results.csv's columns: the row's fields, in their order
COLUMNS = tuple(f.name for f in fields(OutputErrorRow))


@dataclass
class OutputErrorContext:
    """What every cell of one run shares: captured tensors, bandwidths, exact outputs."""

    model_name: str
    layers: list[int]
    heads: list[int]
    sigmas: Any  # (len(heads),) float64
    causal: bool
    device: Any
    dtype: Any
    qkv: dict[int, tuple[Any, Any, Any, float]]
    input_ids: Any
    own: dict[int, Any] = field(default_factory=dict)  # ALiBi models: their own attention output per layer
    exact: dict[int, Any] = field(default_factory=dict)
    files: dict[str, Any] = field(default_factory=dict)  # relative path -> bytes producer
    convention: str = "model"


def prepare(spec: OutputErrorSpec) -> OutputErrorContext:
    """Load the checkpoint, tokenise, capture q/k/v of the requested layers (raises ConfigError)."""
    import torch

    from poslsh_cli.lm import capture, documents, pretrained

    device = resolve_device(spec.device)
    path = models.resolve(spec.model)
    loaded = pretrained.load(path, trust_remote_code=spec.model.trust_remote_code, device=str(device))
    if loaded.max_positions is not None and spec.n > loaded.max_positions:
        raise ConfigError(f"n={spec.n} exceeds the model's {loaded.max_positions} positions")
    layers = list(range(loaded.num_layers)) if spec.layers == "all" else sorted(set(spec.layers))
    heads = list(range(loaded.num_heads)) if spec.heads == "all" else sorted(set(spec.heads))
    if max(layers) >= loaded.num_layers:
        raise ConfigError(f"layer {max(layers)} out of range: the model has {loaded.num_layers} layers")
    if max(heads) >= loaded.num_heads:
        raise ConfigError(f"head {max(heads)} out of range: the model has {loaded.num_heads} heads")
    ids = documents.tokenize(loaded.tokenizer, documents.read_text(spec.text, spec.encoding), spec.n)
    captured = capture.capture_qkv(loaded, ids, layers)
    own_slopes = loaded.alibi_sigmas is not None and spec.sigma is None and spec.alibi is not Slopes.STANDARD
    try:
        all_sigmas = bandwidths(loaded.num_heads, spec.sigma, loaded.alibi_sigmas, spec.alibi)
    except ValueError as exc:
        raise ConfigError(f"{exc} ({loaded.model_type})") from None
    causal = loaded.causal if spec.causal == "auto" else bool(spec.causal)
    official = spec.convention == "official"
    causal = causal and not official
    qkv, own = {}, {}
    for layer in layers:
        c = captured[layer]
        sel = torch.as_tensor(heads, device=c.q.device)
        if official:  # scores K Q^T / sqrt(d): the keys take the queries' place
            qkv[layer] = (c.k[sel], c.q[sel], c.v[sel], 1.0 / math.sqrt(c.q.shape[-1]))
        else:
            qkv[layer] = (c.q[sel], c.k[sel], c.v[sel], c.scaling)  # (H', n, d) each
        if own_slopes and causal and not official:
            own[layer] = c.output[sel]
    ctx = OutputErrorContext(model_name=models.display_name(spec.model, path), layers=layers, heads=heads,
                  sigmas=all_sigmas[heads], causal=causal, device=device, dtype=torch_dtype(spec.dtype.value),
                  qkv=qkv, input_ids=ids[0].numpy(), own=own, convention=spec.convention)
    if spec.save_qkv:
        for layer in layers:
            ctx.files[_qkv_file(layer)] = (lambda layer=layer: _npz(ctx, layer))
    del loaded
    return ctx


def memory(spec: OutputErrorSpec) -> MemoryNeed | None:
    """Peak bytes: the weights (float32), every layer's captured q, k, v and output (float32), the
    float64 exact outputs kept per layer, and the model's own attention scores of one layer
    (H n^2) during the capture pass. None when the checkpoint cannot be found (prepare says why)."""
    import json

    try:
        path = models.resolve(spec.model)
        cfg = json.loads((path / "config.json").read_text())
    except (ConfigError, OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    if spec.n > int(cfg.get("max_position_embeddings") or cfg.get("max_seq_len") or 1 << 62):
        return None  # prepare refuses the length itself
    layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("n_layers") or 1)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or cfg.get("n_heads") or 1)
    hidden = int(cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("n_embd") or 64)
    n = spec.n
    b = weights_bytes(path) + layers * 4 * 4.0 * n * hidden + layers * 8.0 * n * hidden
    b += 3 * 4.0 * heads * n * n + 16 * 4.0 * n * hidden
    return MemoryNeed(b, f"{path.name}, n={n}, {layers} layers", spec.device)


def _qkv_file(layer: int) -> str:
    return f"qkv/layer{layer}.npz"


def _npz(ctx: OutputErrorContext, layer: int) -> bytes:
    import numpy as np

    q, k, v, scaling = ctx.qkv[layer]
    buf = io.BytesIO()
    np.savez_compressed(buf, q=q.float().cpu().numpy(), k=k.float().cpu().numpy(), v=v.float().cpu().numpy(),
                        input_ids=ctx.input_ids, heads=np.asarray(ctx.heads), scaling=np.float64(scaling))
    return buf.getvalue()


def cells(spec: OutputErrorSpec, ctx: OutputErrorContext | None = None) -> list[dict[str, Any]]:
    """Grid order: per layer, the baselines, then Positional LSH for each (s, trial)."""
    layers = ctx.layers if ctx is not None else (list(spec.layers) if spec.layers != "all" else [])
    out: list[dict[str, Any]] = []
    for layer in layers:
        if ctx is not None and layer in ctx.own:  # an ALiBi model's own attention, against exact ALiBi
            out.append({"layer": layer, "method": MODEL_OWN})
        for m in [Method(b.value) for b in spec.baselines] + [Method.POSLSH]:
            if INFO[m].params == "window":
                out += [{"layer": layer, "method": m.value, "window_sigmas": float(c)} for c in spec.window_sigmas]
            elif INFO[m].randomized:
                out += [{"layer": layer, "method": m.value, "s": s, "trial": t, "sampler": sm.value}
                        for sm in spec.sampler for s in spec.s for t in range(spec.trials)]
            else:
                out.append({"layer": layer, "method": m.value})
    return out


def _exact(ctx: OutputErrorContext, layer: int) -> Any:
    """Exact ALiBi output of a layer in float64 (chunked: no n x n tensor), cached."""
    from poslsh_cli.attention import AttentionSpec, attend

    if layer not in ctx.exact:
        q, k, v, scaling = ctx.qkv[layer]
        spec = AttentionSpec(Method.EXACT, ctx.sigmas, ctx.causal, scale=scaling)
        ctx.exact[layer] = attend(*(t[None].double().to(ctx.device) for t in (q, k, v)), spec, backend="chunked")[0]
    return ctx.exact[layer]


def run_cell(spec: OutputErrorSpec, key: dict[str, Any], ctx: OutputErrorContext, work: Any = None) -> tuple[list[dict], dict]:
    import numpy as np

    from poslsh_cli.attention import AttentionSpec, attend
    if key["method"] == MODEL_OWN:
        return _model_own(spec, key, ctx)
    layer, method = key["layer"], Method(key["method"])
    q, k, v, scaling = ctx.qkv[layer]
    q, k, v = (t[None].to(device=ctx.device, dtype=ctx.dtype) for t in (q, k, v))  # (1, H, n, d)
    n = q.shape[-2]
    exact = _exact(ctx, layer)
    s, trial = key.get("s", 0), key.get("trial", 0)
    seeds = [derive_seed(spec.seed, "output-error", layer, h, s, trial) if INFO[method].randomized else -1
             for h in ctx.heads]
    att = AttentionSpec.build(method, ctx.sigmas, n, ctx.causal, s=s,
                              rng=[np.random.default_rng(sd) for sd in seeds] if INFO[method].randomized else None,
                              scale=scaling, window_sigmas=key.get("window_sigmas"),
                              sampler=key.get("sampler", "iid"))
    window = att.window
    synchronize(ctx.device)
    t0 = time.perf_counter()
    dense = spec.backend == "dense" and method is Method.POSLSH
    out = attend(q, k, v, att, **({"backend": "dense"} if dense else {}))
    synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    qkv_file = _qkv_file(layer) if spec.save_qkv else ""
    rows = [OutputErrorRow(model=ctx.model_name, layer=layer, head=h, sigma=float(sg), causal=ctx.causal, n=n, s=s,
                           trial=trial, seed=sd, method=method.value, seconds=seconds, window=w, qkv_file=qkv_file,
                           sampler=key.get("sampler", "iid") if INFO[method].randomized else "", **m)
            for h, sg, sd, w, m in zip(ctx.heads, ctx.sigmas, seeds, window or [-1] * len(ctx.heads),
                                       _metrics(ctx, layer, exact, out[0]))]
    return [asdict(r) for r in rows], {}


def _metrics(ctx: OutputErrorContext, layer: int, exact: Any, approx: Any) -> list[dict]:
    """Per head: our errors against exact ALiBi, the paper's validation metrics, and whether the
    official script's raw exp(S) overflows float32 on this layer's scores."""
    rel_fro, max_row = output_errors(exact, approx)
    paper = paper_output_metrics(exact, approx)
    over = _overflows(ctx, layer)
    return [{"rel_fro": float(rel_fro[i]), "max_row_rel": float(max_row[i]), "convention": ctx.convention,
             "exp_overflow": bool(over[i]), **{k: float(v[i]) for k, v in paper.items()}}
            for i in range(len(rel_fro))]


def _overflows(ctx: OutputErrorContext, layer: int) -> list[bool]:
    """Per head: the largest score exceeds log(float32 max) (exp(S) is inf in float32), computed
    by query chunks without an n x n tensor; only for the official convention."""
    import numpy as np
    import torch

    q, k, _, scaling = ctx.qkv[layer]
    if ctx.convention != "official":
        return [False] * q.shape[0]
    if ("overflow", layer) in ctx.exact:  # once per layer, not once per cell
        return ctx.exact[("overflow", layer)]
    top = torch.full((q.shape[0],), -torch.inf, dtype=torch.float64)
    for a in range(0, q.shape[1], 1024):
        top = torch.maximum(top, (q[:, a:a + 1024].double() @ k.double().transpose(-1, -2)).amax(dim=(-1, -2)).cpu()
                            * scaling)
    ctx.exact[("overflow", layer)] = [bool(x) for x in (top > np.log(np.finfo(np.float32).max)).tolist()]
    return ctx.exact[("overflow", layer)]


def _model_own(spec: OutputErrorSpec, key: dict[str, Any], ctx: OutputErrorContext) -> tuple[list[dict], dict]:
    """``||own - T*|| / ||T*||``: how far the model's own attention output is from exact ALiBi
    recomputed from its captured q, k, v with its own slopes (float rounding, or its own
    approximations, such as Falcon's bfloat16 bias)."""
    layer = key["layer"]
    own = ctx.own[layer].to(ctx.device)
    n = own.shape[-2]
    rows = [OutputErrorRow(model=ctx.model_name, layer=layer, head=h, sigma=float(sg), causal=ctx.causal, n=n, s=0,
                           trial=0, seed=-1, method=MODEL_OWN, seconds=0.0, window=-1,
                           qkv_file=_qkv_file(layer) if spec.save_qkv else "", **m)
            for h, sg, m in zip(ctx.heads, ctx.sigmas, _metrics(ctx, layer, _exact(ctx, layer), own))]
    return [asdict(r) for r in rows], {}


def skip_reason(spec: OutputErrorSpec) -> str | None:
    return models.unavailable(spec.model)


EXPERIMENT = Experiment(
    name="output-error",
    spec=OutputErrorSpec,
    help="""Positional-LSH attention against exact ALiBi on a model's own q, k, v.

    Captures each layer's query/key/value (after RoPE and q/k norms, GQA expanded) from a local
    checkpoint, then measures ||T* - T~||_F / ||T*||_F per head for each s, with the no-bias,
    fixed-block and windowed-ALiBi baselines. Default: the shipped all-MiniLM-L6-v2, n=512.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    presets=("output_error_minilm", "output_error_minilm_samplers", "output_error_official_minilm",
             "output_error_official_mistral_7b",
             "output_error_official_llama_4_scout", "output_error_qwen3_0_6b", "output_error_mistral_7b", "output_error_llama_4_scout",
             "output_error_bloom_560m", "output_error_falcon_rw_1b", "output_error_mpt_7b", "output_error_baichuan_13b"),
    order=30,
    groups=("model",),
    skip_reason=skip_reason,
    memory=memory,
)
