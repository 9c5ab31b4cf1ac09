"""TOPLOC commits: compact proofs of the final hidden states, and their verification.

A provider commits to the final normed hidden states (the input to lm_head) of prompt + output; a
verifier re-prefills the same tokens and checks its own hidden states against the commit. The
method and the proof format follow the TOPLOC paper and the reference library ``toploc`` 0.1.6
(facts only; this is an independent implementation in numpy/torch).

Chunks. Rows are cast to bf16. One chunk is the flattened prefill rows [0, prefill_len) (none if
prefill_len == 0); then every ``decode_chunk`` decode rows form a chunk (row-major flatten; the tail
chunk may be shorter). Indices are positions in the chunk's flattened array. Every chunk must hold
at least k elements.

Top-k: the reference's index set. ``toploc`` 0.1.6 (sdist, ``toploc/poly.py``: ``build_proofs``
and the Python ``verify_proofs``; ``toploc/C/csrc/poly.cpp``: the C++ ``verify_proofs``) takes the
indices of ``torch.topk(k)`` (largest, sorted) of the absolute values of the flattened chunk, in the
chunk's dtype (bf16). When entries tie at the k-th magnitude (524 of 600 random 32x4096 chunks, 83
of 172 real SmolLM2 chunks) the set is the one torch's CPU kernel picks: a heap selection
(``std::partial_sort``) over the row in index order when 64k <= n, else ``std::nth_element``. No
simple rule describes the result, so byte-identical proofs need the same algorithm: ``toploc_topk``
runs libstdc++'s heap selection itself (compiled, one chunk per row; rows are independent) and
calls ``torch.topk`` for the rest. The tests check both against ``torch.topk`` and against recorded
reference proofs (``tests/fixtures/toploc/``, torch 2.13 CPU). Only the set matters: the
interpolant through k points and the modulus do not depend on their order. Verification uses the
same selection, so its statistics are the reference's. (The reference on a GPU runs CUDA's top-k,
which may keep other tied entries; not covered here.)

Proof (reference layout, 2 + 2k bytes). Points (index mod m, u16 bit pattern of the signed bf16
value), with m the largest modulus <= 65497 making ``index mod m`` injective on the chunk's top-k;
the unique degree < k polynomial through them over GF(65497), as k ascending coefficients. Bytes:
big-endian u16 m, then k big-endian u16 coefficients. Finite bf16 patterns are <= 0xFF7F < 65497,
so no value is lost to the field. Base64: standard alphabet with padding, one string per proof.

Verification. For its own top-k indices i and own bit patterns v, the verifier evaluates the proof
polynomial at ``i mod m`` (always reduced mod m: the reference's Python path is not, so its honest
proofs with m != 65497 fail) and compares bits: exponent mismatches (bits 7..14), and the 7-bit
mantissa error |m_a - m_b| over positions whose exponents match, as mean and median. The median is
the reference's C++ check's (``verify_proofs`` in ``toploc/C/csrc/poly.cpp``): element size / 2 of
the sorted errors, the upper middle value for even counts (its Python path's ``statistics.median``
averages the two middle values; byte-identical proofs get the C++ path's verdicts). Both are inf
if no exponent matches (2**64 in the reference). Sign mismatches are reported too; the reference
ignores signs, and so do the default thresholds.
Reference bf16 acceptance: exp_mismatches <= 38, mean <= 10, median <= 8.

Strict parsing (differs from the reference, which accepts or crashes on these): a proof must be
exactly 2 + 2k bytes, its modulus in k..65497 (an honest modulus is injective on k indices, so it is
at least k), every coefficient below 65497, and base64 canonical. Every parser raises only
``CommitError`` with a one-line message naming what and where.

Envelope (``ToplocCommit``), binary layout version 1, all integers big-endian::

    offset  size   field
    0       4      magic b"VTLC"
    4       1      version (1)
    5       1      dtype code (1 = bf16)
    6       2      k
    8       4      decode_chunk (rows per decode chunk)
    12      4      hidden_size
    16      4      prefill_len
    20      4      n_tokens (rows committed: prompt + output)
    24      4      count (number of proofs; must equal the number of chunks)
    28      2      L, length of the model name in UTF-8 bytes
    30      L      model name (UTF-8)
    30 + L  count * (2 + 2k)   the proofs, in chunk order, each in the reference layout

Its dict form (``to_dict``) is JSON-ready: the same fields by name, plus ``method`` ("toploc"),
``dtype`` ("bf16") and ``proofs`` as base64 strings; ``from_dict`` rejects missing or unknown keys.
"""

