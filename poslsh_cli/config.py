"""Configuration: dataclass schemas (types and help), Hydra composition and validation.

The YAML files in ``conf/`` (shipped inside the package as ``poslsh_cli/conf``) hold the
defaults; the dataclasses below give every key its type and its help text, and are registered
in Hydra's ConfigStore so an unknown key or a wrong type is refused at composition.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

CONF_DIR = Path(__file__).resolve().parent / "conf"


class ConfigError(ValueError):
    """Bad user input: reported as one line on stderr with a non-zero exit."""


def _h(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


def _hl(text: str, default: list) -> Any:
    return field(default_factory=lambda: list(default), metadata={"help": text})


@dataclass
class CommonConfig:
    seed: int = _h("root seed; every cell's seed derives from it and its parameters", default=0)
    out: Optional[str] = _h("run directory (default runs/<command>/<timestamp>); an existing one is resumed",
                            default=None)


@dataclass
class SampleConfig(CommonConfig):
    n: int = _h("sequence length (number of positions), >= 2", default=64)
    sigma: Optional[float] = _h("kernel bandwidth sigma = 1/slope, > 0 (or give heads=)", default=8.0)
    heads: Optional[int] = _h("ALiBi head count: one sigma per head from the standard slopes "
                              "(overrides sigma)", default=None)
    s: int = _h("number of sampled partitions (masks), >= 1", default=16)


@dataclass
class MatrixErrorConfig(CommonConfig):
    n: Any = _hl("sequence lengths (int or list)", [256, 1024, 4096])
    sigma: Any = _hl("bandwidths sigma > 0 (float or list)", [4.0, 16.0])
    s: Any = _hl("numbers of samples (int or list)", [1, 2, 4, 8, 16, 32, 64, 128])
    trials: int = _h("independent repetitions per (n, sigma, s)", default=3)
    method: str = _h("fast (O(n) operators + Lanczos), dense (n x n float64 reference) or both",
                     default="fast")
    tol: float = _h("ARPACK tolerance for ||L*-M~||_2: Ritz residual <= tol*|value| (value within tol of an eigenvalue)",
                    default=1e-6)
    dense_max_n: int = _h("largest n for which method=dense/both builds n x n matrices",
                          default=8192)
    memory: bool = _h("also measure the fast path's peak memory (a second, untimed pass)", default=False)


@dataclass
class BlockStatsConfig(CommonConfig):
    n: Any = _hl("sequence lengths (int or list)", [1024, 4096, 16384, 65536, 262144, 1048576])
    sigma: Any = _hl("bandwidths sigma > 0 (float or list)", [4.0, 16.0, 64.0])
    s: Any = _hl("numbers of samples (int or list)", [16])
    s_per_log_n: Optional[float] = _h("c > 0: s = ceil(c ln n) for each n instead of s (the paper's regime for "
                                      "b_max ~ sigma log log n); null: the fixed s list", default=None)
    trials: int = _h("independent repetitions per (n, sigma, s)", default=20)


MODEL_PRESETS = ("minilm", "mistral-7b", "llama-4-scout", "qwen3-0.6b", "custom")


@dataclass
class ModelConfig:
    name: str = "minilm"
    path: Optional[str] = None  # checkpoint directory; presets: $POSLSH_MODELS/<subdir> when unset
    subdir: Optional[str] = None
    trust_remote_code: bool = False


@dataclass
class OutputErrorConfig(CommonConfig):
    model: ModelConfig = field(default_factory=ModelConfig, metadata={
        "help": "preset (minilm, mistral-7b, llama-4-scout, qwen3-0.6b) or a local HF checkpoint dir; "
                "model.path=DIR points a preset at its directory (else $POSLSH_MODELS/<name>)"})
    text: str = _h("builtin (Python's own documentation prose) or a text file", default="builtin")
    n: int = _h("number of tokens (the first n of the text)", default=512)
    layers: Any = _h("all, or a list of layer indices", default="all")
    heads: Any = _h("all, or a list of head indices", default="all")
    sigma: Optional[float] = _h("one sigma for every head; null: standard ALiBi slopes (see alibi)", default=None)
    alibi: str = _h("slopes when sigma=null: standard (m_h = 2^(-8h/H))", default="standard")
    causal: Any = _h("auto (decoders causal, encoders not), true or false", default="auto")
    s: Any = _hl("numbers of sampled masks (int or list)", [1, 2, 4, 8, 16, 32, 64])
    trials: int = _h("independent repetitions per s", default=3)
    baselines: Any = _hl("reference methods: no_bias, fixed_block, windowed", ["no_bias", "fixed_block", "windowed"])
    window_sigmas: Any = _hl("windowed baseline half-widths in units of sigma: w = ceil(c*sigma)", [4.0])
    device: str = _h("auto (CUDA when present), cpu, cuda, cuda:N", default="auto")
    dtype: str = _h("compute dtype of the approximations: float32, bfloat16, float16, float64 "
                    "(the exact reference is float64)", default="float32")
    save_qkv: bool = _h("write the captured q, k, v of each layer to qkv/layer<L>.npz", default=False)


@dataclass
class BenchConfig(CommonConfig):
    n: Any = _hl("sequence lengths (int or list)", [1024, 2048, 4096, 8192, 16384, 32768])
    heads: int = _h("number of heads; standard ALiBi slopes give one sigma per head", default=8)
    sigma: Optional[float] = _h("one sigma for every head instead of the ALiBi slopes", default=None)
    head_dim: int = _h("head dimension d", default=64)
    causal: Any = _hl("causal attention (bool or list)", [False])
    s: Any = _hl("Positional-LSH sample counts (each is one method point)", [1, 2, 4, 8, 16, 32])
    window_sigmas: Any = _hl("windowed exact ALiBi half-widths w = ceil(c*sigma), one point per c",
                             [0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
    methods: Any = _hl("methods to time: exact, poslsh, windowed, fixed_block", ["exact", "poslsh", "windowed",
                                                                                "fixed_block"])
    exact_max_n: int = _h("largest n for which exact ALiBi is timed (and rel_fro computed)", default=32768)
    dtype: str = _h("float32, bfloat16, float16 or float64", default="float32")
    repeats: int = _h("timed repeats per point (median reported), after warmup", default=3)
    warmup: int = _h("untimed calls before timing", default=1)
    backward: bool = _h("time forward + backward instead of forward only", default=False)
    device: str = _h("auto (CUDA when present), cpu, cuda, cuda:N", default="auto")


SCHEMAS: dict[str, type] = {
    "sample": SampleConfig,
    "matrix-error": MatrixErrorConfig,
    "block-stats": BlockStatsConfig,
    "output-error": OutputErrorConfig,
    "bench": BenchConfig,
}


def config_name(command: str) -> str:
    """YAML file (without .yaml) in conf/ holding the defaults of ``command``."""
    return command.replace("-", "_")


def schema_name(command: str) -> str:
    return f"_schema_{config_name(command)}"


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for cmd, schema in SCHEMAS.items():
        cs.store(name=schema_name(cmd), node=schema)
    cs.store(group="model", name="_schema_model", node=ModelConfig)


def key_help(command: str) -> list[tuple[str, str, str]]:
    """(key, default as written in conf/, help) for every key of a command."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.load(CONF_DIR / f"{config_name(command)}.yaml")
    out = []
    own = [f for f in fields(SCHEMAS[command]) if f.name not in ("seed", "out")]
    for f in own + [f for f in fields(SCHEMAS[command]) if f.name in ("seed", "out")]:
        value = defaults.get(f.name, f.default if not callable(f.default_factory) else f.default_factory())  # type: ignore[misc]
        if hasattr(value, "name") and not isinstance(value, str):  # a nested group (model)
            value = value.name
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        out.append((f.name, _override_text(value), f.metadata["help"]))
    return out


