"""The detection-power matrix (DiFR section 5): honest noise vs misconfigurations, cached and resumable.

Every configuration generates traces for the same prompts with vLLM's seeded sampler (T=1, top-k 50,
top-p 0.95), claiming the reference configuration; the fp32 reference verifies them with one prefill
per sequence. Generation is the slow part, so traces and scores are cached per configuration in
chunks of prompts: an interrupted run resumes at the first missing chunk, a finished one costs
nothing to re-analyse. The cache key holds every setting that changes the tokens (model file,
prompts, sampler, lengths, batch size, the verinfer version), so a changed setting never reads
stale data.

Honest configurations (pooled into the null, as the paper pools GPUs and engines): fp32 KV-cache
decoding at batch 16, the same at batch 4 (other padding and row shapes), and bfloat16 weights and
activations. Misconfigurations run on the fp32 model: they lack the bf16 noise a real quantized
deployment would add, which makes them *closer* to the reference and detection harder, not easier.

Each configuration claims its own seeds (the run seed plus a stable per-configuration offset), so
honest configurations contribute different samples rather than the same tokens twice.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

import verinfer
from verinfer.simulate import variants
from verinfer.studies.adversary import match_cross_entropy
from verinfer.stats.pooling import MARGIN_CLIP
from verinfer.models.backend import Backend
from verinfer.models.load import DEFAULT_MODEL
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams, parse_speculative
from verinfer.trace import read_traces, write_traces
from verinfer.scoring.scores import read_scores
from verinfer.scoring.traces import score_traces
from verinfer.simulate.generate import build_requests
from verinfer.scoring.token_difr import likelihood

BASE_PARAMS = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95)


@dataclass(frozen=True)
class Config:
    """One provider configuration in the matrix."""

    name: str
    variant: str  # a name in verinfer.simulate.variants
    honest: bool = False
    attack: bool = False  # temperature tuned until the verifier's mean cross-entropy matches honest
    target: int | None = None  # the paper's bar: AUC@1%FPR >= 0.99 within this many tokens
    target_detector: str | None = None  # detector label the target is stated for (None: best margin one)


HONEST = (
    Config("honest-fp32", "honest", honest=True),
    Config("batch-4", "batch-4", honest=True),
    Config("bf16", "bf16", honest=True),
)
MISCONFIGURED = (
    Config("w4", "w4", target=300),
    Config("w8", "w8"),
    Config("fp8-kv", "fp8-kv", target=5000),
    Config("wrong-seed", "wrong-seed", target=100),
    Config("top-p-0.85", "top-p-0.85", target=1000),
    Config("temperature-1.1", "temperature-1.1", target=10000),
    Config("bug-top2", "bug-top2", target=10000, target_detector="margin tail"),
    Config("bug-top32", "bug-top32"),
    Config("w4+ce-attack", "w4", attack=True),
    Config("fp8-kv+ce-attack", "fp8-kv", attack=True),
)
# With a speculative claim (``Matrix.speculative``) every configuration decodes speculatively (vLLM V2's
# rejection sampler, ``simulate/speculative.py``); these cheat on the speculation itself.
SPECULATIVE = (
    Config("spec-draft-only", "spec-draft-only"),
    Config("spec-top1", "spec-top1"),
    Config("no-spec", "no-spec"),
)
CONFIGS = {c.name: c for c in HONEST + MISCONFIGURED + SPECULATIVE + (Config("spec-undeclared", "spec-undeclared"),)}
DEFAULT_CONFIGS = tuple(c.name for c in HONEST + MISCONFIGURED)
SPECULATIVE_CONFIGS = ("honest-fp32", "bf16", "w4", "wrong-seed", *(c.name for c in SPECULATIVE))


@dataclass(frozen=True)
class Matrix:
    """The settings of one run; every field that changes tokens is part of the cache key."""

    configs: tuple[str, ...] = DEFAULT_CONFIGS
    model: str = DEFAULT_MODEL
    prompts: str = "chitchat"
    n_prompts: int = 128
    max_tokens: int = 64
    batch_size: int = 16
    chunk: int = 32
    seed: int = 1000
    attack_prompts: int = 32  # the adversary tunes its temperature on this many prompts
    attack_tokens: int = 48
    attack_bracket: tuple[float, float] = (0.1, 1.0)  # temperatures the adversary searches between
    attack_rounds: int = 8
    split_seed: int = 0
    device: str = "cpu"  # where the reference generates and verifies (part of the cache key: it changes tokens)
    speculative: str | None = None  # DRAFT:K: every configuration claims (and honestly runs) speculative decoding

    def __post_init__(self):
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown:
            raise ValueError(f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
        spec_only = {c.name for c in SPECULATIVE}
        if self.speculative is None and spec_only & set(self.configs):
            raise ValueError(f"{', '.join(sorted(spec_only & set(self.configs)))} need a speculative claim (--speculative)")
        if self.speculative is not None:
            parse_speculative(self.speculative)  # a malformed claim fails here, not after generation
            if "spec-undeclared" in self.configs:
                raise ValueError("spec-undeclared claims plain decoding: run it without --speculative")
        if not any(CONFIGS[c].honest for c in self.configs):
            raise ValueError("the matrix needs at least one honest configuration (the null)")
        for name, value in (("n_prompts", self.n_prompts), ("max_tokens", self.max_tokens),
                            ("batch_size", self.batch_size), ("chunk", self.chunk)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def claimed(self) -> SamplingParams:
        """What every configuration claims (seeds added per request)."""
        return BASE_PARAMS.with_(speculative=parse_speculative(self.speculative)) if self.speculative else BASE_PARAMS

    def config_seed(self, name: str) -> int:
        return self.seed + (zlib.crc32(name.encode()) % 9973) * 100_000

    def cache_key(self, config: Config, model_id: str) -> str:
        analysis_only = {"configs", "split_seed"}
        if not config.attack:  # the adversary's search settings change only the attack's tokens
            analysis_only |= {k for k in asdict(self) if k.startswith("attack_")}
        if self.speculative is None:  # keys of plain matrices stay as they were before speculative decoding
            analysis_only.add("speculative")
        settings = {k: v for k, v in asdict(self).items() if k not in analysis_only}
        settings.update(config=asdict(config), model_id=model_id, seed=self.config_seed(config.name),
                        base=self.claimed.to_dict(), verinfer=verinfer.__version__)
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class ConfigData:
    """Per-token scores of one configuration plus what its run recorded."""

    config: Config
    columns: dict[str, np.ndarray]  # trace_id, margin, likelihood, exact_match, cross_entropy
    info: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return int(self.columns["margin"].size)


Stage = Callable[[str], None]


def _metric_columns(scores: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    margin = np.asarray(scores["margin"], dtype=np.float64)
    return {
        "trace_id": np.asarray(scores["trace_id"]).astype(str),
        "margin": margin,
        "likelihood": likelihood(margin),
        "exact_match": np.asarray(scores["exact_match"], dtype=np.float64),
        "cross_entropy": np.asarray(scores["cross_entropy"], dtype=np.float64),
    }


def _attack_temperature(matrix: Matrix, config: Config, reference: Backend, built: Backend,
                        honest: ConfigData | None, requests, directory: Path, stage: Stage) -> dict:
    """The adversary's temperature (cached): matches the honest mean cross-entropy on a prompt subset."""
    path = directory / "attack.json"
    if path.exists():
        return json.loads(path.read_text())
    if honest is None:
        raise ValueError(f"{config.name} needs the honest-fp32 configuration in the matrix (its target)")
    ce = np.minimum(honest.columns["cross_entropy"], MARGIN_CLIP)
    target = float(ce.mean())
    stage(f"{config.name}: tuning the temperature to cross-entropy {target:.3f}")
    subset = requests[: matrix.attack_prompts]
    found = match_cross_entropy(reference, config.variant, subset, matrix.attack_tokens,
                                         matrix.batch_size, target=target, bracket=matrix.attack_bracket,
                                         rounds=matrix.attack_rounds, backend=built)
    info = {"temperature": found.temperature, "cross_entropy": found.cross_entropy, "target": target,
            "history": found.history, "bracketed": found.bracketed}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(path)
    return info