from __future__ import annotations

import base64
import numbers
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from verinfer.commits.toploc_poly import MAX_POINTS, P, horner, injective_modulus, interpolate
from verinfer.commits.toploc_topk import select_topk

FORMAT_VERSION = 1
MAGIC = b"VTLC"
_DTYPE_CODES = {"bf16": 1}
_HEADER = struct.Struct(">4sBBHIIIIIH")
_U32_MAX = 2**32 - 1


class CommitError(ValueError):
    """A malformed commit, proof or hidden-state tensor (the only error parsers raise)."""


@dataclass(frozen=True)
class Thresholds:
    """Acceptance limits per chunk; the defaults are the reference library's bf16 values.

    ``sign_mismatches`` is None (unchecked) by default, as in the reference.
    """

    exp_mismatches: int = 38
    mean_mantissa_err: float = 10.0
    median_mantissa_err: float = 8.0
    sign_mismatches: int | None = None

    def accepts(self, exp: int, mean: float, median: float, signs: int) -> bool:
        """Whether statistics of one chunk are within every limit."""
        return (
            exp <= self.exp_mismatches
            and mean <= self.mean_mantissa_err
            and median <= self.median_mantissa_err
            and (self.sign_mismatches is None or signs <= self.sign_mismatches)
        )


@dataclass(frozen=True)
class ChunkCheck:
    """Raw statistics of one chunk (usable as continuous scores) and the threshold verdict."""

    exp_mismatches: int
    mean_mantissa_err: float
    median_mantissa_err: float
    sign_mismatches: int
    passed: bool

    @property
    def score(self) -> float:
        return chunk_score(self.exp_mismatches, self.mean_mantissa_err)


def chunk_score(exp_mismatches, mean_mantissa_err):
    """One continuous divergence score per chunk (for calibration and AUC): exponent mismatches
    plus the mean mantissa error, capped at 128 (it is infinite when no exponent matches)."""
    return exp_mismatches + np.minimum(mean_mantissa_err, 128.0)


# --- hidden states and chunks ------------------------------------------------------------------


