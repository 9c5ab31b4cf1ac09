"""Default calibrations shipped with verinfer, so a first ``verinfer verify`` judges against a correct null.

Each file in ``data/`` is an ordinary ``verinfer calibrate`` output fitted on honest fp32 and bf16
traces pooled (the null GPU providers need: RESULTS.md section 8), one per sampler profile, named by
the model and the sampling settings it covers; its ``coverage`` names the precisions, the profile
and the honest tokens behind it. ``verify`` without ``--calibration`` uses the one whose signature
matches its traces exactly (model, verifier dtype, every sampling setting but the seed) and says
which in its output, or says in one line (``no_default``) why none fits and how to fit one.
``experiments/default_calibrations.py`` rebuilds them.
"""

from __future__ import annotations

from pathlib import Path

from verinfer.stats.calibration import Calibrator, signature_mismatch

DATA_DIR = Path(__file__).with_name("data")


def calibration_filename(model: str, sampling: dict) -> str:
    """``calibration-<model>-<profile>-t<T>-k<K>-p<P>-minp<M>.json`` for one sampling signature."""
    return (f"calibration-{model}-{sampling.get('profile')}-t{sampling.get('temperature'):g}-k{sampling.get('top_k')}"
            f"-p{sampling.get('top_p'):g}-minp{sampling.get('min_p'):g}.json")


def find_calibration(signature: dict, data_dir: Path = DATA_DIR) -> Path | None:
    """The shipped calibration whose signature covers ``signature`` (one sampling setting), or None."""
    sampling = signature.get("sampling") or []
    if len(sampling) != 1:
        return None
    path = data_dir / calibration_filename(signature.get("model", ""), sampling[0])
    if not path.exists():
        return None
    calibrator = Calibrator.load(path)
    return path if signature_mismatch(calibrator.signature, signature) is None else None


def shipped_signatures(data_dir: Path = DATA_DIR) -> list[dict]:
    """The signatures of every shipped calibration (model, verifier dtype, sampling settings)."""
    return [Calibrator.load(p).signature or {} for p in sorted(data_dir.glob("calibration-*.json"))]


def _settings(s: dict) -> str:
    return f"T={s.get('temperature'):g} top-k {s.get('top_k')} top-p {s.get('top_p'):g} min-p {s.get('min_p'):g}"


def no_default(signature: dict, data_dir: Path = DATA_DIR) -> str:
    """One line for traces no shipped calibration fits: why, and the commands that fit a pooled
    fp32 + bf16 calibration for the traces' own settings (RESULTS.md section 8)."""
    model, dtype = signature.get("model"), signature.get("dtype")
    shipped = [s for s in shipped_signatures(data_dir) if s.get("model") == model]
    sampling = signature.get("sampling") or []
    if shipped and len(sampling) == 1 and all(s.get("dtype") != dtype for s in shipped):
        return (f"uncalibrated: the shipped calibrations for {model} are for a {shipped[0].get('dtype')} verifier, "
                f"not {dtype}: verify with `--dtype {shipped[0].get('dtype')}` to use them")
    if not shipped:
        why = f"none ships for model {model!r}"
    elif len(sampling) != 1:
        why = f"these traces mix {len(sampling)} sampling settings and a shipped one covers one"
    else:
        profiles: dict[str, list[str]] = {}
        for s in shipped:
            for one in s.get("sampling") or []:
                profiles.setdefault(_settings(one), []).append(str(one.get("profile")))
        why = (f"these traces claim {sampling[0].get('profile')} {_settings(sampling[0])}; shipped: "
               + "; ".join(f"{k} for {', '.join(sorted(v))}" for k, v in sorted(profiles.items())))
    claim = sampling[0] if len(sampling) == 1 else {}
    flags = (f" --model {model} --profile {claim.get('profile')} --temperature {claim.get('temperature'):g} "
             f"--top-k {claim.get('top_k')} --top-p {claim.get('top_p'):g} --min-p {claim.get('min_p'):g}"
             if claim else f" --model {model} <each setting's sampling options>")
    other = {k: v for k, v in claim.items() if k not in ("profile", "temperature", "top_k", "top_p", "min_p")}
    if other:
        flags += f" <and {', '.join(f'{k}={v}' for k, v in sorted(other.items()))}>"
    return (f"uncalibrated: no shipped calibration fits ({why}); fit one on honest traces of these settings: "
            f"`verinfer generate{flags} --dtype float32 -o h32.jsonl` and again with `--dtype bfloat16 -o h16.jsonl`, "
            f"`verinfer verify` each, `verinfer calibrate h32.scores.parquet h16.scores.parquet --precisions fp32,bf16 "
            f"-o cal.json`, then `--calibration cal.json` (verify, monitor)")


__all__ = ["DATA_DIR", "calibration_filename", "find_calibration", "no_default", "shipped_signatures"]