def run_config(matrix: Matrix, config: Config, reference: Backend, cache: Path, stage: Stage,
               honest: ConfigData | None = None, on_tokens: Callable[[int], None] | None = None) -> ConfigData:
    """Generate (or reuse) and verify (or reuse) one configuration, chunk by chunk."""
    directory = cache / f"{config.name}-{matrix.cache_key(config, reference.model_id)}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "settings.json").write_text(json.dumps({"matrix": asdict(matrix), "config": asdict(config),
                                                         "model_id": reference.model_id}, indent=1))
    prompts = load_prompts(matrix.prompts, matrix.n_prompts, seed=0)
    requests = build_requests(reference, prompts, matrix.claimed.with_(seed=matrix.config_seed(config.name)))
    variant = variants.get_variant(config.variant)
    built: Backend | None = None
    info: dict = {}
    parts = []
    for k, lo in enumerate(range(0, len(requests), matrix.chunk)):
        traces_path = directory / f"chunk-{k:03d}.traces.jsonl"
        scores_path = directory / f"chunk-{k:03d}.scores.parquet"
        if not scores_path.exists():
            if traces_path.exists():
                traces = read_traces(traces_path)
            else:
                if built is None:
                    built = variant.build(reference)
                if config.attack and not info:
                    info = _attack_temperature(matrix, config, reference, built, honest, requests, directory, stage)
                run_as = variants.compose(variant, variants.temperature_variant(info["temperature"])) \
                    if config.attack else variant
                stage(f"{config.name}: generating chunk {k + 1}")
                traces = run_as.generate(reference, requests[lo: lo + matrix.chunk], matrix.max_tokens,
                                         matrix.batch_size, backend=built, on_batch=None)
                write_traces(traces, traces_path)
            stage(f"{config.name}: verifying chunk {k + 1}")
            score_traces(reference, traces, scores_path, on_rows=on_tokens)
        parts.append(read_scores(scores_path))
    if config.attack and not info:
        info = json.loads((directory / "attack.json").read_text())
    merged = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    return ConfigData(config, _metric_columns(merged), {**info, "cache": str(directory)})


