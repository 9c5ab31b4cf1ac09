"""Activation-DiFR: compressed fingerprints of the final normed hidden state (DiFR section 4.3).

Both sides project the hidden state h (the input to lm_head) with the same seeded matrix P
(D x k, orthonormal columns: a Gaussian matrix from ``torch.Generator(seed)`` made orthogonal by QR,
so the projection preserves distances exactly within its span rather than approximately) and
compare ``P^T h`` by L2 distance. The provider sends only k numbers per logged token.

Logging stride: with ``stride = s``, output index i carries a fingerprint iff
``i % s == seed % s`` (32 / s fingerprints in each 32-token window). The stride saves bytes; the
seed is shared, so it does not hide from the provider which positions are checked.

Storage precisions: fp32 (4 B/dim), fp16 and bf16 (2 B/dim), int8 (1 B/dim plus one fp32 scale
per fingerprint: symmetric per-vector absmax quantization). ``bytes_per_token`` is exact.

Fingerprint rows: one per output token, taken at the position that predicts it (the same rows the
Token-DiFR verifier scores), so generation (KV-cache decode) and verification (prefill) line up.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch

PRECISIONS = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
VERSION = 1


class FingerprintError(ValueError):
    """A malformed or inconsistent fingerprint commit; the message names what and where."""


@dataclass(frozen=True)
class FingerprintSpec:
    """Everything both sides must agree on to compare fingerprints."""

    dim: int = 8
    seed: int = 42
    precision: str = "fp32"
    stride: int = 1
    hidden_size: int = 576

    def problems(self) -> list[str]:
        out = []
        if not 1 <= self.dim <= self.hidden_size:
            out.append(f"dim {self.dim} is not in 1..{self.hidden_size}")
        if self.precision not in PRECISIONS:
            out.append(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.stride < 1:
            out.append(f"stride {self.stride} must be >= 1")
        return out

    @property
    def bytes_per_fingerprint(self) -> int:
        return self.dim * PRECISIONS[self.precision] + (4 if self.precision == "int8" else 0)

    def bytes_per_token(self) -> float:
        """Average bytes sent per generated token (fingerprints on 1 of every ``stride`` tokens)."""
        return self.bytes_per_fingerprint / self.stride

    def logged(self, n_tokens: int) -> np.ndarray:
        """Output indices that carry a fingerprint."""
        return np.arange(n_tokens)[np.arange(n_tokens) % self.stride == self.seed % self.stride]


_PROJECTIONS: dict[tuple[int, int, int], torch.Tensor] = {}


NESTED_DIM = 128


def projection(hidden_size: int, dim: int, seed: int) -> torch.Tensor:
    """The shared D x k matrix with orthonormal columns (fp64 QR of a seeded Gaussian, stored fp32).

    The Gaussian is drawn D x max(k, 128) and the first k columns of its Q are used, so the
    projections for k <= 128 are nested: a k-dim fingerprint is a prefix of the 128-dim one
    (Gram-Schmidt keeps earlier columns), and a verifier can compare any prefix.
    """
    width = max(dim, min(NESTED_DIM, hidden_size))
    key = (hidden_size, width, seed)
    if key not in _PROJECTIONS:
        gen = torch.Generator().manual_seed(seed)
        gauss = torch.randn(hidden_size, width, generator=gen, dtype=torch.float64)
        q, r = torch.linalg.qr(gauss)
        _PROJECTIONS[key] = (q * torch.sign(torch.diagonal(r))).float()  # unique QR: positive diagonal of R
    return _PROJECTIONS[key][:, :dim]


def fingerprint(hidden: torch.Tensor, spec: FingerprintSpec) -> np.ndarray:
    """``P^T h`` for each row of ``hidden`` [N, D], rounded to the storage precision (fp32 array)."""
    if hidden.shape[-1] != spec.hidden_size:
        raise FingerprintError(f"hidden size {hidden.shape[-1]} does not match the spec's {spec.hidden_size}")
    proj = hidden.float() @ projection(spec.hidden_size, spec.dim, spec.seed)
    return _round_trip(proj.numpy(), spec.precision)


def _round_trip(x: np.ndarray, precision: str) -> np.ndarray:
    """What the verifier will read back after storage at ``precision``."""
    return decode(encode(x, precision), precision, x.shape[-1], x.shape[0])


def encode(x: np.ndarray, precision: str) -> bytes:
    x = np.asarray(x, dtype=np.float32)
    if precision == "fp32":
        return x.astype("<f4").tobytes()
    if precision == "fp16":
        return x.astype("<f2").tobytes()
    if precision == "bf16":
        return torch.from_numpy(np.ascontiguousarray(x)).bfloat16().view(torch.int16).numpy().astype("<i2").tobytes()
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    return b"".join(s.astype("<f4").tobytes() + row.tobytes() for s, row in zip(scale, q))


def decode(data: bytes, precision: str, dim: int, count: int) -> np.ndarray:
    """Parse ``count`` fingerprints of ``dim`` values; FingerprintError on any inconsistency."""
    if precision not in PRECISIONS:
        raise FingerprintError(f"unknown precision {precision!r}")
    per = dim * PRECISIONS[precision] + (4 if precision == "int8" else 0)
    if len(data) != per * count:
        raise FingerprintError(f"expected {count} fingerprints of {per} bytes ({per * count} bytes), got {len(data)}")
    if precision == "fp32":
        out = np.frombuffer(data, "<f4").reshape(count, dim)
    elif precision == "fp16":
        out = np.frombuffer(data, "<f2").reshape(count, dim).astype(np.float32)
    elif precision == "bf16":
        bits = np.frombuffer(data, "<i2").reshape(count, dim).copy()
        out = torch.from_numpy(bits).view(torch.bfloat16).float().numpy()
    else:
        rows = np.frombuffer(data, np.uint8).reshape(count, per)
        scale = rows[:, :4].copy().view("<f4")
        out = rows[:, 4:].copy().view(np.int8).astype(np.float32) * scale
    out = np.asarray(out, dtype=np.float32)
    if not np.isfinite(out).all():
        raise FingerprintError("fingerprint values must be finite (found NaN or inf)")
    return out


@dataclass(frozen=True)
class FingerprintCommit:
    """What a provider attaches to a trace: the spec, the logged indices and the packed values."""

    spec: FingerprintSpec
    n_tokens: int
    values: np.ndarray  # [len(spec.logged(n_tokens)), dim] fp32 (already at storage precision)

    @classmethod
    def build(cls, hidden: torch.Tensor, spec: FingerprintSpec) -> "FingerprintCommit":
        """Fingerprint the rows of ``hidden`` [n_tokens, D] that the stride logs."""
        idx = torch.as_tensor(spec.logged(hidden.shape[0]))
        return cls(spec, int(hidden.shape[0]), fingerprint(hidden[idx], spec))

    def to_dict(self) -> dict:
        s = self.spec
        return {"method": "activation-difr", "version": VERSION, "dim": s.dim, "seed": s.seed,
                "precision": s.precision, "stride": s.stride, "hidden_size": s.hidden_size,
                "layer": "final_norm", "n_tokens": self.n_tokens,
                "values": base64.b64encode(encode(self.values, s.precision)).decode("ascii")}

    @classmethod
    def from_dict(cls, d: object, where: str = "fingerprint") -> "FingerprintCommit":
        """Parse a commit; FingerprintError naming ``where`` and the field on anything malformed."""
        try:
            if not isinstance(d, dict):
                raise FingerprintError(f"expected an object, got {type(d).__name__}")
            if d.get("method") != "activation-difr" or d.get("version") != VERSION:
                raise FingerprintError(f"unsupported method/version {d.get('method')!r}/{d.get('version')!r}")
            if d.get("layer", "final_norm") != "final_norm":
                raise FingerprintError(f"unsupported layer {d.get('layer')!r}")
            ints = {}
            for name in ("dim", "seed", "stride", "hidden_size", "n_tokens"):
                v = d.get(name)
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise FingerprintError(f"field {name!r} must be a non-negative integer, got {v!r}")
                ints[name] = v
            spec = FingerprintSpec(ints["dim"], ints["seed"], d.get("precision"), ints["stride"], ints["hidden_size"])
            if spec.problems():
                raise FingerprintError(spec.problems()[0])
            if not isinstance(d.get("values"), str):
                raise FingerprintError("field 'values' must be a base64 string")
            try:
                raw = base64.b64decode(d["values"], validate=True)
            except ValueError:
                raise FingerprintError("field 'values' is not valid base64") from None
            count = len(spec.logged(ints["n_tokens"]))
            return cls(spec, ints["n_tokens"], decode(raw, spec.precision, spec.dim, count))
        except FingerprintError as exc:
            raise FingerprintError(f"{where}: {exc}") from None


def distances(commit: FingerprintCommit, verifier_hidden: torch.Tensor) -> dict[str, np.ndarray]:
    """Per logged token: L2 distance and the per-dimension RMS (L2 / sqrt(k), comparable across k)."""
    if verifier_hidden.shape[0] != commit.n_tokens:
        raise FingerprintError(f"commit covers {commit.n_tokens} tokens but the verifier has {verifier_hidden.shape[0]}")
    idx = torch.as_tensor(commit.spec.logged(commit.n_tokens))
    mine = fingerprint(verifier_hidden[idx], commit.spec)
    l2 = np.linalg.norm(mine.astype(np.float64) - commit.values, axis=-1)
    return {"l2": l2, "rms": l2 / np.sqrt(commit.spec.dim), "index": idx.numpy()}
