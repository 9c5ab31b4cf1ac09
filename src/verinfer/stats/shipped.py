"""Default calibrations shipped with verinfer, so a first ``verinfer verify`` judges against a correct null.

Each file in ``data/`` is an ordinary ``verinfer calibrate`` output fitted on honest fp32 and bf16
traces pooled (the null GPU providers need: RESULTS.md section 8), named by the model and the
sampling settings it covers; ``verify`` without ``--calibration`` uses the one whose signature
matches its traces exactly (model, verifier dtype, every sampling setting but the seed) and says
which in its output. ``experiments/default_calibrations.py`` rebuilds them.
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


__all__ = ["DATA_DIR", "calibration_filename", "find_calibration"]