def run_matrix(matrix: Matrix, cache: Path, stage: Stage = lambda _: None,
               on_tokens: Callable[[int], None] | None = None) -> dict[str, ConfigData]:
    """Every configuration of ``matrix`` (honest ones first: the attacks need the honest target)."""
    reference = Backend.load(matrix.model, device=matrix.device)
    cache = Path(cache) / reference.model_id
    order = sorted(matrix.configs, key=lambda c: (not CONFIGS[c].honest, CONFIGS[c].attack))
    data: dict[str, ConfigData] = {}
    for name in order:
        data[name] = run_config(matrix, CONFIGS[name], reference, cache, stage, data.get("honest-fp32"), on_tokens)
    return {name: data[name] for name in matrix.configs}


def split_ids(data: dict[str, ConfigData], seed: int) -> set[str]:
    """Test prompt ids: half the prompts, the same half for every configuration (split by sequence)."""
    ids = sorted({i for d in data.values() for i in np.unique(d.columns["trace_id"])})
    if len(ids) < 2:
        raise ValueError("need at least two sequences to split into train and test")
    return set(np.random.default_rng(seed).permutation(ids)[: len(ids) // 2])


def split(columns: dict[str, np.ndarray], test_ids: set[str]) -> tuple[dict, dict]:
    test = np.isin(columns["trace_id"], list(test_ids))
    return ({k: v[~test] for k, v in columns.items()}, {k: v[test] for k, v in columns.items()})


def pool(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def smoke_matrix() -> Matrix:
    """A tiny matrix for the test suite: one honest and one misconfigured configuration."""
    return replace(Matrix(), configs=("honest-fp32", "wrong-seed"), n_prompts=16, max_tokens=20, batch_size=8,
                   chunk=8)


__all__ = ["BASE_PARAMS", "CONFIGS", "DEFAULT_CONFIGS", "SPECULATIVE_CONFIGS", "Config", "ConfigData", "HONEST", "MISCONFIGURED", "Matrix", "pool",
           "run_config", "run_matrix", "smoke_matrix", "split", "split_ids"]