def _override_text(value: Any) -> str:
    """A default written the way it is typed as an override: null, true, [a,b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_text(v) for v in value) + "]"
    return str(value)


# ---------------------------------------------------------------------------------------------
# validation: a composed DictConfig -> a typed, normalised dataclass


def as_list(value: Any, name: str, kind: type) -> tuple:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ConfigError(f"{name} must not be empty")
    out = []
    for v in items:
        try:
            if kind is int:
                if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
                    raise ValueError
                x = int(v)
            else:
                if isinstance(v, bool):
                    raise ValueError
                x = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}") from None
        out.append(x)
    return tuple(out)


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _check_sigmas(sigmas: tuple) -> None:
    for x in sigmas:
        check(math.isfinite(x) and x > 0, f"sigma must be > 0, got {x:g}")


def validate(command: str, cfg: Any) -> Any:
    """Typed, checked config for ``command`` from a composed config; raises ConfigError."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    raw = {k: v for k, v in raw.items() if k != "hydra"}
    schema = SCHEMAS[command]
    c = schema(**raw)
    check(isinstance(c.seed, int) and c.seed >= 0, f"seed must be an integer >= 0, got {c.seed!r}")
    if command == "sample":
        check(c.n >= 2, f"n must be >= 2, got {c.n}")
        check(c.s >= 1, f"s must be >= 1, got {c.s}")
        if c.heads is not None:
            check(c.heads >= 1, f"heads must be >= 1, got {c.heads}")
        else:
            check(c.sigma is not None, "give sigma= or heads=")
            _check_sigmas((float(c.sigma),))
        return c
    if command == "output-error":
        return _validate_output_error(c)
    if command == "bench":
        return _validate_bench(c)
    c.n = as_list(c.n, "n", int)
    c.sigma = as_list(c.sigma, "sigma", float)
    c.s = as_list(c.s, "s", int)
    for x in c.n:
        check(x >= 2, f"n must be >= 2, got {x}")
    for x in c.s:
        check(x >= 1, f"s must be >= 1, got {x}")
    _check_sigmas(c.sigma)
    check(c.trials >= 1, f"trials must be >= 1, got {c.trials}")
    if command == "block-stats" and c.s_per_log_n is not None:
        check(math.isfinite(float(c.s_per_log_n)) and float(c.s_per_log_n) > 0,
              f"s_per_log_n must be > 0, got {c.s_per_log_n}")
    if command == "matrix-error":
        check(c.method in ("fast", "dense", "both"), f"method must be fast, dense or both, got {c.method!r}")
        check(0 <= c.tol < 1, f"tol must be in [0, 1), got {c.tol}")
        if c.method != "fast":
            big = [x for x in c.n if x > c.dense_max_n]
            if big:
                raise ConfigError(f"method={c.method} builds n x n matrices; n={big[0]} exceeds "
                                  f"dense_max_n={c.dense_max_n} (raise it if you have the memory)")
    return c