def _require_int(value: object, name: str, lo: int, hi: int, where: str) -> int:
    """An integer in lo..hi (numpy integers allowed, bool not), else CommitError."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise CommitError(f"{where}: {name} must be an integer, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        shown = value if value.bit_length() <= 64 else "(huge)"
        raise CommitError(f"{where}: {name} {shown} is not in {lo}..{hi}")
    return value


def bf16_bits(hidden: torch.Tensor | np.ndarray) -> np.ndarray:
    """The [n_tokens, hidden_size] states cast to bf16, as u16 bit patterns; rejects bad input."""
    where = "hidden states"
    if isinstance(hidden, np.ndarray):
        if hidden.dtype.kind != "f":
            raise CommitError(f"{where}: dtype {hidden.dtype} is not floating point")
        if hidden.dtype not in (np.float16, np.float32, np.float64):
            hidden = hidden.astype(np.float64)
        hidden = torch.from_numpy(np.ascontiguousarray(hidden))
    if not isinstance(hidden, torch.Tensor):
        raise CommitError(f"{where}: expected a torch tensor or numpy array, got {type(hidden).__name__}")
    if not hidden.is_floating_point() or hidden.layout != torch.strided:
        raise CommitError(f"{where}: dtype {hidden.dtype} ({hidden.layout}) is not dense floating point")
    if hidden.ndim != 2 or hidden.shape[1] == 0:
        raise CommitError(f"{where}: shape {tuple(hidden.shape)} is not [n_tokens, hidden_size]")
    states = hidden.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    bits = states.view(torch.int16).numpy().view(np.uint16)
    if ((bits & 0x7F80) == 0x7F80).any():  # exponent all ones: inf or NaN
        raise CommitError(f"{where}: NaN or inf (after the cast to bf16)")
    return bits


def count_chunks(n_tokens: int, prefill_len: int, decode_chunk: int) -> int:
    """Number of proofs: one for a non-empty prefill, one per started decode chunk."""
    return int(prefill_len > 0) + -(-(n_tokens - prefill_len) // decode_chunk)


def _check_layout(
    n_tokens: int, hidden_size: int, prefill_len: object, decode_chunk: object, k: object, where: str
) -> int:
    """Validate chunking parameters against a [n_tokens, hidden_size] shape; return the chunk count."""
    prefill_len = _require_int(prefill_len, "prefill_len", 0, n_tokens, where)
    decode_chunk = _require_int(decode_chunk, "decode_chunk", 1, _U32_MAX, where)
    k = _require_int(k, "k", 1, MAX_POINTS, where)
    decode_rows = n_tokens - prefill_len
    tail = decode_rows % decode_chunk or decode_chunk  # the smallest decode chunk
    rows = ([prefill_len] if prefill_len else []) + ([tail] if decode_rows else [])
    if rows and min(rows) * hidden_size < k:
        raise CommitError(f"{where}: a chunk of {min(rows)} x {hidden_size} elements is smaller than k={k}")
    return count_chunks(n_tokens, prefill_len, decode_chunk)


def _chunk_groups(bits: np.ndarray, prefill_len: int, decode_chunk: int) -> list[np.ndarray]:
    """The chunks as rows of flattened u16 patterns, in chunk order, grouped by length: the prefill
    chunk, the full decode chunks, the decode tail (each group present only if non-empty)."""
    n_tokens = bits.shape[0]
    full_end = prefill_len + (n_tokens - prefill_len) // decode_chunk * decode_chunk
    groups = [bits[:prefill_len].reshape(1, -1)] if prefill_len else []
    if full_end > prefill_len:
        groups.append(bits[prefill_len:full_end].reshape(-1, decode_chunk * bits.shape[1]))
    if n_tokens > full_end:
        groups.append(bits[full_end:].reshape(1, -1))
    return groups


# --- proof bytes and base64 --------------------------------------------------------------------


def proof_size(k: int) -> int:
    """Bytes in one proof: u16 modulus and k u16 coefficients."""
    return 2 + 2 * k


def encode_proof(modulus: int, coeffs: np.ndarray) -> bytes:
    """Reference layout: big-endian u16 modulus, then the coefficients as big-endian u16."""
    return np.concatenate([[modulus], coeffs]).astype(">u2").tobytes()


def decode_proof(data: object, k: int, index: int = 0) -> tuple[int, np.ndarray]:
    """(modulus, int64 coefficients) of proof number ``index``; CommitError if malformed."""
    where = f"toploc proof {index}"
    k = _require_int(k, "k", 1, MAX_POINTS, where)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CommitError(f"{where}: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) != proof_size(k):
        raise CommitError(f"{where}: {len(data)} bytes, expected {proof_size(k)} for k={k}")
    modulus = int.from_bytes(data[:2], "big")
    if not k <= modulus <= P:
        raise CommitError(f"{where}: modulus {modulus} is not in {k}..{P}")
    coeffs = np.frombuffer(data, dtype=">u2", offset=2).astype(np.int64)
    if (coeffs >= P).any():
        bad = int(np.argmax(coeffs >= P))
        raise CommitError(f"{where}: coefficient {bad} is {coeffs[bad]}, not below {P}")
    return modulus, coeffs


def decode_proofs(raws: Sequence[bytes], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(moduli [n], coefficients [n, k]) of many proofs in one pass, int64; CommitError names the first
    malformed one (the message ``decode_proof`` gives it)."""
    k = _require_int(k, "k", 1, MAX_POINTS, "toploc proofs")
    for i, raw in enumerate(raws):
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != proof_size(k):
            decode_proof(raw, k, i)  # raises
    table = np.frombuffer(b"".join(raws), dtype=">u2").reshape(len(raws), k + 1).astype(np.int64)
    moduli, coeffs = table[:, 0], table[:, 1:]
    if len(raws) and (moduli.min() < k or moduli.max() > P or coeffs.max() >= P):
        bad = (moduli < k) | (moduli > P) | (coeffs >= P).any(axis=1)
        first = int(np.argmax(bad))
        decode_proof(raws[first], k, first)  # raises
    return moduli, coeffs


def _b64decode(text: object, where: str) -> bytes:
    """Strict standard base64 (alphabet, padding, canonical trailing bits)."""
    if not isinstance(text, str):
        raise CommitError(f"{where}: expected a base64 string, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error and non-ASCII text are both ValueErrors
        raise CommitError(f"{where}: not valid base64") from None
    if base64.b64encode(raw).decode("ascii") != text:
        raise CommitError(f"{where}: not canonical base64")
    return raw


def proofs_to_base64(proofs: Sequence[bytes]) -> list[str]:
    """One standard base64 string per proof (the reference library's string format)."""
    return [base64.b64encode(p).decode("ascii") for p in proofs]


def proofs_from_base64(texts: Sequence[str], k: int = 128) -> list[bytes]:
    """Decode and validate base64 proofs; CommitError names the first bad one."""
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise CommitError(f"toploc proofs: expected a list of base64 strings, got {type(texts).__name__}")
    raws = [_b64decode(t, f"toploc proof {i}") for i, t in enumerate(texts)]
    decode_proofs(raws, k)
    return raws


def _as_proof_bytes(proofs: object) -> list[bytes]:
    """Accept a list of raw proofs or base64 strings."""
    if type(proofs) not in (list, tuple) and (isinstance(proofs, (str, bytes, bytearray))
                                              or not isinstance(proofs, Sequence)):
        raise CommitError(f"toploc proofs: expected a list of proofs, got {type(proofs).__name__}")
    return [_b64decode(p, f"toploc proof {i}") if isinstance(p, str) else p for i, p in enumerate(proofs)]


# --- build and verify --------------------------------------------------------------------------


def build_proofs(
    hidden: torch.Tensor | np.ndarray, prefill_len: int, decode_chunk: int = 32, k: int = 128
) -> list[bytes]:
    """Proofs (reference layout) for the prefill chunk and each decode chunk of ``hidden``."""
    bits = bf16_bits(hidden)
    _check_layout(bits.shape[0], bits.shape[1], prefill_len, decode_chunk, k, "hidden states")
    proofs: list[bytes] = []
    for group in _chunk_groups(bits, int(prefill_len), int(decode_chunk)):
        idx = select_topk(group, int(k))
        moduli = np.array([_modulus(row, len(proofs) + c) for c, row in enumerate(idx)], dtype=np.int64)
        coeffs = interpolate(idx % moduli[:, None], group[np.arange(len(group))[:, None], idx])
        proofs += [encode_proof(m, c) for m, c in zip(moduli, coeffs)]
    return proofs


def _modulus(indices: np.ndarray, chunk: int) -> int:
    """Injective modulus of one chunk's top-k indices."""
    modulus = injective_modulus(indices)
    if modulus is None:
        raise CommitError(f"toploc chunk {chunk}: no modulus in {indices.size}..{P} is injective on its top-k")
    return modulus


@njit(cache=True)
def _check_chunks(
    rows: np.ndarray, indices: np.ndarray, moduli: np.ndarray, coeffs: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per chunk (rows of own u16 patterns, own top-k indices, the proofs' moduli and coefficients):
    exponent mismatches, mean and median mantissa error, sign mismatches of the proof's values
    against the own patterns at the own top-k (module docstring, "Verification")."""
    n_chunks, k = indices.shape
    exps, signs = np.zeros(n_chunks, np.int64), np.zeros(n_chunks, np.int64)
    means, medians = np.full(n_chunks, np.inf), np.full(n_chunks, np.inf)
    xs, claimed, counts = np.empty(k), np.empty(k), np.empty(0x80, np.int64)
    for chunk in range(n_chunks):
        for i in range(k):
            xs[i] = indices[chunk, i] % moduli[chunk]
        horner(coeffs[chunk], xs, claimed)
        counts[:] = 0
        total = 0
        for i in range(k):
            a, b = np.int64(claimed[i]), np.int64(rows[chunk, indices[chunk, i]])
            signs[chunk] += (a ^ b) >> 15 & 1
            if (a >> 7 & 0xFF) != (b >> 7 & 0xFF):
                exps[chunk] += 1
            else:
                error = abs((a & 0x7F) - (b & 0x7F))
                counts[error] += 1
                total += error
        matched = k - exps[chunk]
        if matched:
            means[chunk] = total / matched
            seen, error = counts[0], 0
            while seen <= matched // 2:  # element matched // 2 of the sorted errors: the upper middle
                error += 1
                seen += counts[error]
            medians[chunk] = error
    return exps, means, medians, signs


def verify_proofs(
    hidden: torch.Tensor | np.ndarray,
    prefill_len: int,
    proofs: Sequence[bytes | str],
    decode_chunk: int = 32,
    k: int = 128,
    thresholds: Thresholds = Thresholds(),
) -> list[ChunkCheck]:
    """Check each proof against the verifier's own hidden states, one ChunkCheck per chunk.

    Proofs may be raw bytes or base64 strings. A proof count different from the chunk count, or
    any malformed proof or tensor, raises CommitError; a wrong but well-formed proof fails its check.
    """
    bits = bf16_bits(hidden)
    n_chunks = _check_layout(bits.shape[0], bits.shape[1], prefill_len, decode_chunk, k, "hidden states")
    raws = _as_proof_bytes(proofs)
    if len(raws) != n_chunks:
        raise CommitError(f"toploc proofs: got {len(raws)} proofs for {n_chunks} chunks")
    moduli, coeffs = decode_proofs(raws, k)
    columns, start = [], 0
    for group in _chunk_groups(bits, int(prefill_len), int(decode_chunk)):
        end = start + len(group)
        columns.append(_check_chunks(group, select_topk(group, int(k)), moduli[start:end], coeffs[start:end]))
        start = end
    stats = zip(*(np.concatenate(column).tolist() for column in zip(*columns))) if columns else ()
    return [ChunkCheck(e, a, b, s, thresholds.accepts(e, a, b, s)) for e, a, b, s in stats]


# --- envelope ----------------------------------------------------------------------------------


_DICT_KEYS = (
    "version", "method", "dtype", "k", "decode_chunk", "hidden_size", "model", "prefill_len", "n_tokens",
    "count", "proofs",
)


@dataclass(frozen=True)
class ToplocCommit:
    """A self-describing, versioned TOPLOC commit for one sequence (layout in the module docstring).

    Construction validates every field, so any instance (including one from a parser) is well formed.
    """

    k: int
    decode_chunk: int
    hidden_size: int
    model: str
    prefill_len: int
    n_tokens: int
    proofs: tuple[bytes, ...]
    version: int = FORMAT_VERSION
    method: str = "toploc"
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        where = "toploc commit"
        for name in ("method", "dtype", "model"):
            if not isinstance(getattr(self, name), str):
                raise CommitError(f"{where}: {name} must be a string, got {type(getattr(self, name)).__name__}")
        if _require_int(self.version, "version", 0, _U32_MAX, where) != FORMAT_VERSION:
            raise CommitError(f"{where}: unknown version {self.version} (supported: {FORMAT_VERSION})")
        if self.method != "toploc":
            raise CommitError(f"{where}: method {self.method!r:.40} is not 'toploc'")
        if self.dtype not in _DTYPE_CODES:
            raise CommitError(f"{where}: unknown dtype {self.dtype!r:.40} (supported: {', '.join(_DTYPE_CODES)})")
        try:
            encoded = self.model.encode("utf-8")
        except UnicodeEncodeError:
            raise CommitError(f"{where}: model name is not encodable as UTF-8") from None
        if len(encoded) > 0xFFFF:
            raise CommitError(f"{where}: model name of {len(encoded)} bytes is longer than 65535")
        hidden_size = _require_int(self.hidden_size, "hidden_size", 1, _U32_MAX, where)
        n_tokens = _require_int(self.n_tokens, "n_tokens", 0, _U32_MAX, where)
        n_chunks = _check_layout(n_tokens, hidden_size, self.prefill_len, self.decode_chunk, self.k, where)
        proofs = _as_proof_bytes(self.proofs)
        if len(proofs) != n_chunks:
            raise CommitError(f"{where}: {len(proofs)} proofs for {n_chunks} chunks")
        decode_proofs(proofs, self.k)
        for name in ("version", "k", "decode_chunk", "hidden_size", "prefill_len", "n_tokens"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "proofs", tuple(bytes(p) for p in proofs))

    @property
    def count(self) -> int:
        """Number of proofs (one per chunk)."""
        return len(self.proofs)

    @classmethod
    def from_hidden(
        cls, hidden: torch.Tensor | np.ndarray, prefill_len: int, model: str, decode_chunk: int = 32, k: int = 128
    ) -> ToplocCommit:
        """Commit to the final normed hidden states of prompt + output."""
        proofs = build_proofs(hidden, prefill_len, decode_chunk, k)
        n_tokens, hidden_size = hidden.shape
        return cls(k, decode_chunk, hidden_size, model, prefill_len, n_tokens, tuple(proofs))

    def verify(self, hidden: torch.Tensor | np.ndarray, thresholds: Thresholds = Thresholds()) -> list[ChunkCheck]:
        """Check the verifier's own hidden states of the same tokens against this commit."""
        shape = tuple(getattr(hidden, "shape", ()))
        if shape != (self.n_tokens, self.hidden_size):
            raise CommitError(f"hidden states: shape {shape} is not the commit's ({self.n_tokens}, {self.hidden_size})")
        return verify_proofs(hidden, self.prefill_len, list(self.proofs), self.decode_chunk, self.k, thresholds)

    def to_bytes(self) -> bytes:
        """Binary envelope, version 1."""
        model = self.model.encode("utf-8")
        header = _HEADER.pack(
            MAGIC, self.version, _DTYPE_CODES[self.dtype], self.k, self.decode_chunk, self.hidden_size,
            self.prefill_len, self.n_tokens, self.count, len(model),
        )
        return header + model + b"".join(self.proofs)

    @classmethod
    def from_bytes(cls, data: object) -> ToplocCommit:
        """Parse a binary envelope; CommitError on anything malformed."""
        where = "toploc commit"
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CommitError(f"{where}: expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEADER.size:
            raise CommitError(f"{where}: {len(data)} bytes is shorter than the {_HEADER.size}-byte header")
        magic, version, dtype_code, k, chunk, hidden_size, prefill_len, n_tokens, count, name_len = (
            _HEADER.unpack_from(data)
        )
        if magic != MAGIC:
            raise CommitError(f"{where}: bad magic {magic!r} (expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise CommitError(f"{where}: unknown version {version} (supported: {FORMAT_VERSION})")
        dtype = {code: name for name, code in _DTYPE_CODES.items()}.get(dtype_code)
        if dtype is None:
            raise CommitError(f"{where}: unknown dtype code {dtype_code}")
        body = data[_HEADER.size + name_len :]
        if len(data) < _HEADER.size + name_len or len(body) != count * proof_size(k):
            raise CommitError(
                f"{where}: {len(data)} bytes, expected {_HEADER.size + name_len + count * proof_size(k)} "
                f"for a {name_len}-byte model name and {count} proofs of k={k}"
            )
        try:
            model = data[_HEADER.size : _HEADER.size + name_len].decode("utf-8")
        except UnicodeDecodeError:
            raise CommitError(f"{where}: model name is not valid UTF-8") from None
        size = proof_size(k)
        proofs = tuple(body[i * size : (i + 1) * size] for i in range(count))
        return cls(k, chunk, hidden_size, model, prefill_len, n_tokens, proofs, version, "toploc", dtype)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form with base64 proofs."""
        return {
            "version": self.version, "method": self.method, "dtype": self.dtype, "k": self.k,
            "decode_chunk": self.decode_chunk, "hidden_size": self.hidden_size, "model": self.model,
            "prefill_len": self.prefill_len, "n_tokens": self.n_tokens, "count": self.count,
            "proofs": proofs_to_base64(self.proofs),
        }

    @classmethod
    def from_dict(cls, data: object) -> ToplocCommit:
        """Parse the dict form; CommitError on missing, unknown or malformed fields."""
        where = "toploc commit"
        if not isinstance(data, Mapping):
            raise CommitError(f"{where}: expected a dict, got {type(data).__name__}")
        missing = [key for key in _DICT_KEYS if key not in data]
        if missing:
            raise CommitError(f"{where}: missing fields {', '.join(missing)}")
        unknown = [repr(key)[:40] for key in data if key not in _DICT_KEYS]
        if unknown:
            raise CommitError(f"{where}: unknown fields {', '.join(unknown)}")
        texts = data["proofs"]
        if not isinstance(texts, list):
            raise CommitError(f"{where}: proofs must be a list, got {type(texts).__name__}")
        count = _require_int(data["count"], "count", 0, _U32_MAX, where)
        if count != len(texts):
            raise CommitError(f"{where}: count {count} but {len(texts)} proofs")
        proofs = tuple(_b64decode(text, f"toploc proof {i}") for i, text in enumerate(texts))
        return cls(
            data["k"], data["decode_chunk"], data["hidden_size"], data["model"], data["prefill_len"],
            data["n_tokens"], proofs, data["version"], data["method"], data["dtype"],
        )