DTYPES = ("float32", "float64", "bfloat16", "float16")
BASELINES = ("no_bias", "fixed_block", "windowed")


def _index_list(value: Any, name: str) -> Any:
    if value == "all" or value is None:
        return "all"
    items = as_list(value, name, int)
    for x in items:
        check(x >= 0, f"{name} must be >= 0, got {x}")
    return tuple(sorted(set(items)))


def _validate_output_error(c: Any) -> Any:
    from omegaconf import OmegaConf

    if isinstance(c.model, dict):
        c.model = ModelConfig(**c.model)
    check(c.n >= 2, f"n must be >= 2, got {c.n}")
    c.s = as_list(c.s, "s", int)
    for x in c.s:
        check(x >= 1, f"s must be >= 1, got {x}")
    check(c.trials >= 1, f"trials must be >= 1, got {c.trials}")
    if c.sigma is not None:
        _check_sigmas((float(c.sigma),))
    check(c.alibi == "standard", f"alibi must be standard, got {c.alibi!r}")
    causal = str(c.causal).lower()
    check(causal in ("auto", "true", "false"), f"causal must be auto, true or false, got {c.causal!r}")
    c.causal = causal
    c.layers = _index_list(c.layers, "layers")
    c.heads = _index_list(c.heads, "heads")
    check(c.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {c.dtype!r}")
    check(c.device == "auto" or c.device == "cpu" or str(c.device).startswith("cuda"),
          f"device must be auto, cpu or cuda[:N], got {c.device!r}")
    base = c.baselines
    if OmegaConf.is_config(base):
        base = OmegaConf.to_container(base)
    base = [base] if isinstance(base, str) else list(base or [])
    for b in base:
        check(b in BASELINES, f"unknown baseline {b!r} (choose from {', '.join(BASELINES)})")
    c.baselines = tuple(base)
    c.window_sigmas = as_list(c.window_sigmas, "window_sigmas", float)
    for w in c.window_sigmas:
        check(w > 0, f"window_sigmas must be > 0, got {w:g}")
    check(c.model.name in MODEL_PRESETS, f"unknown model preset {c.model.name!r}")
    return c


BENCH_METHODS = ("exact", "poslsh", "windowed", "fixed_block")


def _validate_bench(c: Any) -> Any:
    from omegaconf import OmegaConf

    c.n = as_list(c.n, "n", int)
    for x in c.n:
        check(x >= 2, f"n must be >= 2, got {x}")
    check(c.heads >= 1, f"heads must be >= 1, got {c.heads}")
    check(c.head_dim >= 1, f"head_dim must be >= 1, got {c.head_dim}")
    if c.sigma is not None:
        _check_sigmas((float(c.sigma),))
    causal = OmegaConf.to_container(c.causal) if OmegaConf.is_config(c.causal) else c.causal
    causal = causal if isinstance(causal, list) else [causal]
    for x in causal:
        check(isinstance(x, bool), f"causal must be true or false, got {x!r}")
    c.causal = tuple(causal)
    c.s = as_list(c.s, "s", int)
    for x in c.s:
        check(x >= 1, f"s must be >= 1, got {x}")
    c.window_sigmas = as_list(c.window_sigmas, "window_sigmas", float)
    for w in c.window_sigmas:
        check(w > 0, f"window_sigmas must be > 0, got {w:g}")
    methods = OmegaConf.to_container(c.methods) if OmegaConf.is_config(c.methods) else c.methods
    methods = [methods] if isinstance(methods, str) else list(methods)
    for m in methods:
        check(m in BENCH_METHODS, f"unknown method {m!r} (choose from {', '.join(BENCH_METHODS)})")
    c.methods = tuple(methods)
    check(c.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {c.dtype!r}")
    check(c.repeats >= 1, f"repeats must be >= 1, got {c.repeats}")
    check(c.warmup >= 0, f"warmup must be >= 0, got {c.warmup}")
    check(c.device == "auto" or c.device == "cpu" or str(c.device).startswith("cuda"),
          f"device must be auto, cpu or cuda[:N], got {c.device!r}")
    return c
